"""What the launcher tells about ranks that never made a meshgroups call: under ``torchrun``,
which of this host's workers have no process any more.

A rank that exits before its first meshgroups call has no heartbeat, so the store cannot say it
is gone. torchrun can: its agent starts every worker of a host at once, gives the host a
contiguous block of global ranks (``RANK - LOCAL_RANK`` up to ``+ LOCAL_WORLD_SIZE``) and
starts them as children of one agent process, with the job's ``TORCHELASTIC_RUN_ID`` and
``MASTER_PORT`` in each one's environment. A rank of this host's block for which no running
child of the agent carries that run id, port and ``RANK`` has exited (a zombie not yet reaped
counts as exited). Ranks of other hosts
are not judged here: their own host's ranks see them when they wait. A job that numbers its ranks
itself (one torchrun agent per node, each its own world, the job's rank ``node_rank × nproc +
LOCAL_RANK`` on a store of its own: ``meshgroups.elastic.start``) shifts the block, and every
sibling's ``RANK``, by this process's rank minus its ``RANK``.

Linux only (``/proc``); where the launcher is not torchrun, or other processes' environments
cannot be read, nothing is judged and the heartbeat and the timeout decide as before::

    >>> import os
    >>> os.environ.get("TORCHELASTIC_RUN_ID") is not None or host_ranks() is None
    True
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

#: How often one process scans ``/proc`` at most (a scan reads every process's environment).
SCAN_EVERY = 1.0

_last: list[tuple[float, frozenset[int]]] = []


def _shift() -> int:
    """This process's rank in the default group minus torchrun's ``RANK`` (0 before
    ``init_process_group``, and where the job takes torchrun's numbering)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank() - int(os.environ["RANK"])


def host_ranks() -> range | None:
    """The global ranks torchrun placed on this host (``None``: not launched by torchrun)."""
    env = os.environ
    try:
        rank, local = int(env["RANK"]), int(env["LOCAL_RANK"])
        size = int(env["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        return None
    if "TORCHELASTIC_RUN_ID" not in env or not os.path.isdir("/proc"):
        return None
    first = rank - local + _shift()
    return range(first, first + size)


def _running_ranks() -> frozenset[int] | None:
    """The ``RANK`` of every running worker of this torchrun job on this host: the processes
    whose parent is this worker's parent (the agent) and whose environment carries the job's run
    id and port. ``None`` when a sibling's environment cannot be read (nothing is judged then)."""
    want = {
        b"TORCHELASTIC_RUN_ID": os.environ["TORCHELASTIC_RUN_ID"].encode(),
        b"MASTER_PORT": os.environ.get("MASTER_PORT", "").encode(),
    }
    agent, shift = os.getppid(), _shift()
    found: set[int] = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
            fields = stat[stat.rfind(")") + 2 :].split()
            if int(fields[1]) != agent or fields[0] in ("Z", "X"):
                continue  # not a sibling, or one that ended (a zombie not yet reaped)
            with open(f"/proc/{name}/environ", "rb") as f:
                raw = f.read()
        except FileNotFoundError:  # ended meanwhile
            continue
        except OSError:
            return None
        env = dict(item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
        if all(env.get(k) == v for k, v in want.items()) and env.get(b"RANK", b"").isdigit():
            found.add(int(env[b"RANK"]) + shift)
    return frozenset(found) if int(os.environ["RANK"]) + shift in found else None


def exited_before_first_call(ranks: Iterable[int]) -> list[int]:
    """Those of ``ranks`` (ranks without a heartbeat) that torchrun placed on this host and
    whose process is gone; ``[]`` where this cannot be told (not torchrun, no ``/proc``)."""
    here = host_ranks()
    if here is None:
        return []
    mine = [r for r in ranks if r in here]
    if not mine:
        return []
    now = time.monotonic()
    if not _last or now - _last[0][0] >= SCAN_EVERY:
        running = _running_ranks()
        if running is None:
            return []
        _last[:] = [(now, running)]
    running = _last[0][1]
    return [r for r in mine if r not in running]


__all__ = ["SCAN_EVERY", "exited_before_first_call", "host_ranks"]
