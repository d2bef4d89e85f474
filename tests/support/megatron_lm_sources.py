"""Megatron-LM's unit tests extracted for CPU gloo runs: which files, and the mechanical rewrites.

Tests' helper for ``tests/support/megatron_lm_harness.py`` (not collected by pytest). ``extract`` copies
the files of ``GROUPS`` (and the support code they import) at a tag of a Megatron-LM git
directory into a scratch directory, applying ``REWRITES`` — only where the sources name a device
or a backend, never an assertion — and writes a ``conftest.py`` that, in compat mode, calls
``meshgroups.compat.megatron.install()`` before megatron-core is imported::

    >>> rewrite('x = torch.ones(2, device="cuda").cuda()  # backend="nccl"')
    'x = torch.ones(2, device="cpu").cpu()  # backend="gloo"'

No Megatron-LM code is kept in this repository: ``extract`` reads it from the git directory at
run time.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

__all__ = ["GROUPS", "REWRITES", "SUPPORT", "expand", "extract", "rewrite"]

_UT = "tests/unit_tests"

# Named sets of test files (paths inside Megatron-LM); a name on the command line expands to its
# files, anything else is taken as a path or a prefix of paths.
GROUPS: dict[str, list[str]] = {
    "parallel_state": [f"{_UT}/test_parallel_state.py", f"{_UT}/test_process_groups_config.py"],
    "hyper_comm_grid": [f"{_UT}/test_hyper_comm_grid.py"],
    "utils": [f"{_UT}/test_utils.py"],
    "tensor_parallel": [
        f"{_UT}/tensor_parallel/test_{n}.py"
        for n in (
            "cross_entropy",
            "data",
            "initialization",
            "layers",
            "mappings",
            "random",
            "tensor_parallel_utils",
        )
    ],
    "pipeline_parallel": [
        f"{_UT}/pipeline_parallel/test_{n}.py"
        for n in (
            "helpers",
            "schedules",
            "bridge_communicator",
            "multimodule_communicator",
            "pipeline_layout",
            "fine_grained_activation_offloading",
        )
    ],
    "distributed": [
        f"{_UT}/distributed/test_{n}.py"
        for n in (
            "distributed_data_parallel",
            "finalize_model_grads",
            "grad_reduce_for_replicated_embedder",
            "grad_sync_with_expert_parallel",
            "param_and_grad_buffer",
            "reduce_scatter_with_fp32_accumulation",
            "torch_fully_sharded_parallel",
        )
    ]
    + [
        f"{_UT}/distributed/megatron_fsdp/test_{n}.py"
        for n in ("mcore_fully_sharded_data_parallel", "mfsdp_fully_shard")
    ],
}
GROUPS["all"] = [
    f
    for name in ("hyper_comm_grid", "utils", "tensor_parallel", "pipeline_parallel", "distributed")
    for f in GROUPS[name]
]

# Support code the tests import (extracted, rewritten the same way, never collected): the
# directories are copied whole.
SUPPORT: list[str] = [
    f"{_UT}/test_utilities.py",
    f"{_UT}/dist_checkpointing",
    f"{_UT}/distributed/megatron_fsdp/utils.py",
]

# (pattern, replacement, why) applied in this order to every extracted file. Each names a device
# or a backend: CUDA calls become their CPU equivalent (or nothing, where CPU has no such state),
# NCCL becomes gloo. Megatron-core's own code is not rewritten: where it needs CUDA it fails the
# same way under megatron-core and under compat, and the harness lists those tests.
REWRITES: list[tuple[str, str, str]] = [
    (r"""f?(["'])cuda(:[^"'\n]*)?\1""", r"\1cpu\1", "device strings 'cuda', 'cuda:N', f'cuda:{i}' -> 'cpu'"),
    (r"""(["'])nccl\1""", r"\1gloo\1", "backend 'nccl' -> 'gloo'"),
    (r"\.cuda\(\)", ".cpu()", "tensor.cuda() / module.cuda() -> .cpu()"),
    (r"torch\.cuda\.current_device\(\)", '"cpu"', "torch.cuda.current_device() -> 'cpu'"),
    (
        r"torch\.cuda\.device_count\(\)",
        'int(__import__("os").environ["WORLD_SIZE"])',
        "torch.cuda.device_count() -> the number of processes (one device each)",
    ),
    (r"torch\.cuda\.is_available\(\)", "True", "torch.cuda.is_available() -> True (the device is the CPU)"),
    (r"torch\.cuda\.manual_seed\(", "torch.manual_seed(", "torch.cuda.manual_seed -> torch.manual_seed"),
    (
        r"torch\.cuda\.get_rng_state\(\)",
        "torch.get_rng_state()",
        "torch.cuda.get_rng_state -> torch.get_rng_state",
    ),
    (
        r"torch\.cuda\.(set_device|synchronize|empty_cache|reset_peak_memory_stats)\(",
        "(lambda *_, **__: None)(",
        "torch.cuda.set_device / synchronize / empty_cache / reset_peak_memory_stats -> no-op",
    ),
]

# Only in test_utilities.py (the test infrastructure, no test): its one-minute rendezvous and
# store timeouts are too short for 8 processes importing megatron-core on a loaded CPU box.
UTILITIES_REWRITES: list[tuple[str, str, str]] = [
    (r"timedelta\(minutes=1\)", "timedelta(minutes=5)", "store / rendezvous timeouts 1 -> 5 minutes"),
    # a rank that fails before a collective would leave the others waiting for gloo's default
    # 30 minutes: the default group gets the harness's --pg-timeout instead
    (
        r"store=store(\s*)\)",
        r'store=store, timeout=timedelta(seconds=float(os.environ["MEGATRON_LM_PG_TIMEOUT"]))\1)',
        "default group timeout -> the harness's --pg-timeout",
    ),
]

CONFTEST = r'''
"""Written by tests/support/megatron_lm_harness.py: compat install, and the mock module the tests import."""
import os
import re
import sys
import typing
import unittest.mock
import warnings

import pytest
import torch

warnings.simplefilter("ignore")
try:
    import mock  # noqa: F401
except ImportError:  # the "mock" backport is unittest.mock
    sys.modules["mock"] = unittest.mock
if not hasattr(typing, "override"):  # Megatron-LM 0.19's megatron.training uses 3.12's typing.override
    import typing_extensions

    typing.override = typing_extensions.override
# gloo connects a group's pairs when it is first used, not when it is made: megatron-core 0.19
# makes ~150 groups per initialize_model_parallel
os.environ.setdefault("TORCH_GLOO_LAZY_INIT", "1")
if os.environ.get("MESHGROUPS_MODE") == "compat":
    import meshgroups.compat.megatron

    meshgroups.compat.megatron.install(strategy=os.environ.get("MESHGROUPS_STRATEGY", "global"))


@pytest.fixture(autouse=True)
def _destroy_groups_made_by_the_test():
    """After each test, destroy the process groups it made and left alive (megatron-core's
    destroy_model_parallel drops its groups without destroying them: on gloo their threads pile
    up, ~2,700 per process over these files). The same in both modes; groups a still-initialised
    compat state holds are left to it."""
    before = set(_live_groups())
    yield
    if not torch.distributed.is_initialized():
        return
    if os.environ.get("MESHGROUPS_MODE") == "compat":
        from meshgroups.compat import _megatron_state as megatron_state

        if megatron_state.SLOTS.state is not None:
            return
    for group in _live_groups():
        if group not in before:
            try:
                torch.distributed.destroy_process_group(group)
            except Exception:  # already destroyed, or a group of a failed test: nothing to free
                pass


def _live_groups():
    if not torch.distributed.is_initialized():
        return []
    world = torch.distributed.group.WORLD
    return [g for g in list(torch.distributed.distributed_c10d._world.pg_map) if g is not world]



@pytest.fixture(scope="session", autouse=True)
def _distributed():
    """torch.distributed up before the first test, as in Megatron's CI, where one pytest session
    runs every file (tests such as HyperCommGrid's mocked ones rely on an earlier file having
    initialised it); torn down in pytest_sessionfinish, not here: a session fixture's teardown
    is reported as the last test's, and shutting down every group megatron-core left behind can
    outlast pytest-timeout."""
    from tests.unit_tests.test_utilities import Utils

    Utils.initialize_distributed()


# Each outcome is appended as it happens, so a rank killed by the harness's timeout still tells
# which tests passed and which one it was in.
_RESULTS = open(os.environ["MESHGROUPS_RESULTS"], "a", buffering=1)


def _line(*fields):
    _RESULTS.write("\t".join(str(f).replace("\t", " ").replace("\n", " ") for f in fields) + "\n")


def pytest_runtest_logstart(nodeid, location):
    _line("start", nodeid, "", "")


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        message = ""
        if report.outcome == "skipped" and isinstance(report.longrepr, tuple):
            message = report.longrepr[2]
        elif report.outcome == "failed":
            crash = getattr(report.longrepr, "reprcrash", None)
            message = crash.message if crash is not None else str(report.longrepr).splitlines()[-1:]
            # where megatron-core was when it failed (the deepest of its frames)
            frames = re.findall(r"(megatron/core/[\w/]+\.py):(\d+)", report.longreprtext)
            if frames:
                message = f"{str(message).splitlines()[0]} (in {frames[-1][0]}:{frames[-1][1]})"
        _line(report.when, report.nodeid, report.outcome, str(message)[:300])


def pytest_collectreport(report):
    if report.outcome == "failed":
        _line("collect", report.nodeid, "failed", str(report.longrepr).strip().splitlines()[-1][:300])


def pytest_collection_modifyitems(config, items):
    """--max-params N: keep N parametrizations of each test function, evenly spread over its
    list (first and last included), for a time budget; the others are deselected and counted.
    Then --chunk: the number of tests left is recorded, and this session keeps its slice of them."""
    _max_params(config, items, int(os.environ.get("MEGATRON_LM_MAX_PARAMS", "0")))
    _line("collected", "", len(items), "")
    part = os.environ.get("MEGATRON_LM_PART", "")
    if part:  # the harness's --chunk: this session runs tests [start, stop) of the collected list
        start, stop = (int(x) for x in part.split(":"))
        items[:] = items[start:stop]


def _max_params(config, items, limit):
    if limit <= 0:
        return
    by_function = {}
    for item in items:
        by_function.setdefault(item.nodeid.split("[")[0], []).append(item)
    keep = set()
    for group in by_function.values():
        n = len(group)
        picked = {0} if limit == 1 else {round(i * (n - 1) / (limit - 1)) for i in range(min(limit, n))}
        keep.update(id(group[i]) for i in picked)
    dropped = [item for item in items if id(item) not in keep]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if id(item) in keep]
        for item in dropped:
            _line("deselected", item.nodeid, "", "")


def pytest_sessionfinish(session, exitstatus):
    _line("end", "", exitstatus, "")
    # after "end": a rank slow to shut its groups down is reported by the harness (and killed
    # after its grace period), not charged to a test
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
'''


def rewrite(text: str, rules: list[tuple[str, str, str]] = REWRITES) -> str:
    """``text`` with every rule of ``rules`` applied in order (``re.sub``).

    >>> rewrite("torch.cuda.set_device(int(rank))")
    '(lambda *_, **__: None)(int(rank))'
    """
    for pattern, replacement, _ in rules:
        text = re.sub(pattern, replacement, text)
    return text


def expand(names: list[str]) -> list[str]:
    """Test file paths for group names (``GROUPS``) and paths, in order, without duplicates.

    >>> expand(["hyper_comm_grid", "tests/unit_tests/test_hyper_comm_grid.py"])
    ['tests/unit_tests/test_hyper_comm_grid.py']
    """
    out: list[str] = []
    for name in names:
        for path in GROUPS.get(name, [name]):
            if path not in out:
                out.append(path)
    return out


def _git(git_dir: str, *args: str) -> str:
    return subprocess.run(
        ["git", "--git-dir", git_dir, *args], check=True, capture_output=True, text=True
    ).stdout


def extract(git_dir: str, tag: str, dest: Path, files: list[str]) -> list[str]:
    """Write ``files`` and ``SUPPORT`` at ``tag`` of ``git_dir`` under ``dest``, rewritten.

    Every directory on the way gets an ``__init__.py`` (Megatron's tests import each other as
    ``tests.unit_tests....``). Returns the test files that exist at ``tag``.

    Raises:
        subprocess.CalledProcessError: ``git_dir`` is not a git directory or lacks ``tag``.
    """
    listed = _git(git_dir, "ls-tree", "-r", "--name-only", tag, "--", *files, *SUPPORT).split()
    pending, written = list(listed), set()
    while pending:
        path = pending.pop()
        if not path.endswith(".py") or path in written:
            continue
        written.add(path)
        try:
            text = rewrite(_git(git_dir, "show", f"{tag}:{path}"))
        except subprocess.CalledProcessError:
            if path in listed:
                raise
            continue  # an imported name that is a package or not a file at this tag
        target = dest / path
        target.parent.mkdir(parents=True, exist_ok=True)
        # a test file importing another (test_multimodule_communicator.py imports
        # test_bridge_communicator.py's helpers) needs it beside it, extracted but not run
        pending += [
            m.replace(".", "/") + ".py"
            for m in re.findall(r"^from (tests\.unit_tests\.[\w.]+) import", text, re.M)
        ]
        if path.endswith("unit_tests/test_utilities.py"):
            text = rewrite(text, UTILITIES_REWRITES)
        target.write_text(text)
        for parent in Path(path).parents:
            if parent != Path(".") and not (dest / parent / "__init__.py").exists():
                (dest / parent / "__init__.py").write_text("")
    (dest / "conftest.py").write_text(CONFTEST)
    # Megatron's own conftest files (tests/unit_tests/..., TE and dataset downloads) are not used.
    for conftest in dest.glob("tests/**/conftest.py"):
        conftest.unlink()
    return [f for f in files if f in listed]
