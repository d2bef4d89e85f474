"""meshgroups on NCCL GPUs: one verdict line. For users with a multi-GPU machine (none is here).

meshgroups' NCCL paths are kept correct by reading torch's source and by gloo and fake-backend
tests; no machine the project is developed on can run NCCL across ranks. This script runs the
demo's checks (an all_reduce on every group, group rank == mesh position, a DTensor sharded over
the root mesh) on NCCL with a device-bound default group, for each group-creation strategy
that applies there and for a row-major and a permuted layout::

    torchrun --nproc-per-node 4 tools/gpu_check.py          # 4 GPUs (8 also works)

Rank 0 prints one line — ``meshgroups GPU check: PASS ...`` or ``FAIL ...`` with the first
failure — and the exit status is 0 only on PASS. On torch >= 2.15, ``"nccl"`` is the nccl2
backend (eager communicators, subgroups split from the parent); ``TORCH_DIST_USE_NCCL2=0`` runs
the legacy one, for a comparison.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch
import torch.distributed as dist

from meshgroups import Layout
from meshgroups.cli import run_checks


def layouts(world: int) -> list[tuple[str, Layout]]:
    """A row-major dp × tp layout and the same with the tp ranks of each row reversed."""
    tp = 2 if world % 2 == 0 else 1
    row_major = Layout(dp=world // tp, tp=tp)
    permuted = Layout.from_grid(np.ascontiguousarray(row_major.grid[:, ::-1]), ("dp", "tp"))
    return [("row-major", row_major), ("permuted", permuted)]


def main() -> int:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        print("meshgroups GPU check: SKIP (no CUDA device)")
        return 0
    device = torch.device("cuda", local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    failures: list[str] = []
    checks = 0
    try:
        for strategy in ("auto", "global", "split"):
            for label, layout in layouts(world):
                try:
                    result = run_checks(layout, f"cuda:{device.index}", strategy, timeout=120.0)
                except Exception as e:  # a refusal or a crash: this combination failed
                    failures.append(f"{strategy}/{label}: {type(e).__name__}: {e}")
                    continue
                checks += result["checks"]
                failures += [f"{strategy}/{label}: {f}" for f in result["failures"]]
        gathered: list[object] = [None] * world
        dist.all_gather_object(gathered, (checks, failures))
    finally:
        dist.destroy_process_group()
    total = sum(c for c, _ in gathered)  # type: ignore[misc]
    failed = [f for _, fs in gathered for f in fs]  # type: ignore[misc]
    if rank == 0:
        what = (
            f"torch {torch.__version__}, {world} ranks, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}"
        )
        if failed:
            print(f"meshgroups GPU check: FAIL ({what}): {len(failed)} failures; first: {failed[0]}")
        else:
            print(f"meshgroups GPU check: PASS ({what}): {total} checks (strategies auto, global, split)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
