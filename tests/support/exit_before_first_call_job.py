"""Run under torchrun by ``tests/mesh/test_mesh_liveness.py`` (world F): ranks 2 and 3 leave before
any meshgroups call; ranks 0 and 1 call ``init_mesh`` over all four with a long timeout and must
name them as exited within seconds. Each surviving rank prints one JSON line."""

from __future__ import annotations

import json
import os
import sys
import time

import torch.distributed as dist

from meshgroups import Layout, init_mesh
from meshgroups.errors import RanksGoneError
from meshgroups.mesh._torch_seam import default_store


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def main() -> None:
    timeout, heartbeat, lease = (float(x) for x in sys.argv[1:4])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    store = default_store()
    if rank >= 2:
        store.set(f"test/pid/{rank}", str(os.getpid()))
        return  # exits 0 before its first meshgroups call: no heartbeat ever
    # Both leavers' processes gone first (one may take longer to exit than the other under load:
    # the first rank to see a rank gone decides the wait, naming the ranks gone by then).
    pids = [int(store.get(f"test/pid/{r}")) for r in (2, 3)]
    deadline = time.monotonic() + timeout
    while any(os.path.exists(f"/proc/{pid}") and not _zombie(pid) for pid in pids):
        if time.monotonic() > deadline:
            raise TimeoutError(f"ranks 2 and 3 (pids {pids}) did not exit")
        time.sleep(0.05)
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
