"""Megatron-LM's own unit tests on compat, as on megatron-core (optional: needs megatron-core
0.16.1 installed and ``MEGATRON_LM_GIT_DIR`` naming a Megatron-LM git directory holding the tag
``core_v0.16.1``).

Two jobs of 8 gloo processes (``tests/megatron_lm_harness.py``): a representative subset of the
files docs/megatron-tests.md measures — HyperCommGrid, the tensor-parallel mappings and
cross-entropy, DDP's reduce-scatter with fp32 accumulation, pipeline helpers — in one pytest
session on megatron-core, then in one on ``meshgroups.compat`` installed in its place. Every
test that passes on megatron-core must pass on compat.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
from pathlib import Path

import pytest

from ._timing import scaled

HAVE_MCORE = (
    importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None
)
GIT_DIR = os.environ.get("MEGATRON_LM_GIT_DIR", "")
TAG = "core_v0.16.1"

SUBSET = [
    "tests/unit_tests/test_hyper_comm_grid.py",
    "tests/unit_tests/tensor_parallel/test_mappings.py",
    "tests/unit_tests/tensor_parallel/test_cross_entropy.py",
    "tests/unit_tests/distributed/test_reduce_scatter_with_fp32_accumulation.py",
    "tests/unit_tests/pipeline_parallel/test_helpers.py",
]


def _has_tag() -> bool:
    if not GIT_DIR:
        return False
    done = subprocess.run(
        ["git", "--git-dir", GIT_DIR, "rev-parse", "--verify", "-q", TAG], capture_output=True
    )
    return done.returncode == 0


@pytest.mark.timeout(1800)
@pytest.mark.skipif(
    not HAVE_MCORE or not _has_tag(),
    reason="optional: pip install -e '.[megatron-ref]' and set MEGATRON_LM_GIT_DIR to a Megatron-LM git "
    f"directory with the tag {TAG}",
)
def test_megatron_lm_unit_tests_pass_on_compat_as_on_megatron_core(tmp_path: Path) -> None:
    from .megatron_lm_harness import run_files
    from .megatron_lm_sources import extract

    files = extract(GIT_DIR, TAG, tmp_path, SUBSET)
    assert files == SUBSET
    args = argparse.Namespace(
        world=8,
        pg_timeout=scaled(90),
        test_timeout=scaled(300),
        file_timeout=scaled(600) / len(files),
        max_params=1,
    )
    theirs = run_files(tmp_path, files, "megatron-core", args)
    ours = run_files(tmp_path, files, "compat", args)
    passed = {n for n, v in theirs.verdicts.items() if v == "passed"}
    # megatron-core's own CPU pass count (docs/megatron-tests.md): the subset really ran
    assert len(passed) >= 25, (theirs.verdicts, theirs.notes)
    missing = {
        n: ours.reasons.get(n, ours.verdicts.get(n, "not run"))
        for n in sorted(passed)
        if ours.verdicts.get(n) != "passed"
    }
    assert not missing, missing
