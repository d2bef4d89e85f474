"""Megatron-LM's own unit tests on compat, as on megatron-core (optional: needs megatron-core
0.16.1 or 0.19 installed and ``MEGATRON_LM_GIT_DIR`` naming a Megatron-LM git directory holding
the tag ``core_v0.16.1`` / ``core_v0.19.0``).

Two jobs of 8 gloo processes (``tests/support/megatron_lm_harness.py``): with 0.16.1, a
representative subset of the files docs/megatron-tests.md measures — HyperCommGrid, the
tensor-parallel mappings and cross-entropy, DDP's reduce-scatter with fp32 accumulation,
pipeline helpers; with 0.19, ``test_parallel_state.py``, ``test_process_groups_config.py`` and
``test_hyper_comm_grid.py`` in full (compat's ``hyper_comm_grid`` in megatron-core's place too) —
in one pytest session on megatron-core, then in one on ``meshgroups.compat`` installed in its
place. Every test that passes on megatron-core must pass on compat. One more test, without megatron-core,
checks the harness's sampling and ``--chunk`` slicing on a few plain pytest tests.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
from pathlib import Path

import pytest
from meshgroups.compat._megatron_version import installed_megatron_core

from ..support.timing import scaled

HAVE_MCORE = (
    importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None
)
GIT_DIR = os.environ.get("MEGATRON_LM_GIT_DIR", "")
INSTALLED = installed_megatron_core()[1] if HAVE_MCORE else None
# Per installed megatron-core: the Megatron-LM tag, the test files, how many pass on megatron-core
# itself on gloo CPU processes at least (docs/megatron-tests.md)
RUNS = {
    "0.16": (
        "core_v0.16.1",
        [
            "tests/unit_tests/test_hyper_comm_grid.py",
            "tests/unit_tests/tensor_parallel/test_mappings.py",
            "tests/unit_tests/tensor_parallel/test_cross_entropy.py",
            "tests/unit_tests/distributed/test_reduce_scatter_with_fp32_accumulation.py",
            "tests/unit_tests/pipeline_parallel/test_helpers.py",
        ],
        25,
    ),
    # 0.19: compat serves hyper_comm_grid too; every parametrization (no --max-params)
    "0.19": (
        "core_v0.19.0",
        [
            "tests/unit_tests/test_parallel_state.py",
            "tests/unit_tests/test_process_groups_config.py",
            "tests/unit_tests/test_hyper_comm_grid.py",
        ],
        130,
    ),
}
TAG, SUBSET, AT_LEAST = RUNS.get(INSTALLED or "0.16", RUNS["0.16"])


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
    from ..support.megatron_lm_harness import run_files
    from ..support.megatron_lm_sources import extract

    files = extract(GIT_DIR, TAG, tmp_path, SUBSET)
    assert files == SUBSET
    args = argparse.Namespace(
        world=8,
        pg_timeout=scaled(90),
        test_timeout=scaled(300),
        file_timeout=scaled(600) / len(files),
        max_params=1 if INSTALLED == "0.16" else 0,
    )
    theirs = run_files(tmp_path, files, "megatron-core", args)
    ours = run_files(tmp_path, files, "compat", args)
    passed = {n for n, v in theirs.verdicts.items() if v == "passed"}
    # megatron-core's own CPU pass count (docs/megatron-tests.md): the subset really ran
    assert len(passed) >= AT_LEAST, (theirs.verdicts, theirs.notes)
    missing = {
        n: ours.reasons.get(n, ours.verdicts.get(n, "not run"))
        for n in sorted(passed)
        if ours.verdicts.get(n) != "passed"
    }
    assert not missing, missing


@pytest.mark.processes
def test_harness_session_keeps_its_part_of_the_sampled_tests(tmp_path: Path) -> None:
    """The conftest the harness writes (no megatron-core needed): ``--max-params`` samples each
    function's parametrizations, the count left is recorded, and a ``--chunk`` session runs only
    its slice of them; the harness reads the count and the verdicts back."""
    import sys

    from ..support.megatron_lm_harness import _collected, _rank_outcomes
    from ..support.megatron_lm_sources import CONFTEST

    (tmp_path / "conftest.py").write_text(CONFTEST)
    utilities = tmp_path / "tests" / "unit_tests"
    utilities.mkdir(parents=True)
    for parent in (tmp_path / "tests", utilities):
        (parent / "__init__.py").write_text("")
    # the session fixture's Utils.initialize_distributed: nothing to start for these tests
    (utilities / "test_utilities.py").write_text(
        "class Utils:\n    @staticmethod\n    def initialize_distributed():\n        pass\n"
    )
    (utilities / "test_sample.py").write_text(
        "import pytest\n\n\n@pytest.mark.parametrize('x', range(5))\ndef test_p(x):\n    assert x != 2\n\n\n"
        "def test_plain():\n    pass\n"
    )
    results = tmp_path / "rank0.tsv"
    env = dict(
        os.environ, MESHGROUPS_RESULTS=str(results), MEGATRON_LM_MAX_PARAMS="3", MEGATRON_LM_PART="1:3"
    )
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/unit_tests/test_sample.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )
    # 3 of test_p's 5 (first, middle, last: 0, 2, 4) and test_plain: 4 collected; this part runs
    # the 2nd and 3rd of them, test_p[2] (fails) and test_p[4]
    assert _collected(tmp_path) == 4, done.stdout + done.stderr
    outcomes, collect_errors, ended = _rank_outcomes(results)
    assert not collect_errors and ended
    ran = {n.split("::")[1]: o for n, (o, _) in outcomes.items() if o != "deselected"}
    assert ran == {"test_p[2]": "failed", "test_p[4]": "passed"}
    deselected = {n.split("::")[1] for n, (o, _) in outcomes.items() if o == "deselected"}
    assert deselected == {"test_p[1]", "test_p[3]"}
