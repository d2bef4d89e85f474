"""One command-line convention (issue 52): every subcommand takes dims as ``name=size`` words and
one ``--node N``, knows the same model presets, prints ``--json`` as ONE JSON document, states
its defaults in ``--help``, and still accepts the old spellings with one ``warning:`` line on
stderr. Run in-process through ``meshgroups.cli._app.main`` (no process is spawned: the demo's
real run with ``--json --node`` is ``tests/render/test_render_cli.py::test_cli_demo_joins_torchrun``).
"""

from __future__ import annotations

import json

import pytest

from meshgroups import Layout
from meshgroups.cli._app import build_parser, main
from meshgroups.models import ALIASES, PRESETS

#: One call per subcommand, dims as words and --node, --json (plot writes its file in tmp).
CALLS = {
    "show": ["show", "pp=2", "dp=2", "tp=2", "--node", "4", "--json"],
    "place": ["place", "pp=2", "dp=2", "tp=2", "--node", "4", "--fast-first", "tp", "--json"],
    "plot": ["plot", "pp=2", "dp=2", "tp=2", "--node", "4", "--rank", "5", "--json", "-o", "{tmp}/l.png"],
    "transfer": [
        "transfer",
        "--src",
        "pp=2",
        "tp=2",
        "--dst",
        "tp=4",
        "--dst-offset",
        "4",
        "--node",
        "4",
        "--json",
    ],
    "shrink": ["shrink", "pp=2", "dp=2", "tp=2", "--lost", "5", "--node", "2", "--json"],
    "grow": ["grow", "pp=2", "dp=2", "tp=2", "--ranks", "8-11", "--node", "2", "--json"],
    "cost": ["cost", "pp=2", "dp=2", "tp=2", "--model", "tiny", "--node", "4", "--json"],
}


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        status = main(argv)
    except SystemExit as exc:
        status = int(exc.code or 0)
    out, err = capsys.readouterr()
    return status, out, err


def test_every_subcommand_is_covered():
    commands = set(build_parser().get_default("commands"))
    # demo: its parser below, its real run in test_render_cli; store takes no layout (it hosts an
    # elastic job's store until stopped): its run in test_elastic_torchrun
    assert commands == {*CALLS, "demo", "store"}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_dim_words_node_and_one_json_document(name, capsys, tmp_path):
    argv = [w.format(tmp=tmp_path) for w in CALLS[name]]
    status, out, err = _run(argv, capsys)
    assert status == 0, err
    assert err == ""  # the new spellings draw no warning
    data = json.loads(out)  # ONE document: json.loads refuses anything after it
    assert isinstance(data, dict) and data
    # lists of numbers sit on one line each (show --json once printed one integer per line)
    assert not any(line.strip().rstrip(",").isdigit() for line in out.splitlines())


def test_the_demo_takes_the_same_words():
    demo = build_parser().get_default("commands")["demo"]
    args = demo.parse_intermixed_args(["pp=2", "--node", "4", "dp=2", "tp=2", "--json"])
    assert args.dims == ["pp=2", "dp=2", "tp=2"] and args.node == 4 and args.json


@pytest.mark.parametrize(
    ("argv", "warning", "same_as"),
    [
        (
            ["show", "dp=2", "tp=2", "--ranks-per-node", "2", "--json"],
            "--ranks-per-node 2 is deprecated",
            ["show", "dp=2", "tp=2", "--node", "2", "--json"],
        ),
        (
            ["transfer", "--src", "pp=2,tp=2", "--dst", "tp=4", "--dst-offset", "4", "--json"],
            "--src pp=2,tp=2 is deprecated",
            ["transfer", "--src", "pp=2", "tp=2", "--dst", "tp=4", "--dst-offset", "4", "--json"],
        ),
        (
            ["transfer", "--src", "tp=2", "--dst", "tp=2", "--ranks-per-node", "2", "--json"],
            "--ranks-per-node 2 is deprecated",
            ["transfer", "--src", "tp=2", "--dst", "tp=2", "--node", "2", "--json"],
        ),
        (
            ["shrink", "--layout", "pp=2,dp=2,tp=2", "--lost", "5", "--json"],
            "--layout pp=2,dp=2,tp=2 is deprecated",
            ["shrink", "pp=2", "dp=2", "tp=2", "--lost", "5", "--json"],
        ),
        (
            ["cost", "tp=2", "--model", "llama-8b", "--json"],
            "--model llama-8b is deprecated",
            ["cost", "tp=2", "--model", "llama3-8b", "--json"],
        ),
        (
            ["transfer", "--src", "tp=2", "--dst", "tp=2", "--model", "llama-8b", "--json"],
            "--model llama-8b is deprecated",
            ["transfer", "--src", "tp=2", "--dst", "tp=2", "--model", "llama3-8b", "--json"],
        ),
    ],
)
def test_old_spellings_still_work_with_one_warning_line(argv, warning, same_as, capsys):
    status, out, err = _run(argv, capsys)
    assert status == 0, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: ") and warning in lines[0], err
    new_status, new_out, new_err = _run(same_as, capsys)
    assert new_status == 0 and new_err == "" and json.loads(out) == json.loads(new_out)


def test_one_set_of_model_presets(capsys):
    """cost and transfer take the same names (meshgroups.models.PRESETS) and refuse the same way."""
    for name in PRESETS:
        status, _, err = _run(["cost", "tp=1", "--model", name, "--json"], capsys)
        assert status == 0, (name, err)
    for name in ("llama3-8b", "small", "tiny-moe"):
        status, _, err = _run(
            ["transfer", "--src", "tp=1", "--dst", "tp=1", "--model", name, "--json"], capsys
        )
        assert status == 0, (name, err)
    assert set(ALIASES.values()) <= set(PRESETS)
    for command in (["cost", "tp=2"], ["transfer", "--src", "tp=2", "--dst", "tp=2"]):
        status, _, err = _run([*command, "--model", "llama3-8"], capsys)
        assert status == 2 and "--model 'llama3-8' is not a preset; did you mean 'llama3-8b'" in err, err


def test_help_states_every_default():
    """Every option with a default says it in --help (the sentence or '(default: ...)')."""
    commands = build_parser().get_default("commands")
    missing = []
    for name, parser in commands.items():
        formatter = parser._get_formatter()
        for action in parser._actions:
            if not action.option_strings or action.help in (None, "==SUPPRESS=="):
                continue
            assert action.help.strip(), f"{name} {action.option_strings[0]} has no sentence"
            if action.default not in (None, False, True, "==SUPPRESS==") and action.default != []:
                text = formatter._get_help_string(action) % {"default": action.default, "prog": name}
                if "default" not in text:
                    missing.append(f"{name} {action.option_strings[0]}")
    assert not missing, missing


def test_dim_typos_get_a_suggestion_everywhere(capsys):
    for argv in (
        ["show", "dpp=2", "tp=2"],
        ["shrink", "dpp=2", "tp=2", "--lost", "1"],
        ["transfer", "--src", "tpp=2", "--dst", "tp=2"],
    ):
        status, _, err = _run(argv, capsys)
        assert status == 2 and "did you mean" in err, (argv, err)
    # and the Python API says it too (issue 52: the CLI had it, the library did not)
    with pytest.raises(ValueError, match=r"unknown dim 'dpp'.*did you mean .*'dp'"):
        Layout(pp=2, dp=2).size("dpp")
