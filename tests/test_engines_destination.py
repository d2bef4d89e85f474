"""A vLLM worker's parameters as global weights and a name map (``meshgroups.engines.vllm.destination``;
vLLM-free): shapes and placements per layer kind, fused parts sharded per part, kv heads
replicated over more tp ranks than there are heads (repeated segments), the refusals — and the
replicated-kv rule moving real data with ``WeightSync`` on 3 gloo processes.
"""

from __future__ import annotations

import sys

import pytest

from meshgroups.engines.vllm.destination import Param, destination, destinations, fused_parts
from meshgroups.errors import LayoutError
from meshgroups.transfer import Replicate, Segment, Shard
from tests.support.dist import run

QKV = (("q.weight", 256, 256), ("k.weight", 128, 128), ("v.weight", 128, 128))


def test_plain_kinds():
    col, _ = destination(Param("e.weight", (128, 64), "float32", axis=0), tp=2)
    row, _ = destination(Param("o.weight", (64, 32), "bfloat16", axis=1), tp=2)
    rep, rule = destination(Param("norm.weight", (64,), "float32"), tp=2)
    assert (col.shape, col.placements) == ((256, 64), {"tp": Shard(0)})
    assert (row.shape, row.dtype, row.placements) == ((64, 64), "bfloat16", {"tp": Shard(1)})
    assert (rep.shape, dict(rep.placements)) == ((64,), {}) and rule.sources == ("norm.weight",)
    one, _ = destination(Param("e.weight", (128, 64), "float32", axis=0), tp=1)  # tp=1: whole
    assert one.shape == (128, 64) and not isinstance(one.placements.get("tp"), Shard)
    assert not isinstance(rep.placements.get("tp", Replicate()), Shard)


def test_fused_per_part():
    w, rule = destination(Param("qkv.weight", (256, 64), "float32", 0, QKV), tp=2)
    assert w.shape == (512, 64) and rule.sharding == "per_part" and rule.axis == 0
    assert rule.sources == ("q.weight", "k.weight", "v.weight")
    assert all(len(part) == 1 and part[0].full for part in rule.parts)


def test_replicated_kv_heads_are_repeated_segments():
    # 4 q heads, 1 kv head of 64 rows, tp=2: vLLM gives each rank the one kv head
    parts = (("q.weight", 256, 256), ("k.weight", 128, 64), ("v.weight", 128, 64))
    w, rule = destination(Param("qkv.weight", (256, 64), "float32", 0, parts), tp=2)
    assert w.shape == (512, 64)
    assert rule.parts[1] == (Segment("k.weight", 0, 64), Segment("k.weight", 0, 64))
    # 2 kv heads over tp=4: ranks 0, 1 hold head 0; ranks 2, 3 head 1
    parts4 = (("q.weight", 256, 256), ("k.weight", 256, 128), ("v.weight", 256, 128))
    _, rule4 = destination(Param("qkv.weight", (192, 64), "float32", 0, parts4), tp=4)
    assert [(s.start, s.stop) for s in rule4.parts[2]] == [(0, 64), (0, 64), (64, 128), (64, 128)]


def test_refusals_name_the_parameter_and_the_rule():
    with pytest.raises(LayoutError, match=r"'qkv.weight'.*add up to 400"):
        destination(Param("qkv.weight", (256, 64), "float32", 0, (("q.weight", 400, 400),)), tp=2)
    with pytest.raises(
        LayoutError, match=r"'qkv.weight': part 'k.weight' is 96 long over tp=2.*trainer weight is 64"
    ):
        destination(Param("qkv.weight", (48, 64), "float32", 0, (("k.weight", 96, 64),)), tp=2)


def test_name_map_and_fused_names():
    ws, m = destinations(
        [Param("a.qkv.weight", (256, 64), "float32", 0, QKV), Param("n.weight", (4,), "float32")], 2
    )
    assert [w.name for w in ws] == ["a.qkv.weight", "n.weight"]
    assert list(m) == ["a.qkv.weight"]  # a same-named weight needs no rule
    assert fused_parts("m.l.0.self_attn.qkv_proj.bias", {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}) == (
        "qkv_proj",
        ["m.l.0.self_attn.q_proj.bias", "m.l.0.self_attn.k_proj.bias", "m.l.0.self_attn.v_proj.bias"],
    )
    assert fused_parts("m.norm.weight", {"qkv_proj": ["q_proj"]}) is None


def worker_replicated_kv(rank: int, world: int):
    import torch

    from meshgroups import Layout
    from meshgroups.transfer.sync import WeightSync

    hd = 4
    torch.manual_seed(0)
    full = {
        "q.weight": torch.randn(4 * hd, 8),
        "k.weight": torch.randn(hd, 8),
        "v.weight": torch.randn(hd, 8),
    }
    parts = (("q.weight", 4 * hd, 4 * hd), ("k.weight", 2 * hd, hd), ("v.weight", 2 * hd, hd))
    ws, m = destinations([Param("qkv.weight", (4 * hd, 8), "float32", 0, parts)], tp=2)
    buf = {"qkv.weight": torch.full((4 * hd, 8), float("nan"))}
    with WeightSync(
        full if rank == 0 else None, Layout(tp=1), buf if rank else None, Layout(tp=2, rank_offset=1),
        rollout_weights=ws, name_map=m,
    ) as sync:  # fmt: skip
        sync.sync()
    if rank:
        r = rank - 1
        want = torch.cat([full["q.weight"].chunk(2)[r], full["k.weight"], full["v.weight"]])
        return bool(torch.equal(buf["qkv.weight"], want))
    return True


@pytest.mark.skipif(sys.platform != "linux", reason="gloo processes")
def test_replicated_kv_moves_the_right_rows():
    assert run(worker_replicated_kv, 3, timeout=120) == [True, True, True]
