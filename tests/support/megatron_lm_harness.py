"""Run Megatron-LM's own unit tests on CPU gloo processes, against megatron-core or against
meshgroups.compat substituted for it, and print a table per test file (tests' helper, not
collected by pytest).

    python -m tests.support.megatron_lm_harness --git-dir <Megatron-LM git dir> [--tag core_v0.16.1]
        [--mode compat|megatron-core|both] [--world 8] [--chunk N] [--max-params N] [FILE_OR_GROUP ...]

``FILE_OR_GROUP``: a group of ``tests/megatron_lm_sources.GROUPS`` (``parallel_state`` — the
default —, ``hyper_comm_grid``, ``utils``, ``tensor_parallel``, ``pipeline_parallel``,
``distributed``, ``all``) or a path inside Megatron-LM. The files are extracted at ``--tag``
into a scratch directory, rewritten where they name a device or a backend (cuda -> cpu,
nccl -> gloo: ``megatron_lm_sources.REWRITES``), beside Megatron's ``test_utilities.py``
(rewritten the same way) and a ``conftest.py`` that, in compat mode, calls
``meshgroups.compat.megatron.install()`` before megatron-core is imported. Each file then runs
under pytest on ``--world`` processes (env ``RANK`` / ``LOCAL_RANK`` / ``WORLD_SIZE``, one TCP
store), bounded by ``--file-timeout`` (the whole file), ``--test-timeout`` (pytest-timeout)
and ``--pg-timeout`` (the default group's, so a rank left alone in a collective fails instead
of waiting 30 minutes); ``--chunk N`` gives megatron-core a fresh session per N tests (see
``run_files``). A test passes when no rank fails it and one passes it. Needs
megatron-core 0.16.1 and pytest-mock installed (``pip install -e '.[megatron-ref]'``).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from .megatron_lm_sources import GROUPS, REWRITES, expand, extract

MODES = ("megatron-core", "compat")


@dataclass
class FileResult:
    """One test file under one mode: each test's verdict over the ranks, and a reason per failure."""

    verdicts: dict[str, str] = field(default_factory=dict)  # nodeid -> passed / failed / skipped
    reasons: dict[str, str] = field(default_factory=dict)  # nodeid -> first rank's message
    notes: list[str] = field(default_factory=list)  # collection errors, timeouts, hangs at exit

    def only(self, test_file: str) -> FileResult:
        """The part of this result that belongs to ``test_file`` (notes are kept whole)."""
        mine = [n for n in self.verdicts if n.split("::")[0] == test_file]
        reasons = {n: self.reasons[n] for n in mine if n in self.reasons}
        return FileResult({n: self.verdicts[n] for n in mine}, reasons, list(self.notes))

    def count(self, verdict: str) -> int:
        """How many tests got ``verdict``."""
        return sum(v == verdict for v in self.verdicts.values())


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_outcomes(path: Path) -> tuple[dict[str, tuple[str, str]], list[str], bool]:
    """Per test of one rank's results file: (outcome, message); collection errors; session end."""
    outcomes: dict[str, tuple[str, str]] = {}
    collect_errors, ended = [], False
    lines = path.read_text().splitlines() if path.exists() else []
    for line in lines:
        what, nodeid, outcome, message = [*line.split("\t"), "", "", ""][:4]
        if what == "start":
            outcomes[nodeid] = ("hung", "did not finish before the timeout")
        elif what == "collect":
            collect_errors.append(f"{nodeid}: {message}")
        elif what == "end":
            ended = True
        elif what == "collected":
            continue
        elif what == "deselected":
            outcomes[nodeid] = ("deselected", "")
        elif outcome == "failed" or outcomes.get(nodeid, ("",))[0] != "failed":
            outcomes[nodeid] = (outcome, message)
    return outcomes, collect_errors, ended


# Messages of ranks that only waited for a failed peer: another rank's message is the reason.
_SECONDARY = (
    "timed out",
    "timeout",
    "connection closed",
    "connection reset",
    "broken pipe",
    "did not finish",
)


def _merge(ranks: list[dict[str, tuple[str, str]]]) -> FileResult:
    result = FileResult()
    for nodeid in dict.fromkeys(n for r in ranks for n in r):
        got = [r.get(nodeid, ("missing", "rank ended before this test")) for r in ranks]
        failed = [m for o, m in got if o not in ("passed", "skipped", "deselected")]
        if all(o == "deselected" for o, _ in got):
            result.verdicts[nodeid] = "deselected"
        elif failed:
            primary = [m for m in failed if not any(s in m.lower() for s in _SECONDARY)]
            result.verdicts[nodeid] = "failed"
            result.reasons[nodeid] = (primary or failed)[0]
        elif any(o == "passed" for o, _ in got):
            result.verdicts[nodeid] = "passed"
        else:
            result.verdicts[nodeid] = "skipped"
            result.reasons[nodeid] = got[0][1]
    return result


# Seconds a rank may take to exit once its pytest session has ended; megatron-core leaves threads
# running on CPU in some failures, and the process then never exits by itself.
EXIT_GRACE = 60.0


def _wait(procs: list, results: list[Path], args: argparse.Namespace, n_files: int) -> tuple[bool, list[int]]:
    """Wait for every rank, killing those past ``--file-timeout`` (per file) and those that
    outlive their session by ``EXIT_GRACE``; returns (any killed by the timeout, ranks stuck at exit)."""
    deadline, killed, stuck = time.monotonic() + args.file_timeout * n_files, False, []
    ended_at: dict[int, float] = {}
    while any(proc.poll() is None for proc, _ in procs):
        now = time.monotonic()
        for rank, (proc, _) in enumerate(procs):
            if proc.poll() is not None:
                continue
            if (
                rank not in ended_at
                and results[rank].exists()
                and "\nend\t" in "\n" + results[rank].read_text()
            ):
                ended_at[rank] = now
            if now > deadline or now - ended_at.get(rank, now) > EXIT_GRACE:
                proc.kill()
                proc.wait()
                if rank in ended_at:
                    stuck.append(rank)
                else:
                    killed = True
        time.sleep(1.0)
    for _, log in procs:
        log.close()
    return killed, stuck


def _session(
    dest: Path, test_files: list[str], mode: str, args: argparse.Namespace, out: Path, part: str
) -> FileResult:
    """One pytest session of ``test_files`` on ``args.world`` processes, keeping the collected
    tests ``part`` (``"start:stop"``, or ``""`` for all); the merged verdicts."""
    port = str(free_port())
    out.mkdir(parents=True, exist_ok=True)
    procs = []
    for rank in range(args.world):
        results = out / f"rank{rank}.tsv"
        results.unlink(missing_ok=True)
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(args.world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            MESHGROUPS_MODE=mode,
            MESHGROUPS_RESULTS=str(results),
            MEGATRON_LM_PG_TIMEOUT=str(args.pg_timeout),
            MEGATRON_LM_MAX_PARAMS=str(args.max_params),
            MEGATRON_LM_PART=part,
            CUDA_VISIBLE_DEVICES="",
        )
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--continue-on-collection-errors",
        ]
        cmd += ["--timeout", str(args.test_timeout), *test_files]
        log = open(out / f"rank{rank}.log", "w")  # closed below, after the process ends
        procs.append((subprocess.Popen(cmd, cwd=dest, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    killed, stuck = _wait(procs, [out / f"rank{r}.tsv" for r in range(args.world)], args, len(test_files))
    parsed = [_rank_outcomes(out / f"rank{rank}.tsv") for rank in range(args.world)]
    result = _merge([p[0] for p in parsed])
    result.notes += sorted({e for p in parsed for e in p[1]})
    if stuck:
        result.notes.append(
            f"{part or 'all'}: ranks {stuck} did not exit within {EXIT_GRACE:.0f}s of their session's end "
            "(threads left running): killed"
        )
    if killed:
        ended = sum(p[2] for p in parsed)
        result.notes.append(
            f"{part or 'all'}: killed after --file-timeout {args.file_timeout:.0f}s ({ended} of {args.world} "
            "ranks had finished their tests: the others hung in a test or at exit)"
        )
    return result


def _collected(out: Path) -> int:
    """How many tests rank 0's session collected (after ``--max-params``), 0 if it never said."""
    path = out / "rank0.tsv"
    for line in path.read_text().splitlines() if path.exists() else []:
        what, _, count = [*line.split("\t"), "", ""][:3]
        if what == "collected":
            return int(count)
    return 0


def run_files(dest: Path, test_files: list[str], mode: str, args: argparse.Namespace) -> FileResult:
    """``test_files`` on ``args.world`` processes in ``mode``: one pytest session, or in
    megatron-core mode with ``args.chunk`` = N > 0 one fresh session per N collected tests; the
    merged verdicts (``--file-timeout`` bounds each session).

    Why megatron-core only: its ``destroy_model_parallel`` drops its groups without destroying
    them, so on gloo each initialisation leaves ~50 threads per rank behind (``pt_gloo_runloop``,
    ``gloo_tcp_loop``), and a long session slows to minutes per test as they pile up; compat
    destroys the groups it made, and its sessions stay fast."""
    name = Path(test_files[0]).stem if len(test_files) == 1 else f"{len(test_files)}-files"
    out = dest / "results" / mode / name
    chunk = getattr(args, "chunk", 0) if mode == "megatron-core" else 0
    if chunk <= 0:
        return _session(dest, test_files, mode, args, out, "")
    merged, start, total = FileResult(), 0, None
    while total is None or start < total:
        part = out / f"part{start // chunk}"
        got = _session(dest, test_files, mode, args, part, f"{start}:{start + chunk}")
        total = _collected(part) if total is None else total
        merged.verdicts.update(got.verdicts)
        merged.reasons.update(got.reasons)
        merged.notes += [n for n in got.notes if n not in merged.notes]
        start += chunk
    return merged


def table(files: list[str], results: dict[str, dict[str, FileResult]], modes: Iterable[str]) -> str:
    """The Markdown table: per file, tests run, skipped, tests passed per mode, tests not run
    (``--max-params``)."""
    modes = list(modes)
    lines = ["| file | tests run | skipped | " + " | ".join(f"pass on {m}" for m in modes) + " | not run |"]
    lines.append("|---" * (4 + len(modes)) + "|")
    for f in files:
        by_mode = results[f]
        first = by_mode[modes[0]]
        tests = max(len(r.verdicts) - r.count("deselected") for r in by_mode.values())
        name = f.removeprefix("tests/unit_tests/")
        cells = [str(by_mode[m].count("passed")) for m in modes]
        lines.append(
            f"| {name} | {tests} | {first.count('skipped')} | "
            + " | ".join(cells)
            + f" | {first.count('deselected')} |"
        )
    return "\n".join(lines)


def details(files: list[str], results: dict[str, dict[str, FileResult]], modes: list[str]) -> str:
    """Failures per mode with their reasons, notes, and the tests that pass on megatron-core only."""
    out = []
    for f in files:
        for m in modes:
            r = results[f][m]
            for note in r.notes:
                out.append(f"{m} {f}: {note}")
            for nodeid, verdict in r.verdicts.items():
                if verdict == "failed":
                    out.append(f"{m} FAILED {nodeid}: {r.reasons[nodeid]}")
        if set(modes) == set(MODES):
            theirs, ours = results[f]["megatron-core"], results[f]["compat"]
            for nodeid, verdict in theirs.verdicts.items():
                if verdict == "passed" and ours.verdicts.get(nodeid) != "passed":
                    out.append(
                        f"GAP (passes on megatron-core only) {nodeid}: {ours.reasons.get(nodeid, 'not run')}"
                    )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """Command line: see the module docstring. Returns 1 when a test passes on megatron-core only."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "files", nargs="*", default=["parallel_state"], help=f"groups {sorted(GROUPS)} or paths"
    )
    parser.add_argument("--git-dir", required=True, help="a Megatron-LM git directory (clone or bare)")
    parser.add_argument("--tag", default="core_v0.16.1")
    parser.add_argument("--mode", default="both", choices=[*MODES, "both"])
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--file-timeout", type=float, default=1800, help="seconds for one file, all ranks")
    parser.add_argument(
        "--test-timeout", type=float, default=600, help="seconds for one test (pytest-timeout)"
    )
    parser.add_argument("--pg-timeout", type=float, default=180, help="seconds: the default group's timeout")
    parser.add_argument(
        "--together", action="store_true", help="all files in one pytest session per mode (one start-up)"
    )
    parser.add_argument(
        "--max-params",
        type=int,
        default=0,
        help="run N parametrizations per test function, evenly spread (0: all)",
    )
    parser.add_argument(
        "--chunk",
        type=int,
        default=0,
        help="megatron-core mode: a fresh session (new processes) per N collected tests (0: one session)",
    )
    parser.add_argument("--keep", help="extract into this directory and keep the logs")
    parser.add_argument("--rewrites", action="store_true", help="print the source rewrites and exit")
    args = parser.parse_args(argv)
    if args.rewrites:
        print("\n".join(f"{why}:  s/{pattern}/{repl}/" for pattern, repl, why in REWRITES))
        return 0
    dest = Path(args.keep or tempfile.mkdtemp(prefix="megatron-lm-tests-"))
    files = extract(args.git_dir, args.tag, dest, expand(args.files))
    modes = list(MODES) if args.mode == "both" else [args.mode]
    results: dict[str, dict[str, FileResult]] = {f: {} for f in files}
    for batch in [files] if args.together else [[f] for f in files]:
        for m in modes:
            start = time.monotonic()
            merged = run_files(dest, batch, m, args)
            for f in batch:
                results[f][m] = r = merged.only(f)
                print(
                    f"{m:>13} {f}: {len(r.verdicts) - r.count('deselected')} tests, {r.count('passed')} passed, "
                    f"{r.count('failed')} failed, {r.count('skipped')} skipped",
                    flush=True,
                )
            print(f"{m:>13} ({len(batch)} file(s) in {time.monotonic() - start:.0f}s)", flush=True)
    print(f"\n{table(files, results, modes)}\n\n{details(files, results, modes)}\n(logs: {dest}/results)")
    gap = set(modes) == set(MODES) and any(
        v == "passed" and results[f]["compat"].verdicts.get(n) != "passed"
        for f in files
        for n, v in results[f]["megatron-core"].verdicts.items()
    )
    return 1 if gap else 0


if __name__ == "__main__":
    sys.exit(main())
