"""Cross-rank check that every rank is about to build the same groups.

A rank that builds a different layout would otherwise enter different ``new_group`` calls and
hang forever. Here each rank compares its plan fingerprint with rank 0's through the default
store before any group is created; every rank raises the same ``ValueError`` on a mismatch, and
a clear ``TimeoutError`` if some rank never arrives. Cost: O(1) store operations per rank.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

_PREFIX = "meshgroups/check"


def _wait(store: dist.Store, key: str, timeout: timedelta, what: str) -> None:
    try:
        store.wait([key], timeout)
    except Exception as exc:  # DistStoreError / RuntimeError depending on the store
        raise TimeoutError(f"{what} (waited {timeout.total_seconds():.0f}s): {exc}") from None


def check_same_plan(
    store: dist.Store,
    rank: int,
    world_size: int,
    fingerprint: str,
    description: str,
    timeout: timedelta,
) -> None:
    """Raise ``ValueError`` on every rank if any rank's ``fingerprint`` differs from rank 0's.

    Each call gets its own key space from a per-rank counter kept in the store itself, so a job
    may build several meshes; ranks must call in the same order, like any collective.
    """
    call = store.add(f"{_PREFIX}/calls/{rank}", 1)
    prefix = f"{_PREFIX}/{call}"
    mine = f"{fingerprint} {description}"
    if rank == 0:
        store.set(f"{prefix}/rank0", mine)
    _wait(
        store,
        f"{prefix}/rank0",
        timeout,
        f"rank {rank}: rank 0 never published its layout for init_mesh call #{call}; "
        "is init_mesh called on every rank?",
    )
    reference = store.get(f"{prefix}/rank0").decode()
    if reference != mine and store.add(f"{prefix}/n_bad", 1) == 1:
        store.set(f"{prefix}/bad", f"{rank}\n{mine}")
    if store.add(f"{prefix}/arrived", 1) == world_size:
        store.set(f"{prefix}/done", "1")
    _wait(
        store,
        f"{prefix}/done",
        timeout,
        f"rank {rank}: not every rank reached init_mesh call #{call}",
    )
    if store.check([f"{prefix}/bad"]):
        bad_rank, bad = store.get(f"{prefix}/bad").decode().split("\n", 1)
        raise ValueError(
            "init_mesh was called with different layouts on different ranks: "
            f"rank {bad_rank} has {bad!r} but rank 0 has {reference!r} "
            f"(this is rank {rank}); every rank must build the same layout"
        )
