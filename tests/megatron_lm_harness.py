"""Run Megatron-LM's own parallel-state unit tests on CPU gloo processes, against megatron-core
or against meshgroups.compat substituted for it (tests' helper, not collected by pytest).

    python -m tests.megatron_lm_harness --git-dir <Megatron-LM git dir> [--tag core_v0.16.1]
        [--mode compat|megatron-core|both] [--world 8]

Extracts ``tests/unit_tests/test_parallel_state.py`` and ``test_process_groups_config.py`` at
``--tag`` into a scratch directory, beside a CPU stand-in for Megatron's
``tests/unit_tests/test_utilities.py`` (the same ``Utils`` calls, gloo instead of NCCL) and a
``conftest.py`` that, in compat mode, calls ``meshgroups.compat.megatron.install()`` before
megatron-core is imported. Then runs pytest on ``--world`` processes (env ``RANK`` /
``LOCAL_RANK`` / ``WORLD_SIZE``, one TCP store) and prints each rank's pass/fail/skip counts.
Needs megatron-core 0.16.1 and pytest-mock installed.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

TESTS = ["tests/unit_tests/test_parallel_state.py", "tests/unit_tests/test_process_groups_config.py"]

UTILITIES = '''
"""CPU stand-in for Megatron-LM's tests/unit_tests/test_utilities.py (gloo, no CUDA)."""
import os
from datetime import timedelta

import torch

import megatron.core.parallel_state as ps


class Utils:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    inited = False

    @staticmethod
    def initialize_distributed():
        if not torch.distributed.is_initialized():
            torch.distributed.init_process_group(
                "gloo",
                init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
                rank=Utils.rank,
                world_size=Utils.world_size,
                timeout=timedelta(minutes=5),
            )
            torch.distributed.barrier()
        Utils.inited = True

    @staticmethod
    def destroy_model_parallel():
        if not Utils.inited:
            return
        torch.distributed.barrier()
        ps.destroy_model_parallel()
        Utils.inited = False

    @staticmethod
    def initialize_model_parallel(
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None, **kwargs
    ):
        ps.destroy_model_parallel()
        Utils.initialize_distributed()
        ps.initialize_model_parallel(
            tensor_model_parallel_size, pipeline_model_parallel_size, virtual_pipeline_model_parallel_size, **kwargs
        )
        Utils.inited = True
'''

CONFTEST = """
import os
import warnings

warnings.simplefilter("ignore")
if os.environ.get("MESHGROUPS_MODE") == "compat":
    import meshgroups.compat.megatron

    meshgroups.compat.megatron.install(strategy=os.environ.get("MESHGROUPS_STRATEGY", "global"))
"""


def extract(git_dir: str, tag: str, dest: Path) -> None:
    for package in ("tests", "tests/unit_tests"):
        (dest / package).mkdir(parents=True, exist_ok=True)
        (dest / package / "__init__.py").write_text("")
    for path in TESTS:
        text = subprocess.run(
            ["git", "--git-dir", git_dir, "show", f"{tag}:{path}"], check=True, capture_output=True, text=True
        ).stdout
        (dest / path).write_text(text)
    (dest / "tests/unit_tests/test_utilities.py").write_text(UTILITIES)
    (dest / "conftest.py").write_text(CONFTEST)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_mode(dest: Path, mode: str, world: int, timeout: float) -> list[dict[str, int]]:
    port = str(free_port())
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_PORT=port)
        env["MESHGROUPS_MODE"] = mode
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout", "600", *TESTS]
        log = open(dest / f"{mode}-rank{rank}.log", "w")  # closed below, after the process ends
        procs.append((subprocess.Popen(cmd, cwd=dest, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    counts = []
    for rank, (proc, log) in enumerate(procs):
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        tail = (dest / f"{mode}-rank{rank}.log").read_text().strip().splitlines()[-1:] or [""]
        found = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error|errors)", tail[0])}
        counts.append(found)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--git-dir", required=True)
    parser.add_argument("--tag", default="core_v0.16.1")
    parser.add_argument("--mode", default="both", choices=["compat", "megatron-core", "both"])
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=1500)
    parser.add_argument("--keep", help="extract into this directory and keep the logs")
    args = parser.parse_args()
    dest = Path(args.keep or tempfile.mkdtemp(prefix="megatron-lm-tests-"))
    extract(args.git_dir, args.tag, dest)
    for mode in ["megatron-core", "compat"] if args.mode == "both" else [args.mode]:
        counts = run_mode(dest, mode, args.world, args.timeout)
        print(
            f"{mode}: rank 0 {counts[0]}; all ranks passed {[c.get('passed', 0) for c in counts]} (logs: {dest})"
        )


if __name__ == "__main__":
    main()
