"""Mapped plans (numpy only, no processes): fusions, splits, interleaves, ties and casts against a
brute force that fills every rollout buffer element by element (``tests/support/mapped_oracle.py``)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings

from meshgroups import Layout, LayoutError, Topology
from meshgroups.transfer import NameMap, Shard, Weight, plan_transfer

from ..support.mapped_oracle import check_mapped, check_mapped_local, mapped_worlds, node_of
from ..support.transfer_oracle import check_balance, check_plan

T2 = Topology(node=2)


def _check(
    src: Layout,
    sws: list[Weight],
    dst: Layout,
    dws: list[Weight],
    nm: NameMap,
    topo: Topology | None,
    **kw: object,
) -> None:
    plan = plan_transfer(src, sws, dst, dws, topo, name_map=nm, cast=True, **kw)  # type: ignore[arg-type]
    check_mapped(plan, src, sws, dst, dws, nm, node_of(topo))
    # The links are weights like any other: the unmapped oracle's checks hold on them too
    # (messages element by element in window coordinates, the senders' balance and its bounds).
    assert plan.mapping is not None
    links = list(plan.mapping.links.values())
    # (in wire bytes: the oracle reads a source weight's itemsize)
    src_l = [dataclasses.replace(ln.src, dtype=ln.dst.dtype) for ln in links]
    dst_l = [ln.dst for ln in links]
    check_plan(plan, src, src_l, dst, dst_l, node_of(topo))  # type: ignore[arg-type]
    check_balance(plan, src, src_l, dst, dst_l, node_of(topo))  # type: ignore[arg-type]
    check_mapped_local(plan, src, sws, dst, dws, topology=topo, name_map=nm, cast=True, **kw)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mapped_worlds())
def test_random_fusions_splits_ties_against_brute_force(world: tuple) -> None:  # type: ignore[type-arg]
    _check(*world)


def _gqa(tp_t: int, tp_r: int, fsdp: int = 1) -> tuple[Layout, list[Weight], Layout, list[Weight]]:
    """A trainer with separate q, k, v (GQA: 16, 4, 4 rows) and gate/up; a rollout with fused
    qkv / gate_up column-sharded over its tp."""
    h = 8
    trainer = Layout(dp_shard=fsdp, tp=tp_t)
    pl = {"tp": Shard(0), "dp_shard": Shard(0)} if fsdp > 1 else {"tp": Shard(0)}
    order = ("tp", "dp_shard") if fsdp > 1 else None
    sws = [
        Weight(n, (rows, h), "float32", pl, None, order)
        for n, rows in (("q", 16), ("k", 4), ("v", 4), ("gate", 12), ("up", 12))
    ]
    rollout = Layout(tp=tp_r, rank_offset=trainer.world_size)
    dws = [
        Weight("qkv", (24, h), "bfloat16", {"tp": Shard(0)}),
        Weight("gate_up", (24, h), "bfloat16", {"tp": Shard(0)}),
    ]
    return trainer, sws, rollout, dws


@pytest.mark.parametrize("sharding", ["per_part", "whole"])
@pytest.mark.parametrize(("tp_t", "tp_r", "fsdp"), [(2, 4, 1), (4, 4, 1), (2, 2, 2), (1, 4, 2)])
def test_gqa_qkv_column_sharded(sharding: str, tp_t: int, tp_r: int, fsdp: int) -> None:
    src, sws, dst, dws = _gqa(tp_t, tp_r, fsdp)
    nm = NameMap(
        {
            "qkv": {"parts": ["q", "k", "v"], "sharding": sharding},
            "gate_up": {"parts": ["gate", "up"], "sharding": sharding},
        }
    )
    for topo in (None, T2, Topology(node=4)):
        _check(src, sws, dst, dws, nm, topo)


def test_vllm_layout_per_rank() -> None:
    """tp=4, q/k/v of 16/4/4 rows: rank r's buffer is q rows 4r..4r+4, k row r, v row r."""
    src, sws, dst, dws = _gqa(1, 4)
    plan = plan_transfer(
        src, sws, dst, dws, name_map={"qkv": ["q", "k", "v"], "gate_up": ["gate", "up"]}, cast="bfloat16"
    )
    assert plan.mapping is not None
    r = dst.rank_at(tp=2)
    got = [
        (ln.source, ln.src_local(0, ln.dst.box(dst, r)), ln.dst_local(r))
        for ln in plan.mapping.sources("qkv")
    ]
    assert got == [
        ("q", ((8, 12), (0, 8)), ((0, 4), (0, 8))),
        ("k", ((2, 3), (0, 8)), ((4, 5), (0, 8))),
        ("v", ((2, 3), (0, 8)), ((5, 6), (0, 8))),
    ]
    assert plan.mapping.buffer_shape("qkv", r) == (6, 8)
    # fp32 -> bf16: every byte counted in bf16 (half the trainer's).
    assert sum(m.nbytes for m in plan.messages) == (24 + 24) * 8 * 2
    moves = plan.moves(r)
    assert moves and all(m.cast and m.dtype == "bfloat16" for m in moves if m.step == 0)


def test_cast_halves_cross_node_bytes() -> None:
    src, sws, dst, dws = _gqa(2, 2)
    nm = {"qkv": ["q", "k", "v"], "gate_up": ["gate", "up"]}
    bf16 = plan_transfer(src, sws, dst, dws, T2, name_map=nm, cast="bfloat16")
    same = [Weight(w.name, w.shape, "float32", w.placements) for w in dws]
    fp32 = plan_transfer(src, sws, dst, same, T2, name_map=nm)
    assert fp32.cross_node_bytes == 2 * bf16.cross_node_bytes > 0
    assert bf16.cross_node_bytes == bf16.cross_node_lower_bound


def test_unmapped_plan_unchanged() -> None:
    """name_map={} gives the unmapped plan's messages, plus the checks."""
    w = [Weight("a", (8, 4), "float32", {"tp": Shard(0)}), Weight("b", (4,), "float32")]
    r = [Weight("a", (8, 4), "float32", {"tp": Shard(1)}), Weight("b", (4,), "float32")]
    src, dst = Layout(tp=2), Layout(tp=4, rank_offset=2)
    plain = plan_transfer(src, w, dst, r, T2)
    mapped = plan_transfer(src, w, dst, r, T2, name_map={})
    assert list(plain.messages) == list(mapped.messages) and plain.mapping is None
    assert mapped.mapping is not None and mapped.mapping.fused() == []


# ------------------------------------------------------------------ errors, before anything moves
SRC, DST = Layout(tp=2), Layout(tp=2, rank_offset=2)
T = [Weight("q", (4, 2)), Weight("k", (2, 2)), Weight("emb", (6, 2))]


@pytest.mark.parametrize(
    ("rollout", "nm", "kw", "match"),
    [
        (
            [Weight("qk", (6, 2)), Weight("emb", (6, 2))],
            {"qk": ["q", "kk"]},
            {},
            "reads trainer weight 'kk'.*close: k",
        ),
        (
            [Weight("qk", (6, 2)), Weight("x", (6, 2))],
            {"qk": ["q", "k"]},
            {},
            "'x' has no rule.*nothing would write it",
        ),
        (
            [Weight("qk", (7, 2)), Weight("emb", (6, 2))],
            {"qk": ["q", "k"]},
            {},
            "tile axis 0 of 7 exactly.*q\\[0:4\\] \\+ k\\[0:2\\] = 6",
        ),
        (
            [Weight("qk", (6, 3)), Weight("emb", (6, 2))],
            {"qk": ["q", "k"]},
            {},
            "must match it on every axis but 0",
        ),
        (
            [Weight("qk", (6, 2)), Weight("emb", (6, 2))],
            {"qk": ["q", ["k", 0, 3]]},
            {},
            "outside its axis 0 of 2",
        ),
        ([Weight("qk", (6, 2))], {"qk": ["q", "k"]}, {}, "no rollout weight reads: emb.*allow_unused"),
        ([Weight("q", (4, 2)), Weight("emb", (6, 2))], {}, {}, r"no rollout weight reads: k\b"),
        (
            [Weight("q1", (2, 2)), Weight("k", (2, 2)), Weight("emb", (6, 2))],
            {"q1": {"source": "q", "stop": 2}},
            {},
            r"q\[axis 0: 2:4\]",
        ),
        (
            [Weight("q", (4, 2), "bfloat16"), Weight("k", (2, 2)), Weight("emb", (6, 2))],
            {},
            {},
            "'q' is bfloat16 but trainer weight 'q' is float32.*cast='bfloat16'",
        ),
        (
            [Weight("q", (4, 2), "bfloat16"), Weight("k", (2, 2)), Weight("emb", (6, 2))],
            {},
            {"cast": "float16"},
            "cast='float16' names float16",
        ),
        (
            [Weight("emb", (4, 2)), Weight("q", (4, 2)), Weight("k", (2, 2))],
            {},
            {},
            "'emb' \\(4, 2\\) is trainer weight 'emb' \\(6, 2\\)",
        ),
    ],
)
def test_coverage_and_cast_errors(rollout: list[Weight], nm: dict, kw: dict, match: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(LayoutError, match=match):
        plan_transfer(SRC, T, DST, rollout, name_map=nm, **kw)


def test_allow_unused_lists_them() -> None:
    plan = plan_transfer(SRC, T, DST, [Weight("q", (4, 2))], name_map={}, allow_unused=["k", "e*"])
    assert plan.mapping is not None and plan.mapping.unused == ("k", "emb")
    with pytest.raises(LayoutError, match="reads: emb"):
        plan_transfer(SRC, T, DST, [Weight("q", (4, 2))], name_map={}, allow_unused=["k"])


def test_cast_per_weight_pattern() -> None:
    r = [Weight("q", (4, 2), "bfloat16"), Weight("k", (2, 2), "float16"), Weight("emb", (6, 2))]
    plan = plan_transfer(SRC, T, DST, r, cast={"q": "bfloat16", "*": "float16"})
    assert plan.mapping is not None
    assert [(ln.name, ln.wire_dtype, ln.cast) for ln in plan.mapping.links.values()] == [
        ("q", "bfloat16", True),
        ("k", "float16", True),
        ("emb", "float32", False),
    ]


@pytest.mark.parametrize(
    "module",
    ["names", "mapped", "expand", "conventions", "presets", "families", "families_megatron", "stacking"],
)
def test_docstring_examples(module: str) -> None:
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(f"meshgroups.transfer._names.{module}"))
    assert result.attempted > 0 and result.failed == 0


def test_name_map_forms_round_trip(tmp_path: object) -> None:
    import pathlib

    nm = NameMap(
        {
            "qkv": ["q", "k", "v"],
            "head": "emb",
            "half": {"source": "w", "start": 2, "stop": 4, "axis": 1},
            "mix": {"segments": [["a", 0, 2], "b", {"source": "a", "start": 2}], "sharding": "whole"},
            "cols": {"parts": ["x", ["y", ["z", 1, 3]]], "axis": 1},
        }
    )
    assert nm.rule("half").segments[0].stop == 4 and nm.rule("half").axis == 1
    assert nm.rule("mix").sources == ("a", "b") and nm.rule("mix").sharding == "whole"
    assert [len(p) for p in nm.rule("cols").parts] == [1, 2]
    path = pathlib.Path(str(tmp_path)) / "map.json"
    nm.save(path)
    assert NameMap.load(path) == nm and NameMap.loads(nm.dumps()).to_dict() == nm.to_dict()
    assert (nm | {"head": "lm"}).rule("head").sources == ("lm",)


@pytest.mark.parametrize(
    ("rules", "error", "match"),
    [
        ({"a": 3}, TypeError, "rollout weight 'a': a rule is a name"),
        ({"a": {"parts": ["x"], "segments": ["y"]}}, LayoutError, "exactly one of 'parts' or 'segments'"),
        ({"a": {"parts": ["x"], "sharding": "rows"}}, LayoutError, "sharding must be one of"),
        ({"a": {"source": "x", "start": 3, "stop": 3}}, LayoutError, r"\[3, 3\) must have 0 <= start < stop"),
        ({"a": {"parts": []}}, LayoutError, "at least one part"),
        ({"a": {"parts": ["x"], "axis": -1}}, LayoutError, "axis must be an int >= 0"),
    ],
)
def test_bad_rules_name_the_weight(rules: dict, error: type, match: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(error, match=match):
        NameMap(rules)
