"""The ``processes`` marker is kept true (``tests/support/processes.py``): a pytest run with the
suite's conftest fails an unmarked test that starts a process, passes a marked one, and
``--fast`` leaves the marked one out."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ..support.timing import scaled

ROOT = Path(__file__).resolve().parents[2]

TESTS = """
import subprocess, sys
import pytest

def test_unmarked_starts_a_process():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

@pytest.mark.processes
def test_marked_starts_a_process():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

def test_unmarked_starts_none():
    assert True
"""


def _pytest(path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "tests.conftest",
            "-p",
            "no:cacheprovider",
            "-q",
            *args,
            str(path),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=scaled(120),
    )


@pytest.mark.processes
def test_an_unmarked_test_that_starts_a_process_fails_and_fast_selects_by_the_marker(tmp_path: Path) -> None:
    path = tmp_path / "test_sample.py"
    path.write_text(TESTS)
    full = _pytest(path)
    assert "1 failed, 2 passed" in full.stdout, full.stdout + full.stderr
    assert (
        "test_unmarked_starts_a_process starts a process (subprocess.Popen) but is not marked" in full.stdout
    )
    fast = _pytest(path, "--fast")
    assert "1 failed, 1 passed, 1 deselected" in fast.stdout, fast.stdout + fast.stderr
