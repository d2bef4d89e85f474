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


def test_memory_knobs_and_the_fit_verdict(capsys):
    argv = ["cost", "dp_shard=8", "--model", "llama3-8b", "--micro-batch", "2", "--precision", "fsdp2",
            "--recompute", "op", "--separate-projections", "--budget-gib", "95", "--allocator-overhead", "1.2"]  # fmt: skip
    assert _run(argv) == 0
    out = capsys.readouterr().out
    assert "at the loss backward" in out and "loss 23.48 GiB" in out and "transient 1.96 GiB" in out
    assert "fits 95.00 GiB per rank: yes (reserved (allocated × 1.20): 81.57 GiB)" in out
    assert _run([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (
        data["fit"]["fits"]
        and data["fit"]["overhead"] == 1.2
        and data["peak_memory"]["phase"] == "loss backward"
    )
    # no recomputation: the same run does not fit, and says why
    assert _run([a if a != "op" else "none" for a in argv]) == 0
    assert "fits 95.00 GiB per rank: no" in capsys.readouterr().out
    # uneven pipeline stages, an interleaved schedule, ZeRO-1, eager attention, custom dtypes
    assert _run(["cost", "pp=2", "dp_replicate=2", "tp=2", "--model", "tiny", "--schedule", "interleaved",
                 "--virtual-stages", "2", "--layers-per-stage", "1,1,1,1", "--micro-batches", "4", "--zero", "1",
                 "--attention", "eager", "--compute-dtype", "bf16", "--reduce-dtype", "fp32", "--json"]) == 0  # fmt: skip
    data = json.loads(capsys.readouterr().out)
    assert data["peak_memory"]["total"] > 0 and data["fit"] is None
    # the transfer presets' older names are the same models
    assert _run(["cost", "tp=2", "--model", "llama-8b", "--json"]) == 0
    old = json.loads(capsys.readouterr().out)
    assert _run(["cost", "tp=2", "--model", "llama3-8b", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["peak_memory"] == old["peak_memory"]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["cost", "tp=2", "--world", "4", "--model", "tiny"], "not both or neither"),
        (["cost", "--model", "tiny"], "not both or neither"),
        (["cost", "xp=2", "--model", "tiny"], "dim 'xp' plays no role"),
        (["cost", "tp=٢", "--model", "tiny"], "digits 0-9"),
        (["cost", "tp=2", "tp=2", "--model", "tiny"], "duplicate dim name 'tp'"),
        (["cost", "tp=16", "--model", "tiny"], "tp=16 does not divide heads=8"),
        (["cost", "--world", "1_000", "--model", "tiny"], "--world must be an integer"),
        (["cost", "--world", "0", "--model", "tiny"], "--world must be in"),
        (["cost", "tp=2", "--model", "nope"], "--model 'nope' is not a preset"),
        (["cost", "tp=2", "--model", "tiny", "--topology", "node=3,node=6"], "given twice"),
        (["cost", "tp=2", "--model", "tiny", "--budget-gib", "nan"], "--budget-gib"),
        (["cost", "tp=2", "--hf-config", "/nonexistent.json"], "cannot read"),
        (["cost", "tp=2"], "one of the arguments --model --hf-config is required"),
        (["cost", "tp=2", "--model", "tiny", "--allocator-overhead", "0.9"], "--allocator-overhead must be"),
        (["cost", "pp=2", "--model", "tiny", "--layers-per-stage", "1,x"], "--layers-per-stage must be"),
        (
            ["cost", "pp=2", "--model", "tiny", "--layers-per-stage", "1,1"],
            "layers_per_stage=[1, 1] must have",
        ),
        (["cost", "tp=2", "--model", "tiny", "--recompute", "most"], "invalid choice: 'most'"),
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
