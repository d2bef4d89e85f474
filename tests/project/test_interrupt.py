"""The suite as a tool run by hand: a signal to pytest stops the run within seconds, and no
process it started survives — its gloo ranks, the forkserver they come from, the resource tracker.

Each case runs ``tests/support/interrupt_job.py`` (two real spawned ranks that wait until stopped) in a
pytest of its own, in a new session, waits until both ranks are up, signals that pytest, and then
checks that it ends and that no process of its session is left; also with two pytest-xdist
workers (each with its own forkserver), as the README's test command runs the suite.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ..support.timing import scaled

pytestmark = pytest.mark.processes  # every test here starts processes

ROOT = Path(__file__).resolve().parents[2]


def _session(sid: int) -> list[str]:
    """``pid command`` of every live process of session ``sid``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_bytes()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()
        if int(fields[3]) == sid and fields[0] != b"Z":  # state, ppid, pgrp, session
            found.append(f"{entry} {cmd.decode(errors='replace')[:120]}")
    return found


def _alive(pid: int) -> bool:
    """A process that runs (a zombie, ended but not yet reaped by an init that never reaps, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 :].split()[0] != b"Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize(
    ("sig", "workers"),
    [
        *((sig, []) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGKILL)),
        # the README's test command runs pytest-xdist workers, each with its own forkserver
        *((sig, ["-n", "2"]) for sig in (signal.SIGTERM, signal.SIGKILL)),
    ],
    ids=lambda v: v.name if isinstance(v, signal.Signals) else " ".join(v) or "one process",
)
def test_a_signal_stops_the_run_and_leaves_no_process(sig, workers, tmp_path):
    env = dict(os.environ, MESHGROUPS_INTERRUPT_DIR=str(tmp_path))
    run = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            *workers,
            "tests/support/interrupt_job.py",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its session holds every process it starts
    )
    try:
        deadline = time.monotonic() + scaled(120)
        while len(list(tmp_path.glob("rank*"))) < 2:
            assert run.poll() is None, run.communicate()[0].decode()
            assert time.monotonic() < deadline, "the ranks never started"
            time.sleep(0.2)
        ranks = [int(p.read_text().split()[0]) for p in tmp_path.glob("rank*")]
        assert len(_session(run.pid)) >= 4, _session(run.pid)  # pytest, forkserver, 2 ranks (+ tracker)

        run.send_signal(sig)
        out, _ = run.communicate(timeout=scaled(20))  # "within seconds"
        if sig != signal.SIGKILL:
            assert run.returncode != 0 and b"KeyboardInterrupt" in out, out.decode()

        deadline = time.monotonic() + scaled(10)  # the kernel's SIGKILLs and the tracker's EOF
        while _session(run.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _session(run.pid) == [], f"left behind after {sig.name}: {_session(run.pid)}"
        assert not [pid for pid in ranks if _alive(pid)], ranks
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
