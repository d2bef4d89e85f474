"""One code path for a worker that ``torchrun``'s agent may restart: ``start(...)`` either starts
the job (first run) or joins it (after the agent restarted this node's workers).

The configuration torchrun's semantics allow (the one torchft uses): **one agent per node** (or
replica group), each with a rendezvous of its own (``--nnodes=1:1`` or ``MIN:MAX``,
``--max-restarts=N``), and the job's store **outside every agent**: a ``TCPStore`` hosted by a
process of its own (``python -m meshgroups store``), whose address every worker is given. When a
worker of node B dies, agent B stops B's other workers and starts them all again
(``TORCHELASTIC_RESTART_COUNT`` > 0); the workers of the other nodes are untouched: they see B's
ranks lost, shrink, and admit the restarted processes, which take B's ranks back.

- First run (``TORCHELASTIC_RESTART_COUNT`` 0 or unset): ``init_process_group`` on the job's
  store with this worker's rank ``node_rank × WORLD_SIZE + RANK`` (torchrun's ``WORLD_SIZE`` and
  ``RANK`` are its agent's world: with ``--nnodes=1``, ``node_rank × nproc + LOCAL_RANK``) in a
  world of ``world_size`` (default: the layout's ranks and the spares), then
  ``Elastic(layout, ...)``.
- After a restart: ``Elastic.join(store, prefer=<that same rank>)``: a spare, which waits in
  ``standby()`` until the survivors' ``admit_newcomers()`` and ``grow()`` take it in.

``node_rank`` is the agent's number in the job (its node's, or its replica group's: 0, 1, ...):
torchrun's own ``GROUP_RANK`` is 0 on every node when each agent has a rendezvous of its own, so
it is given here (the argument, or the environment variable ``MESHGROUPS_NODE_RANK``)::

    >>> worker_rank({"RANK": "1", "WORLD_SIZE": "4", "MESHGROUPS_NODE_RANK": "1"})
    5
    >>> restarted({"TORCHELASTIC_RESTART_COUNT": "1"}), restarted({})
    (True, False)
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from meshgroups.elastic._elastic_mesh import Elastic
from meshgroups.errors import MeshConfigError
from meshgroups.layout import Layout

#: The environment variable ``start`` reads the node's number from when not given.
NODE_RANK = "MESHGROUPS_NODE_RANK"
#: The environment variable ``start`` reads the job store's ``host:port`` from when not given.
STORE = "MESHGROUPS_STORE"


def worker_rank(env: Mapping[str, str], node_rank: int | None = None) -> int:
    """This worker's rank in the job: ``node_rank × WORLD_SIZE + RANK`` (torchrun's, its agent's
    world; 0 and 1 without torchrun)."""
    if node_rank is None:
        if NODE_RANK not in env:
            raise MeshConfigError(
                f"start() needs the agent's (node's) number in the job: pass node_rank= or set {NODE_RANK} "
                "(torchrun's GROUP_RANK is 0 on every node when each agent has a rendezvous of its own)"
            )
        node_rank = int(env[NODE_RANK])
    return int(node_rank) * int(env.get("WORLD_SIZE", "1")) + int(env.get("RANK", "0"))


def restarted(env: Mapping[str, str]) -> bool:
    """Whether torchrun's agent restarted this worker (``TORCHELASTIC_RESTART_COUNT`` > 0)."""
    return int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0


def connect(address: str, timeout: float) -> dist.Store:
    """A client of the job's store at ``host:port``."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise MeshConfigError(f"the job's store address is host:port, got {address!r}")
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout))


def start(
    layout: Layout,
    store: dist.Store | str | None = None,
    *,
    node_rank: int | None = None,
    spares: Iterable[int] = (),
    world_size: int | None = None,
    backend: str = "gloo",
    join_timeout: float | None = None,
    **elastic: Any,
) -> Elastic:
    """Start this worker's part of an elastic job, or join it after torchrun's agent restarted
    the worker (see the module docstring); returns its ``Elastic``. Then, on every worker::

        el = start(Layout(dp_replicate=2, dp_shard=2, tp=2), node_rank=node, timeout=60)
        mg = el.standby() if el.is_spare else el.mg  # a restarted worker waits to be admitted

    On one process, without torchrun (a first run; ``store`` is the job's)::

        >>> import torch.distributed as dist
        >>> from meshgroups import Layout
        >>> el = start(Layout(dp=1, tp=1), dist.HashStore(), node_rank=0)
        >>> el.rank, el.is_spare, dist.get_world_size()
        (0, False, 1)
        >>> _ = el.close(); dist.destroy_process_group()

    Args:
        layout: the job's starting layout (``Elastic``'s).
        store: the job's store: a ``dist.Store``, its ``host:port``, or ``None`` for the
            ``MESHGROUPS_STORE`` environment variable. Never torchrun's agent store: a restart
            ends it with the node's workers.
        node_rank: this agent's number in the job, its node's or replica group's (default:
            ``MESHGROUPS_NODE_RANK``).
        spares, world_size: the job's idle ranks; the default group's size (default: one more
            than the largest rank of the layout and the spares).
        backend: ``init_process_group``'s (first run only).
        join_timeout: seconds a restarted worker waits for a rank (default: forever).
        elastic: ``Elastic``'s keywords (``timeout``, ``heartbeat``, ``stale_after``, ...);
            ``timeout`` is the default group's too.

    Raises:
        MeshConfigError: no node rank, no store, a bad store address; what ``Elastic`` and
            ``Elastic.join`` raise.
    """
    env = os.environ
    rank = worker_rank(env, node_rank)
    given = elastic.get("timeout")
    timeout = given.total_seconds() if isinstance(given, timedelta) else float(given or 1800.0)
    if store is None:
        if STORE not in env:
            raise MeshConfigError(f"start() needs the job's store: pass store= or set {STORE}=host:port")
        store = env[STORE]
    if isinstance(store, str):
        store = connect(store, timeout)
    if restarted(env):
        el: Elastic = Elastic.join(store, timeout=join_timeout, prefer=rank)
        return el
    spares = tuple(int(r) for r in spares)
    world = world_size if world_size is not None else max([*layout.grid.ravel().tolist(), *spares]) + 1
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout)
    )
    return Elastic(layout, spares=spares, **elastic)


__all__ = ["NODE_RANK", "STORE", "connect", "restarted", "start", "worker_rank"]
