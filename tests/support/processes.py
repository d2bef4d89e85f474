"""The ``processes`` marker, kept true: a test that starts a process (gloo ranks, a subprocess —
the CLI, torchrun, a notebook kernel, pip, a fresh interpreter) carries it, so
``pytest -m "not processes"`` (or ``pytest --fast``) is exactly the part of the suite that starts
none, selected by the marker alone.

What keeps the marker honest on every run, the full suite included: while an unmarked test runs,
starting a process fails that test, naming it and the fix. Python's audit hooks see every
``subprocess``, ``os.fork``/``posix_spawn``/``system``/``exec`` in this process (nothing of the
standard library is replaced); the suite's ranks come from a forkserver, whose forks raise no
audit event here, so ``tests/support/dist.py`` asks :func:`check` itself before it starts any.

    >>> unmarked("tests/x.py::test_y")
    >>> check("2 gloo ranks")
    Traceback (most recent call last):
    ...
    Failed: tests/x.py::test_y starts 2 gloo ranks but is not marked `processes`: ...
    >>> unmarked(None)
    >>> check("2 gloo ranks")  # a marked test, or no test running
"""

from __future__ import annotations

import sys
from typing import Any

import pytest

MARKER = "processes"
#: audit events that start a process (PEP 578's table)
EVENTS = frozenset(
    {"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.system", "os.exec"}
)

_running: str | None = None  # the unmarked test now running, if any
_installed = False


def unmarked(nodeid: str | None) -> None:
    """Say which unmarked test runs now (``None``: a marked one, or none)."""
    global _running
    _running = nodeid


def check(what: str) -> None:
    """Fail the running test if it is unmarked and about to start ``what``. ``pytest.fail``
    raises a ``BaseException``, so a test's own ``except Exception`` cannot swallow it."""
    if _running is not None:
        pytest.fail(
            f"{_running} starts {what} but is not marked `{MARKER}`: add @pytest.mark.{MARKER} to it "
            f"(or `pytestmark = pytest.mark.{MARKER}` to its file), so `pytest --fast` leaves it out",
            pytrace=False,
        )


def _audit(event: str, args: Any) -> None:
    if _running is not None and event in EVENTS:
        check(f"a process ({event})")


def install() -> None:
    """Add the audit hook (once per process: audit hooks cannot be removed)."""
    global _installed
    if not _installed:
        sys.addaudithook(_audit)
        _installed = True
