"""Shared by the liveness tests: the liveness settings they run with (multiples of one scaled
heartbeat interval), a rank killed or stopped at a chosen point, the "still waiting" lines a
rank logged, and keeping rank 0 (the store's host) alive until the other survivors are done."""

from __future__ import annotations

import os
import signal
import time

from .timing import scaled

#: The heartbeat interval of the liveness tests; every bound is a multiple of it.
HB = scaled(0.2)
#: The lease: a rank whose heartbeat did not change for this long stopped responding.
LEASE = 6 * HB
#: Seconds between two "still waiting" lines.
REPORT = 3 * HB
#: How long a surviving rank may take to name a rank that died (or stopped): the lease, plus a
#: few intervals for looking, deciding and closing the call on a loaded machine — never the
#: default group's timeout, which these jobs set to half an hour (scaled).
BOUND = LEASE + 15 * HB
#: The default group's timeout of these jobs (nominal; ``run`` scales it): a liveness failure
#: would wait this out, and the job's timeout (far shorter) fails the test first.
PG_TIMEOUT = 1800
OPTIONS = {"heartbeat": HB, "lease": LEASE, "report_every": REPORT}


def die_in_nth_new_group(n: int, sig: int = signal.SIGKILL) -> None:
    """Make this process send itself ``sig`` inside its ``n``-th ``dist.new_group`` call from now
    on (in the middle of a collective call, after its rendezvous)."""
    import torch.distributed as dist

    real, calls = dist.new_group, {"n": 0}

    def dying(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == n:
            os.kill(os.getpid(), sig)
        return real(*args, **kwargs)

    dist.new_group = dying


class Lines:
    """The ``meshgroups`` logger's lines of this process, with their times, while installed."""

    def __init__(self) -> None:
        import logging

        class Keep(logging.Handler):
            def emit(inner, record):
                self.lines.append((record.created, record.getMessage()))

        self.lines: list[tuple[float, str]] = []
        self.handler = Keep()
        logging.getLogger("meshgroups").addHandler(self.handler)

    def matching(self, *words: str) -> list[tuple[float, str]]:
        return [(t, m) for t, m in self.lines if all(w in m for w in words)]

    def close(self) -> None:
        import logging

        logging.getLogger("meshgroups").removeHandler(self.handler)


def timed(call):
    """``(exception or None, seconds)`` of ``call()``."""
    start = time.monotonic()
    try:
        call()
        return None, time.monotonic() - start
    except Exception as exc:
        return exc, time.monotonic() - start


def publish_pid(rank: int) -> None:
    from meshgroups.mesh._torch_seam import default_store

    default_store().set(f"test/pid/{rank}", str(os.getpid()))


def kill_rank(rank: int) -> None:
    """SIGKILL the process of ``rank`` (a stopped one, at the end of a test)."""
    from meshgroups.mesh._torch_seam import default_store

    pid = int(default_store().get(f"test/pid/{rank}"))
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def leave_together(rank: int, survivors: int, key: str = "test/done") -> None:
    """Every survivor checks in; rank 0 hosts the store, so it leaves last (after each of the
    others made its last store call)."""
    from meshgroups.mesh._torch_seam import default_store

    store = default_store()
    store.add(key, 1)
    deadline = time.monotonic() + scaled(60)
    while int(store.add(key, 0)) < survivors and time.monotonic() < deadline:
        time.sleep(0.02)
    if rank != 0:
        store.add(f"{key}/left", 1)
        return
    while int(store.add(f"{key}/left", 0)) < survivors - 1 and time.monotonic() < deadline:
        time.sleep(0.02)


def share(rank: int, out: dict) -> None:
    """Leave this rank's results so far in the store (rank 0 hosts it), for a rank that dies
    later in the job: ``shared_results`` on rank 0 reads them back."""
    import pickle

    from meshgroups.mesh._torch_seam import default_store

    default_store().set(f"test/out/{rank}", pickle.dumps(out))


def shared_results(ranks) -> dict:
    """``{rank: results}`` that ``share`` left for ``ranks`` (those that left any)."""
    import pickle

    from meshgroups.mesh._torch_seam import default_store

    store = default_store()
    return {r: pickle.loads(store.get(f"test/out/{r}")) for r in ranks if store.check([f"test/out/{r}"])}


def results_of(results: list, shared_by: int = 0) -> list:
    """Each rank's results: what it returned, else what it shared before it died."""
    kept = results[shared_by].get("shared", {}) if results[shared_by] is not None else {}
    return [out if out is not None else kept.get(rank) for rank, out in enumerate(results)]
