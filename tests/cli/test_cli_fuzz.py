"""Hostile input to the command line, driven in-process (``meshgroups.cli._app.main``): a refusal must be
exit status 2 with one ``error:`` line and no traceback — hostile arguments, hostile JSON files,
random words; the demo starts only what the layout needs. The API's hostile input is in
``test_api_fuzz.py``.
"""

from __future__ import annotations

import contextlib
import io

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshgroups.cli._app import main


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    return code, out.getvalue(), err.getvalue()


BAD_ARGV = [
    ["show", "tp=1_000"],
    ["show", "tp=٣"],
    ["show", "tp= 8"],
    ["show", "tp=99999999999999999999999"],
    ["show", "tp=2", "--world-size", "1_0"],
    ["show", "tp=2", "--world-size", "٣"],
    ["show", "tp=2", "--world-size", "99999999999999999999999"],
    ["show", "tp=2", "--rank", "99999999999999"],
    ["show", "tp=2", "--ranks-per-node", "99999999999999"],
    ["show", *[f"d{i}=1" for i in range(65)], "--any-names"],
    ["show", "tp=2", "--topology", "node=8,node=16"],
    ["show", "tp=2", "--topology", "node=1_0"],
    ["show", "tp=2", "--topology", ""],
    ["show", "tp=2", "--topology", "node=99999999999999999999999"],
    ["show", "--from-json", "/dev/null"],
    ["show", "--from-json", "/nonexistent.json"],
    ["show", "tp=2", "--order", "tp-tp"],
    ["show", "tp=16777217"],
    ["show", "a=4096", "b=4096", "c=2", "--any-names"],
    ["place", "tp=2", "--topology", "node=4", "--require", "tp=node,tp=rack"],
    ["place", "tp=2", "--topology", "node=4", "--require", "tp"],
    ["place", "tp=2", "--topology", "node=4", "--fast-first", "tp,tp"],
    ["place", "tp=2", "--topology", "node=4", "--fast-first", "xx"],
    ["place", "tp=٣", "--topology", "node=4"],
    ["place", "tp=2", "--topology", "node=0"],
    ["plot", "tp=2", "-o", ""],
    ["plot", "tp=2", "-o", "/"],
    ["plot", "tp=2", "--dpi", "9000"],
    ["plot", "tp=2", "--dpi", "1_0"],
    ["plot", "tp=2", "--color-by", ""],
    ["plot", "tp=2", "--color-by", ",,"],
    ["plot", "tp=2", "--rank", "-3"],
    ["demo", "a=16777216", "--any-names"],
    ["demo", "dp=-1"],
    ["demo", "dp=-1", "tp=-1", "--nproc", "4"],
    ["demo", "dp=-1", "tp=3", "--nproc", "4"],
    ["demo", "dp=2", "tp=2", "--nproc", "8"],
    ["demo", "--nproc", "100000"],
    ["demo", "--nproc", "1_0"],
    ["demo", "--timeout", "1e-300"],
    ["demo", "--timeout", "1e308"],
    ["demo", "--timeout", "nan"],
    ["demo", "--timeout", "inf"],
    ["demo", "--timeout", "٣"],
    ["demo", "--strategy", "split"],
    ["demo", "tp=0"],
    ["demo", "tp=2", "--order", "tp-xp"],
    ["frobnicate"],
    [],
]


def _refused_cleanly(argv: list[str]) -> str | None:
    code, _, err = run_cli(argv)
    lines = [line for line in err.splitlines() if "error:" in line]
    if code != 2 or len(lines) != 1 or "Traceback" in err:
        return f"{argv}: exit {code}, stderr {err[-300:]!r}"
    return None


def test_cli_refuses_hostile_arguments_with_exit_2_and_one_message(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)  # the demo must spawn nothing: every list is refused
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    failures = [f for argv in BAD_ARGV if (f := _refused_cleanly(argv))]
    assert not failures, "\n".join(failures)


def test_cli_demo_names_no_option_it_lacks(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    code, _, err = run_cli(["demo", "dp=-1", "tp=3", "--nproc", "8"])
    assert code == 2 and "world_size=" not in err
    assert "tp=3 does not divide the 8 processes of --nproc 8, so dp=-1 cannot be inferred" in err
    code, _, err = run_cli(["demo", "dp=2", "tp=2", "--nproc", "8"])
    assert "the layout has 4 ranks but --nproc 8; the demo runs one process per rank" in err
    code, _, err = run_cli(["demo", "a=16777216", "--any-names"])
    assert "the demo spawns at most 64 processes on this machine" in err


WORDS = st.sampled_from(
    ["tp=2", "dp=-1", "pp=0", "tp=1_0", "x=٣", "=", "tp", "--world-size", "4", "--order", "tp-dp",
     "--rank", "-1", "--full", "--json", "--topology", "node=2", "node=2,node=2", "--ranks-per-node",
     "--any-names", "--from-json", "99999999999999999999", "-1", ""]
)  # fmt: skip


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["show", "place"]), st.lists(WORDS | st.text(max_size=8), max_size=6))
def test_cli_random_words_exit_0_or_2_never_a_traceback(command, words):
    if command == "place" and "--topology" not in words:
        words = [*words, "--topology", "node=2"]
    code, _, err = run_cli([command, *words])
    assert code in (0, 2), (words, err)
    assert "Traceback" not in err
    if code == 2:
        assert len([line for line in err.splitlines() if "error:" in line]) == 1, err


@pytest.mark.parametrize(
    "content",
    [
        "[" * 100_000 + "]" * 100_000,  # nested past the JSON decoder's recursion limit
        '{"tp": [[0.0, 1.9]]}',  # float ranks
        '{"tp": [["0", "1"]]}',  # string ranks
        '{"tp": [[0, NaN]]}',
        '{"tp": [[0, 18446744073709551616]]}',
        "{" + ", ".join(f'"f{i}": [[0], [1]]' for i in range(2000)) + "}",  # 2,000 size-1 families
        '{"format": "meshgroups.Layout/1", "dims": [["a", 1e400]]}',
        "\xff\xfe",
    ],
)
def test_cli_from_json_refuses_hostile_files(tmp_path, content):
    path = tmp_path / "groups.json"
    path.write_text(content, encoding="latin-1")
    assert _refused_cleanly(["show", "--from-json", str(path)]) is None


DEMO_WORDS = st.sampled_from(
    ["dp=-1", "tp=2", "pp=3", "a=16777216", "tp=0", "dp=1_0", "--nproc", "4", "8", "64", "65", "--timeout",
     "1e-300", "1e308", "5", "--order", "tp-dp", "--any-names", "--strategy", "local", "x", ""]
)  # fmt: skip


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(DEMO_WORDS, max_size=6))
def test_cli_demo_random_words_start_only_what_the_layout_needs(words):
    """Whatever the words, the demo either refuses them (exit 2, one message) or starts exactly
    one process per rank of the layout, at most MAX_PROCESSES, with a timeout in range."""
    import os

    from meshgroups.cli import _demo as demo

    started = []
    saved = demo.main, os.environ.pop("RANK", None), os.environ.pop("WORLD_SIZE", None)
    demo.main = lambda layout, nproc, **kw: started.append((layout, nproc, kw)) or 0  # type: ignore[assignment]
    try:
        code, _, err = run_cli(["demo", *words])
    finally:
        demo.main = saved[0]  # type: ignore[assignment]
        for key, value in zip(("RANK", "WORLD_SIZE"), saved[1:]):
            if value is not None:
                os.environ[key] = value
    assert "Traceback" not in err
    if code == 2:
        assert not started and len([line for line in err.splitlines() if "error:" in line]) == 1, err
    else:
        assert code == 0 and len(started) == 1, (words, err)
        layout, nproc, kw = started[0]
        assert layout.world_size == nproc <= demo.MAX_PROCESSES and layout.rank_offset == 0
        assert 1 <= kw["timeout"] <= demo.MAX_TIMEOUT
