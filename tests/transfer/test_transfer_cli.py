"""``python -m meshgroups transfer``: the summary agrees with the plan; bad input exits 2 with
one message (in-process through ``cli.main``, no subprocess start-up per case)."""

from __future__ import annotations

import json

import pytest

from meshgroups import Layout, Topology
from meshgroups.cli._app import main
from meshgroups.transfer import NameMap, Shard, Weight, plan_transfer
from meshgroups.transfer._names.conventions import vllm_map
from meshgroups.transfer._names.presets import model_config, model_weights


def _json(capsys, *argv):
    assert main(["transfer", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_summary_matches_the_plan(capsys):
    argv = ["--src", "pp=2,tp=4", "--dst", "tp=8", "--dst-offset", "8", "--ranks-per-node", "8"]
    data = _json(capsys, *argv, "--model", "tiny")
    src, dst = Layout(pp=2, tp=4), Layout(tp=8, rank_offset=8)
    weights = model_weights("tiny", dst)
    plan = plan_transfer(src, model_weights("tiny", src), dst, weights, topology=Topology(node=8))
    total = sum(w.nbytes for w in weights)
    assert data["messages"] == plan.n_messages and data["cross_node_bytes"] == plan.cross_node_bytes
    assert data["cross_node_bytes"] == data["cross_node_lower_bound"] == total  # disjoint nodes
    assert [n["received_cross_node"] for n in data["per_node"]] == [0, total]  # each byte once
    assert [r["rank"] for r in data["per_rank"]] == list(range(16))
    assert sum(r["received"] for r in data["per_rank"]) == sum(plan.recv_bytes.values())
    assert {r["role"] for r in data["per_rank"][:8]} == {"src"}

    assert main(["transfer", *argv, "--model", "tiny"]) == 0
    text = capsys.readouterr().out
    assert "per node" in text and "per rank" in text and "cross-node lower bound" in text
    assert "Layout(pp=2, tp=4) -> dst Layout(tp=8, rank_offset=8)" in text


def test_colocated_fsdp_and_experts(capsys):
    data = _json(capsys, "--src", "dp_shard=4,tp=2", "--dst", "dp=2,tp=4", "--model", "tiny")
    assert data["local_copies"] > 0 and {r["role"] for r in data["per_rank"]} == {"src+dst"}
    assert data["per_node"] == []  # no --ranks-per-node: every rank its own node
    moe = _json(
        capsys, "--src", "ep=4,etp=2", "--dst", "ep=2,tp=4", "--dst-offset", "8", "--model", "moe-small"
    )
    experts = [w for w in model_weights("moe-small", Layout(ep=2, tp=4)) if "experts" in w.name]
    assert experts and all(w.placements["ep"].axis == 0 for w in experts)
    assert moe["cross_node_bytes"] == moe["cross_node_lower_bound"]


def test_weights_from_json(tmp_path, capsys):
    spec = {
        "src": [
            {"name": "w", "shape": [6, 4], "placements": {"tp": "Shard(0)"}},
            {"name": "b", "shape": [4]},
        ],
        "dst": [
            {"name": "w", "shape": [6, 4], "placements": {"tp": "Shard(1)", "dp": "Replicate()"}},
            Weight("b", (4,), placements={"tp": Shard(0)}).to_dict(),
        ],
    }
    path = tmp_path / "weights.json"
    path.write_text(json.dumps(spec))
    data = _json(capsys, "--src", "tp=2", "--dst", "dp=2,tp=2", "--dst-offset", "2", "--weights", str(path))
    received = {r["rank"]: r["received"] for r in data["per_rank"]}
    assert received == {0: 0, 1: 0, 2: 56, 3: 56, 4: 56, 5: 56}  # 6×2 floats + 2 floats each


def test_min_part_bytes_spreads_a_small_rollout(capsys):
    """Eight trainer replicas feed one rollout node: pieces never cut load one holder in 8;
    cut on 64-byte multiples, every replica sends and the busiest is within the bound."""
    argv = ["--src", "dp=8,tp=2", "--dst", "tp=2", "--dst-offset", "16", "--ranks-per-node", "4"]
    whole = _json(capsys, *argv, "--model", "tiny", "--min-part-bytes", str(1 << 40))
    cut = _json(capsys, *argv, "--model", "tiny", "--min-part-bytes", "64")
    assert cut["cross_node_bytes"] == whole["cross_node_bytes"] == cut["cross_node_lower_bound"]
    assert cut["send_lower_bound"] <= cut["busiest_send_bytes"] <= cut["busiest_send_bound"]
    assert cut["busiest_send_bytes"] < whole["busiest_send_bytes"]
    assert cut["busiest_send_bytes"] <= 1.1 * cut["ideal_send_bytes"]
    assert all(r["sent"] > 0 for r in cut["per_rank"][:16])
    assert cut["messages"] > whole["messages"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--src", "pp2", "--dst", "tp=2"], "dims are name=size words like tp=4, got 'pp2'"),
        (["--src", "tp=2", "--dst", ""], "--dst takes name=size words"),
        (["--src", "tp=0", "--dst", "tp=2"], "tp=0"),
        (["--src", "tp=2", "--dst", "tp=2", "--model", "gpt5"], "--model 'gpt5' is not a preset"),
        (["--src", "tp=2", "--dst", "tp=2", "--node", "0"], "--node must be positive"),
        (["--src", "tp=2", "--dst", "tp=2", "--src-offset", "-1"], "must be an integer >= 0"),
        (["--src", "tp=2", "--dst", "tp=2", "--min-part-bytes", "0"], "must be a positive integer"),
        (["--src", "tp=2", "--dst", "tp=2", "--weights", "/no/such/file.json"], "cannot read --weights"),
    ],
)
def test_bad_input_exits_2_with_one_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["transfer", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert len([line for line in err.splitlines() if "error:" in line]) == 1


def test_bad_weight_files_exit_2(tmp_path, capsys):
    cases = {
        "notjson.json": ("{", "is not JSON"),
        "list.json": ("[]", 'expected an object {"src": [...], "dst": [...]}'),
        "shape.json": (
            json.dumps({"src": [{"name": "w", "shape": [4]}], "dst": [{"name": "w", "shape": [5]}]}),
            "weight 'w'",
        ),
        "axis.json": (
            json.dumps({"src": [{"name": "w", "shape": [4], "placements": {"tp": "rows"}}], "dst": []}),
            "write 'Shard(axis)' or 'Replicate()'",
        ),
        "noshape.json": (json.dumps({"src": [{"name": "w"}], "dst": []}), "needs 'name' and 'shape'"),
    }
    for name, (text, message) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(SystemExit) as exc:
            main(["transfer", "--src", "tp=2", "--dst", "tp=2", "--weights", str(tmp_path / name)])
        assert exc.value.code == 2, name
        assert message in capsys.readouterr().err, name


@pytest.mark.processes
def test_presets_are_public_and_torch_free():
    """The CLI and the notebook take their models from one public, numpy-only function."""
    import subprocess
    import sys

    from meshgroups.cli import _transfer as _cli_transfer
    from meshgroups.transfer._names import presets

    assert _cli_transfer.model_weights is presets.model_weights
    code = "import sys, meshgroups.transfer._names.presets; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
    with pytest.raises(ValueError, match="unknown model 'gpt-5'; models are tiny"):
        presets.model_weights("gpt-5", Layout(tp=2))
    with pytest.raises(TypeError, match="layout must be a meshgroups.Layout"):
        presets.model_weights("tiny", {"tp": 2})


def test_the_notebook_uses_public_names_only():
    import pathlib

    book = json.loads((pathlib.Path(__file__).parents[2] / "notebooks" / "weight_transfer.ipynb").read_text())
    code = "\n".join("".join(c["source"]) for c in book["cells"] if c["cell_type"] == "code")
    assert "from meshgroups.transfer import model_weights" in code
    assert "meshgroups._" not in code  # no private module


def test_name_map_vllm_shows_fused_weights(capsys):
    argv = ["--src", "dp_shard=2,tp=2", "--dst", "tp=4", "--dst-offset", "4", "--ranks-per-node", "4"]
    argv += ["--src-dtype", "float32"]
    data = _json(capsys, *argv, "--model", "small", "--name-map", "vllm", "--cast", "bfloat16")
    src, dst = Layout(dp_shard=2, tp=2), Layout(tp=4, rank_offset=4)
    sws = model_weights("small", src, names="hf", dtype="float32")
    dws = model_weights("small", dst, names="vllm", dtype="bfloat16")
    plan = plan_transfer(
        src, sws, dst, dws, Topology(node=4), name_map=vllm_map(model_config("small")), cast="bfloat16"
    )
    assert data["cross_node_bytes"] == plan.cross_node_bytes == data["cross_node_lower_bound"]
    assert data["cross_node_bytes"] == sum(w.nbytes for w in sws) // 2  # fp32 -> bf16 on the wire
    assert data["n_fused"] == len(data["fused"]) == 8 and data["unused"] == []
    qkv = data["fused"][0]
    assert qkv["rollout"] == "model.layers.0.self_attn.qkv_proj.weight" and qkv["rank"] == 4
    # small: 16 heads of 64, 4 kv heads; tp=4: q 256 rows, k 64, v 64 per rank
    assert [(s["source"].rsplit(".", 2)[-2], s["rows"]) for s in qkv["local"]] == [
        ("q_proj", [0, 256]),
        ("k_proj", [256, 320]),
        ("v_proj", [320, 384]),
    ]
    assert qkv["buffer_shape"] == [384, 1024] and qkv["parts_sharded_separately"]

    assert main(["transfer", *argv, "--model", "small", "--name-map", "vllm", "--cast", "bfloat16"]) == 0
    text = capsys.readouterr().out
    assert "fused rollout weights (8, 4 shown" in text
    assert "q_proj.weight[0:1024] ‖ model.layers.0.self_attn.k_proj.weight[0:256]" in text
    assert "rank 4 buffer (384, 1024): 0:256 <- model.layers.0.self_attn.q_proj.weight" in text


def test_name_map_file_and_coverage(tmp_path, capsys):
    spec = {
        "src": [{"name": n, "shape": [r, 4]} for n, r in (("q", 4), ("k", 2), ("emb", 6))],
        "dst": [{"name": "qk", "shape": [6, 4], "dtype": "bfloat16", "placements": {"tp": "Shard(0)"}}],
    }
    (tmp_path / "w.json").write_text(json.dumps(spec))
    NameMap({"qk": {"parts": ["q", "k"], "sharding": "whole"}}).save(tmp_path / "map.json")
    argv = ["--src", "tp=1", "--dst", "tp=2", "--dst-offset", "1", "--weights", str(tmp_path / "w.json")]
    argv += ["--name-map", str(tmp_path / "map.json"), "--cast", "bfloat16"]
    with pytest.raises(SystemExit) as exc:
        main(["transfer", *argv])
    assert exc.value.code == 2 and "no rollout weight reads: emb" in capsys.readouterr().err
    data = _json(capsys, *argv, "--allow-unused")
    assert data["unused"] == ["emb"] and data["fused"][0]["parts_sharded_separately"] is False
    assert [s["rows"] for s in data["fused"][0]["local"]] == [[0, 3]]  # rank 1: rows 0..3 of q‖k, all q
    assert data["bytes_sent"] == 6 * 4 * 2
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(SystemExit):
        main(["transfer", "--src", "tp=1", "--dst", "tp=1", "--name-map", str(tmp_path / "bad.json")])
    assert "--name-map" in capsys.readouterr().err
