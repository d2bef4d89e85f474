"""No process outlives the test run: the process tree stopped on Ctrl-C or SIGTERM, and children
that die with their parent (Linux) when the run is killed outright. Torch-free.

- ``install()`` (pytest's process, from conftest): SIGTERM and SIGINT kill every descendant of
  this process at once (spawned gloo ranks, the forkserver, CLI subprocesses and their children),
  then raise ``KeyboardInterrupt``, so pytest stops and reports within seconds; a second signal
  exits at once. The resource tracker is left alone: it exits by itself (and cleans up) when the
  last process holding its pipe ends.
- ``die_with_parent()`` (a forkserver and each rank it forks, from ``tests/support/dist.py``): the kernel
  sends SIGKILL when the parent ends (``prctl(PR_SET_PDEATHSIG)``), so a SIGKILLed pytest takes
  the forkserver and every rank with it.

    >>> os.getpid() in descendants(os.getppid())
    True
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from types import FrameType

PR_SET_PDEATHSIG = 1
TRACKER = b"multiprocessing.resource_tracker"


def _table() -> dict[int, int]:
    """``{pid: parent pid}`` of every process readable in /proc (empty where there is no /proc)."""
    parents = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return {}
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # ended meanwhile
        # fields after the command (which may hold spaces and parentheses): state, ppid, ...
        rest = stat[stat.rfind(b")") + 2 :].split()
        parents[int(entry)] = int(rest[1])
    return parents


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, their children, ...), parents before children.

    Args:
        pid: the process whose tree is listed.

    Returns:
        The pids, ``pid`` itself excluded; empty where /proc cannot be read.
    """
    children: dict[int, list[int]] = {}
    for child, parent in _table().items():
        children.setdefault(parent, []).append(child)
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _is_tracker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return TRACKER in f.read()
    except OSError:
        return False


def kill_tree(sig: int = signal.SIGKILL) -> int:
    """Send ``sig`` to every descendant of this process but the resource tracker.

    Args:
        sig: the signal (SIGKILL: nothing below may linger, catch or ignore it).

    Returns:
        How many processes were signalled.
    """
    count = 0
    for pid in descendants(os.getpid()):
        if _is_tracker(pid):
            continue
        try:
            os.kill(pid, sig)
            count += 1
        except OSError:
            pass  # ended meanwhile
    return count


_signalled = False


def _on_signal(signum: int, frame: FrameType | None) -> None:
    global _signalled
    kill_tree()
    if _signalled:  # a second signal while pytest unwinds: stop now
        os._exit(128 + signum)
    _signalled = True
    raise KeyboardInterrupt(f"{signal.Signals(signum).name}: stopped the run and its processes")


def install() -> None:
    """SIGTERM and SIGINT stop the run and kill its process tree (main thread of pytest only)."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _on_signal)


def die_with_parent() -> None:
    """This process gets SIGKILL when its parent ends (Linux; elsewhere nothing happens); if the
    parent has already ended, it exits now."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent or parent == 1:  # the parent ended before prctl took effect
        os._exit(1)
