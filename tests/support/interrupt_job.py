"""A multi-process test that runs until it is stopped, for ``tests/project/test_interrupt.py`` (which
runs it in a pytest of its own and then signals that pytest). Not collected by the suite (its
name has no ``test_`` prefix); run only by path, with MESHGROUPS_INTERRUPT_DIR set."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from .dist import run


def _rank_waits(rank: int, world: int, where: str) -> None:
    Path(where, f"rank{rank}").write_text(f"{os.getpid()} {os.getppid()}")
    time.sleep(3600)  # until the run is stopped


@pytest.mark.processes
def test_a_job_that_waits() -> None:
    where = os.environ["MESHGROUPS_INTERRUPT_DIR"]
    run(_rank_waits, 2, where, backend=None, timeout=3600)
