"""Run under torchrun by ``tests/test_mesh_liveness.py`` (world F): ranks 2 and 3 leave before
any meshgroups call; ranks 0 and 1 call ``init_mesh`` over all four with a long timeout and must
name them as exited within seconds. Each surviving rank prints one JSON line."""

from __future__ import annotations

import json
import sys
import time

import torch.distributed as dist

from meshgroups import Layout, init_mesh
from meshgroups.errors import RanksGoneError


def main() -> None:
    timeout, heartbeat, lease = (float(x) for x in sys.argv[1:4])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank >= 2:
        return  # exits 0 before its first meshgroups call: no heartbeat ever
    start = time.monotonic()
    try:
        init_mesh(Layout(dp=4), timeout=timeout, heartbeat=heartbeat, lease=lease)
        result = {"rank": rank, "error": None}
    except RanksGoneError as exc:
        result = {"rank": rank, "error": str(exc), "ranks": list(exc.ranks), "states": exc.states}
    result["elapsed"] = time.monotonic() - start
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
