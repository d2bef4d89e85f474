"""Run torch's own DeviceMesh tests on gloo CPU processes, on plain torch and with every mesh built
through ``meshgroups.init_mesh`` (tests' helper, not collected by pytest).

    python -m tests.torch_dm_harness --torch-tests <PyTorch checkout> [--mode torch|meshgroups|both]
        [--classes DeviceMeshTest,DTensorMeshTest] [-k substring] [--timeout 120]

Reads ``test/distributed/test_device_mesh.py`` (every test class) and ``DTensorMeshTest`` of
``test/distributed/tensor/test_dtensor.py`` from the checkout (torch's tests are not in the wheel;
never copy them into this repository). Each test runs as torch's ``MultiProcessTestCase`` runs it
(one process per rank, the test's own ``world_size``, ``with_comms``' gloo default group), but in
a pool of 8 long-lived rank processes per mode (``tests/_torch_dm_worker.py``) instead of 8 fresh
processes per test. In ``meshgroups`` mode the tests' ``init_device_mesh`` and ``DeviceMesh(...)``
build through ``init_mesh``. Every test is bounded: the default group's timeout is ``--timeout``/2,
and a test still running after ``--timeout`` seconds has its pool killed and restarted.

Prints, per test class, tests run / pass on torch / pass on meshgroups, then every test that
passes on torch but not on meshgroups with the reason, marking those that cannot apply to a
named layout (``CANNOT_APPLY``). Needs ``expecttest`` (torch's test utilities import it).
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

FILES = {
    "test_device_mesh": "test/distributed/test_device_mesh.py",
    "test_dtensor": "test/distributed/tensor/test_dtensor.py",
}
CLASSES = {"test_dtensor": ["DTensorMeshTest"]}  # the other modules: every class defined there
POOL = 8

# Tests that can't apply to a meshgroups mesh, with the reason (see docs/torch-tests.md).
CANNOT_APPLY: dict[str, str] = {}


def discover(paths: dict[str, str], only: list[str], pattern: str) -> list[tuple[str, str, str, int]]:
    """``(module, class, test, world_size)`` for every selected test, in file order."""
    from tests._torch_dm_worker import _load

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
        from tests._torch_dm_worker import serve

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

    def run(self, module: str, cls: str, test: str, world: int) -> tuple[str, str]:
        """One test on ranks ``0..world-1``: ``(pass|fail|skip|timeout, detail)``."""
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
                    return "timeout", f"rank {rank} still running after {self.timeout:.0f} s"
                results.append(conn.recv())
        finally:
            if os.path.exists(file_name):  # FileStore removes it once every rank is done
                os.unlink(file_name)
        for status in ("fail", "skip"):
            for rank, (got, detail) in enumerate(results):
                if got == status:
                    return status, f"rank {rank}: {detail}"
        return "pass", results[0][1]


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
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds one test may take")
    args = parser.parse_args()
    root = Path(args.torch_tests)
    paths = {m: str(root / p) for m, p in FILES.items()}
    for path in paths.values():
        if not Path(path).is_file():
            sys.exit(f"{path} not found: --torch-tests must be a PyTorch checkout (torch 2.13's tests)")
    tests = discover(paths, [c for c in args.classes.split(",") if c], args.k)
    modes = ["torch", "meshgroups"] if args.mode == "both" else [args.mode]
    results: dict[str, dict[tuple[str, str], tuple[str, str]]] = {}
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
    tests: list[tuple[str, str, str, int]], results: dict[str, dict[tuple[str, str], tuple[str, str]]]
) -> None:
    classes = list(dict.fromkeys(cls for _, cls, _, _ in tests))
    torch_r, ours = results.get("torch", {}), results.get("meshgroups", {})
    print("\n| class | tests | run | pass on torch | pass on meshgroups |\n|---|---|---|---|---|")
    totals = [0, 0, 0, 0]
    for cls in classes:
        keys = [(c, t) for _, c, t, _ in tests if c == cls]
        ran = [k for k in keys if any(r.get(k, ("skip",))[0] != "skip" for r in results.values())]
        row = [len(keys), len(ran), sum(torch_r.get(k, ("",))[0] == "pass" for k in keys)]
        row.append(sum(ours.get(k, ("",))[0] == "pass" for k in keys))
        totals = [a + b for a, b in zip(totals, row)]
        print(f"| {cls} | " + " | ".join(map(str, row)) + " |")
    print("| **all** | " + " | ".join(f"**{n}**" for n in totals) + " |")
    if torch_r and ours:
        lost = [k for k in torch_r if torch_r[k][0] == "pass" and ours.get(k, ("",))[0] != "pass"]
        print(f"\npass on torch, not on meshgroups: {len(lost)}")
        for cls, test in lost:
            why = CANNOT_APPLY.get(f"{cls}.{test}")
            tag = f"can't apply: {why}" if why else "FIX"
            print(f"- {cls}.{test} [{tag}]: {ours[(cls, test)][0]}: {reason(ours[(cls, test)][1])}")
    for mode, got in results.items():
        failed = [k for k in got if got[k][0] in ("fail", "timeout")]
        if mode == "torch" and failed:
            print(f"\nfail on plain torch 2.13 ({len(failed)}):")
            for cls, test in failed:
                print(f"- {cls}.{test}: {reason(got[(cls, test)][1])}")


if __name__ == "__main__":
    main()
