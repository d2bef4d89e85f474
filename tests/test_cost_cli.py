"""``python -m meshgroups cost`` (``meshgroups.cli._cost``), through a small argparse of its own and
through the project's ``main``: one layout's report, an enumeration, JSON, and strict refusals
(status 2, one ``error:`` line)."""

from __future__ import annotations

import argparse
import json

import pytest

from meshgroups.cli import _cost as command


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="meshgroups")
    command.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_one_layout_prints_memory_and_bytes_per_level(capsys):
    assert _run(["cost", "pp=2", "dp_shard=2", "tp=2", "--model", "tiny", "--topology", "node=4"]) == 0
    out = capsys.readouterr().out
    assert "peak memory per rank" in out and "pipeline bubble: 0.500" in out
    assert "slowest level crossed: world" in out and out.count("\ntp ") == 1


def test_json_report_is_the_cost_report(capsys):
    from meshgroups import Layout, Topology
    from meshgroups.cost import cost_report, preset

    _run(["cost", "dp_shard=4", "tp=2", "--model", "tiny", "--topology", "node=4", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert data == json.loads(
        json.dumps(cost_report(preset("tiny"), Layout(dp_shard=4, tp=2), Topology(node=4)))
    )


def test_world_enumerates_with_a_budget(capsys, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "num_hidden_layers": 4,
                "hidden_size": 64,
                "num_attention_heads": 8,
                "intermediate_size": 128,
                "vocab_size": 256,
                "num_key_value_heads": 4,
            }
        )
    )
    assert (
        _run(
            [
                "cost",
                "--world",
                "8",
                "--hf-config",
                str(config),
                "--seq-len",
                "32",
                "--budget-gib",
                "1",
                "--json",
            ]
        )
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert data["candidates"] and all(c["fits"] for c in data["candidates"])
    sizes = [c["sizes"] for c in data["candidates"]]
    assert all(s["pp"] * s["dp_replicate"] * s["dp_shard"] * s["cp"] * s["tp"] == 8 for s in sizes)
    _run(["cost", "--world", "8", "--model", "tiny", "--top", "3", "--sort", "memory"])
    out = capsys.readouterr().out
    assert "ordered by memory" in out and "(first 3 of" in out


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["cost", "tp=2", "--world", "4", "--model", "tiny"], "not both or neither"),
        (["cost", "--model", "tiny"], "not both or neither"),
        (["cost", "xp=2", "--model", "tiny"], "role=size words"),
        (["cost", "tp=٢", "--model", "tiny"], "digits 0-9"),
        (["cost", "tp=2", "tp=2", "--model", "tiny"], "given twice"),
        (["cost", "tp=16", "--model", "tiny"], "tp=16 does not divide heads=8"),
        (["cost", "--world", "1_000", "--model", "tiny"], "--world must be an integer"),
        (["cost", "--world", "0", "--model", "tiny"], "--world must be in"),
        (["cost", "tp=2", "--model", "nope"], "invalid choice"),
        (["cost", "tp=2", "--model", "tiny", "--topology", "node=3,node=6"], "given twice"),
        (["cost", "tp=2", "--model", "tiny", "--budget-gib", "nan"], "--budget-gib"),
        (["cost", "tp=2", "--hf-config", "/nonexistent.json"], "cannot read"),
        (["cost", "tp=2"], "one of the arguments --model --hf-config is required"),
    ],
)
def test_bad_values_exit_2_with_one_error_line(argv, says, capsys):
    with pytest.raises(SystemExit) as exc:
        _run(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and says in errors[0], err


def test_the_project_command_line_runs_cost(capsys):
    from meshgroups.cli import main

    assert main(["cost", "dp_shard=4", "--model", "tiny", "tp=2", "--topology", "node=4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    capsys.readouterr()
    assert _run(["cost", "dp_shard=4", "tp=2", "--model", "tiny", "--topology", "node=4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == data  # dims anywhere among the options, same report
    with pytest.raises(SystemExit) as exc:
        main(["cost", "tp=3", "--model", "tiny"])
    assert exc.value.code == 2
