"""Run torch's own DeviceMesh tests on gloo CPU processes, on plain torch and with every mesh built
through ``meshgroups.init_mesh`` (tests' helper, not collected by pytest).

    python -m tests.support.torch_dm_harness --torch-tests <PyTorch checkout> [--mode torch|meshgroups|both]
        [--classes DeviceMeshTest,DTensorMeshTest] [-k substring] [--timeout 120]

Reads ``test/distributed/test_device_mesh.py`` (every test class) and ``DTensorMeshTest`` of
``test/distributed/tensor/test_dtensor.py`` from the checkout (torch's tests are not in the wheel;
never copy them into this repository). Each test runs as torch's ``MultiProcessTestCase`` runs it
(one process per rank, the test's own ``world_size``, ``with_comms``' gloo default group), but in
a pool of 8 long-lived rank processes per mode (``tests/support/torch_dm_worker.py``) instead of 8 fresh
processes per test. In ``meshgroups`` mode the tests' ``init_device_mesh`` and ``DeviceMesh(...)``
build through ``init_mesh``. Every test is bounded: the default group's timeout is ``--timeout``/2,
and a test still running after ``--timeout`` seconds (default 120 s times
``MESHGROUPS_TEST_TIME_SCALE``) has its pool killed and restarted.

Prints, per test class, tests run / pass on torch / pass on meshgroups, then every test that
passes on torch but not on meshgroups with the reason, marking those that cannot apply to a
named layout (``CANNOT_APPLY``). Needs ``expecttest`` (torch's test utilities import it: the ``torch-ref`` extra).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import tempfile
import time
import unittest
from pathlib import Path
from typing import Any

from tests.support.timing import scaled

FILES = {
    "test_device_mesh": "test/distributed/test_device_mesh.py",
    "test_dtensor": "test/distributed/tensor/test_dtensor.py",
}
CLASSES = {"test_dtensor": ["DTensorMeshTest"]}  # the other modules: every class defined there
POOL = 8

# Tests that can't apply to a meshgroups mesh, with the reason (see docs/torch-tests.md).
_UNNAMED = "checks a mesh without mesh_dim_names; a meshgroups layout names every dim (dim_0, ... here)"
CANNOT_APPLY: dict[str, str] = {
    "DeviceMeshTest.test_from_group_with_global_pg": _UNNAMED
    + ", so it differs from from_group's unnamed mesh",
    "TestDeviceMeshGetItem.test_raises_no_mesh_dim_found": _UNNAMED + ", so slicing it is allowed",
    "TestMeshEnv.test_get_root_mesh_dim_not_exist": _UNNAMED + ", so its root dim is found",
}


def discover(paths: dict[str, str], only: list[str], pattern: str) -> list[tuple[str, str, str, int]]:
    """``(module, class, test, world_size)`` for every selected test, in file order."""
    from tests.support.torch_dm_worker import _load

    out = []
    for module_name, path in paths.items():
        module = _load(path, module_name)
        names = CLASSES.get(module_name) or [
            n
            for n, c in vars(module).items()
            if isinstance(c, type) and issubclass(c, unittest.TestCase) and c.__module__ == module_name
        ]
        for cls_name in names:
            if only and cls_name not in only:
                continue
            cls = getattr(module, cls_name)
            for test in unittest.TestLoader().getTestCaseNames(cls):
                if pattern in f"{cls_name}.{test}":
                    size = getattr(cls(test), "world_size", 1) if hasattr(cls, "world_size") else 1
                    out.append((module_name, cls_name, test, int(size)))
    return out


class Pool:
    """``POOL`` rank processes of one mode; restarted whole after a test overruns."""

    def __init__(self, mode: str, paths: list[str], timeout: float) -> None:
        self.mode, self.paths, self.timeout = mode, paths, timeout
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self.start()

    def start(self) -> None:
        from tests.support.torch_dm_worker import serve

        ctx = multiprocessing.get_context("spawn")
        for rank in range(POOL):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=serve, args=(rank, self.mode, self.paths, self.timeout / 2, child), daemon=True
            )
            proc.start()
            self.procs.append(proc)
            self.conns.append(parent)
        for conn in self.conns:
            if not conn.poll(600):
                raise RuntimeError(f"{self.mode} worker did not start within 600 s")
            conn.recv()

    def stop(self) -> None:
        for conn, proc in zip(self.conns, self.procs):
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self.procs, self.conns = [], []

    def run(self, module: str, cls: str, test: str, world: int) -> tuple[str, str, int]:
        """One test on ranks ``0..world-1``: ``(pass|fail|skip|timeout, detail, meshes built
        through init_mesh on rank 0)``."""
        fd, file_name = tempfile.mkstemp(prefix="torch-dm-")
        os.close(fd)
        try:
            for conn in self.conns[:world]:
                conn.send((module, cls, test, file_name))
            deadline = time.monotonic() + self.timeout
            results = []
            for rank, conn in enumerate(self.conns[:world]):
                if not conn.poll(max(0.0, deadline - time.monotonic())):
                    for proc in self.procs:
                        proc.kill()
                    self.procs, self.conns = [], []
                    self.start()
                    return "timeout", f"rank {rank} still running after {self.timeout:.0f} s", 0
                results.append(conn.recv())
        finally:
            if os.path.exists(file_name):  # FileStore removes it once every rank is done
                os.unlink(file_name)
        built = results[0][2]
        for status in ("fail", "skip"):
            for rank, (got, detail, _) in enumerate(results):
                if got == status:
                    return status, f"rank {rank}: {detail}", built
        return "pass", results[0][1], built


def reason(detail: str) -> str:
    """The last line of a traceback (the exception), shortened."""
    lines = [line for line in detail.strip().splitlines() if line.strip()]
    return (lines[-1] if lines else detail)[:300]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--torch-tests", required=True, help="a PyTorch checkout (or a folder with its test/ tree)"
    )
    parser.add_argument("--mode", default="both", choices=["torch", "meshgroups", "both"])
    parser.add_argument("--classes", default="", help="comma-separated test classes (default: all)")
    parser.add_argument("-k", default="", help="only tests whose Class.test contains this")
    parser.add_argument(
        "--timeout",
        type=float,
        default=scaled(120),
        help="seconds one test may take (120 x MESHGROUPS_TEST_TIME_SCALE)",
    )
    args = parser.parse_args()
    root = Path(args.torch_tests)
    paths = {m: str(root / p) for m, p in FILES.items()}
    for path in paths.values():
        if not Path(path).is_file():
            sys.exit(f"{path} not found: --torch-tests must be a PyTorch checkout (torch 2.13's tests)")
    tests = discover(paths, [c for c in args.classes.split(",") if c], args.k)
    modes = ["torch", "meshgroups"] if args.mode == "both" else [args.mode]
    results: dict[str, dict[tuple[str, str], tuple[str, str, int]]] = {}
    for mode in modes:
        started = time.monotonic()
        pool = Pool(mode, list(paths.values()), args.timeout)
        results[mode] = {}
        for module, cls, test, world in tests:
            results[mode][(cls, test)] = got = pool.run(module, cls, test, world)
            print(f"[{mode}] {cls}.{test}: {got[0]}", flush=True)
        pool.stop()
        print(f"[{mode}] {len(tests)} tests in {time.monotonic() - started:.0f} s", flush=True)
    report(tests, results)


def report(
    tests: list[tuple[str, str, str, int]], results: dict[str, dict[tuple[str, str], tuple[str, str, int]]]
) -> None:
    """The per-class table, then what passes on torch but not on meshgroups, and why."""
    torch_r, ours = results.get("torch", {}), results.get("meshgroups", {})
    print("\n| class | tests | run | pass on torch | pass on meshgroups | called init_mesh |")
    print("|---|---|---|---|---|---|")
    totals = [0] * 5
    for cls in dict.fromkeys(c for _, c, _, _ in tests):
        keys = [(c, t) for _, c, t, _ in tests if c == cls]
        row = [
            len(keys),
            sum(any(r[k][0] != "skip" for r in results.values()) for k in keys),
            sum(torch_r.get(k, ("",))[0] == "pass" for k in keys),
            sum(ours.get(k, ("",))[0] == "pass" for k in keys),
            sum(ours.get(k, ("", "", 0))[2] > 0 for k in keys),
        ]
        totals = [a + b for a, b in zip(totals, row)]
        print(f"| {cls} | " + " | ".join(map(str, row)) + " |")
    print("| **all** | " + " | ".join(f"**{n}**" for n in totals) + " |")
    if torch_r and ours:
        lost = [k for k in torch_r if torch_r[k][0] == "pass" and ours[k][0] != "pass"]
        to_fix = [k for k in lost if f"{k[0]}.{k[1]}" not in CANNOT_APPLY]
        print(f"\npass on torch, not on meshgroups: {len(lost)} ({len(lost) - len(to_fix)} can't apply)")
        for cls, test in lost:
            why = CANNOT_APPLY.get(f"{cls}.{test}")
            print(
                f"- {cls}.{test} [{f'cannot apply: {why}' if why else 'TO FIX'}]: {reason(ours[(cls, test)][1])}"
            )
    for mode, got in results.items():
        failed = [k for k in got if got[k][0] in ("fail", "timeout")]
        if failed and (mode == "torch" or not torch_r):
            print(f"\nfail on {mode} ({len(failed)}):")
            for cls, test in failed:
                why = CANNOT_APPLY.get(f"{cls}.{test}") if mode == "meshgroups" else None
                tag = f" [cannot apply: {why}]" if why else ""
                print(f"- {cls}.{test}{tag}: {got[(cls, test)][0]}: {reason(got[(cls, test)][1])}")


if __name__ == "__main__":
    main()
