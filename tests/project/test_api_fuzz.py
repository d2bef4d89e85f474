"""Hostile input to every public entry point that runs without processes: only TypeError or
ValueError (meshgroups' typed errors subclass them) may come out — never OverflowError,
AttributeError, StopIteration, RecursionError, MemoryError, KeyError, a hang or a traceback.

Each area calls every entry point with one argument replaced by each hostile value (the others
valid) and collects every escape, so a failure lists them all; the command line's hostile input
is in ``test_cli_fuzz.py``. Numbers that are plain nonsense (string ranks, ``1_000``, a repeated
level) must be refused, not merely survive.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshgroups import Layout, LayoutError, Topology
from meshgroups._checks import short_repr
from meshgroups.layout._order import megatron_order
from meshgroups.render import _formats as render


def _deep(depth: int) -> list:
    value: list = [0]
    for _ in range(depth):
        value = [value]
    return value


def _deep_views(depth: int) -> dict:
    data = {"format": "meshgroups.Layout/1", "dims": [["a", 2]]}
    for _ in range(depth):
        data = {"format": "meshgroups.Layout/1", "dims": [["a", 2]], "views": {"v": data}}
    return data


# Fresh values per call: iterators are consumed.
HOSTILE: list[Callable[[], object]] = [
    lambda: None,
    lambda: True,
    lambda: 1.9,
    lambda: math.nan,
    lambda: math.inf,
    lambda: -1,
    lambda: 0,
    lambda: 2**31,
    lambda: 2**63,
    lambda: 2**64,
    lambda: -(2**63),
    lambda: "",
    lambda: "x",
    lambda: "٣",
    lambda: "node=8",
    lambda: b"2",
    lambda: [],
    lambda: [[]],
    lambda: [-1],
    lambda: [2**64],
    lambda: ["0", "1"],
    lambda: [0.0, 1.0],
    lambda: {},
    lambda: {"a": 1},
    lambda: object(),
    lambda: np.array([1.5]),
    lambda: np.array([0, 1], dtype=object),
    lambda: np.zeros((0, 2), dtype=np.int64),
    lambda: itertools.count(),
    lambda: itertools.repeat(0),
    lambda: _deep(5000),
    lambda: _deep_views(5000),
]


def _escapes(call: Callable[[object], object], label: str) -> list[str]:
    """Every hostile value that makes ``call`` raise something other than TypeError/ValueError."""
    out = []
    for make in HOSTILE:
        value = make()
        try:
            call(value)
        except (TypeError, ValueError):
            pass
        except BaseException as exc:  # the point: nothing else may escape
            out.append(
                f"{label}({type(value).__name__} {short_repr(value)}): {type(exc).__name__}: {exc}"[:300]
            )
    return out


LAY = Layout(pp=2, dp=2, tp=2)
TOPO = Topology(node=4)

CORE: dict[str, Callable[[object], object]] = {
    "Layout(size)": lambda v: Layout(dp=v),
    "Layout(dims)": lambda v: Layout(v),
    "Layout(pairs)": lambda v: Layout([("dp", v)]),
    "Layout(name)": lambda v: Layout([(v, 2)]),
    "Layout(rank_offset)": lambda v: Layout(dp=2, rank_offset=v),
    "Layout(world_size)": lambda v: Layout(dp=-1, tp=2, world_size=v),
    "from_strides(names)": lambda v: Layout.from_strides(v, (2,), (1,)),
    "from_strides(shape)": lambda v: Layout.from_strides(("a",), v, (1,)),
    "from_strides(strides)": lambda v: Layout.from_strides(("a",), (2,), v),
    "from_strides(offset)": lambda v: Layout.from_strides(("a",), (2,), (1,), v),
    "from_grid(grid)": lambda v: Layout.from_grid(v, ("a",)),
    "from_grid(names)": lambda v: Layout.from_grid([0, 1], v),
    "from_order(order)": lambda v: Layout.from_order(v, tp=2, dp=2),
    "from_order(size)": lambda v: Layout.from_order("tp-dp", tp=v, dp=2),
    "from_dict": lambda v: Layout.from_dict(v),
    "from_dict(dims)": lambda v: Layout.from_dict({"format": "meshgroups.Layout/1", "dims": v}),
    "from_dict(grid)": lambda v: Layout.from_dict(
        {"format": "meshgroups.Layout/1", "dims": [["a", 2]], "grid": v}
    ),
    "from_dict(views)": lambda v: Layout.from_dict(
        {"format": "meshgroups.Layout/1", "dims": [["a", 2]], "views": v}
    ),
    "infer": lambda v: Layout.infer(v),
    "infer(family)": lambda v: Layout.infer({"tp": v}),
    "infer(group)": lambda v: Layout.infer({"tp": [v]}),
    "place(sizes)": lambda v: Layout.place(v, TOPO),
    "place(size)": lambda v: Layout.place({"dp": v}, TOPO),
    "place(topology)": lambda v: Layout.place({"dp": 2}, v),
    "place(fast_first)": lambda v: Layout.place({"dp": 2}, TOPO, fast_first=v),
    "place(require)": lambda v: Layout.place({"dp": 2}, TOPO, require=v),
    "place(require level)": lambda v: Layout.place({"dp": 2}, TOPO, require={"dp": v}),
    "groups": lambda v: LAY.groups(v),
    "group_of(rank)": lambda v: LAY.group_of(v, "tp"),
    "group_of(dim)": lambda v: LAY.group_of(0, v),
    "coords": lambda v: LAY.coords(v),
    "rank_at": lambda v: LAY.rank_at(pp=0, dp=0, tp=v),
    "size": lambda v: LAY.size(v),
    "contains": lambda v: v in LAY,
    "eq": lambda v: LAY == v,
    "grid_as": lambda v: LAY.grid_as(v),
    "flatten(dim)": lambda v: LAY.flatten(v, "tp"),
    "flatten(name)": lambda v: LAY.flatten("dp", "tp", name=v),
    "split(dim)": lambda v: LAY.split(v, a=1, b=2),
    "split(size)": lambda v: LAY.split("tp", a=v, b=2),
    "select(dim)": lambda v: LAY.select(v, 0),
    "select(indices)": lambda v: LAY.select("pp", v),
    "with_views": lambda v: LAY.with_views(e=v),
    "resolve": lambda v: LAY.resolve(v),
    "span(dim)": lambda v: LAY.span(v, topology=TOPO),
    "span(topology)": lambda v: LAY.span("tp", topology=v),
    "node_locality(dim)": lambda v: LAY.node_locality(v, ranks_per_node=4),
    "node_locality(per_node)": lambda v: LAY.node_locality("tp", ranks_per_node=v),
    "split_by_node(dim)": lambda v: LAY.split_by_node(v, 2),
    "split_by_node(per_node)": lambda v: LAY.split_by_node("dp", v),
    "Topology(size)": lambda v: Topology(node=v),
    "Topology(levels)": lambda v: Topology(**{"node": 4, "rack": v}),
    "Topology.parse": lambda v: Topology.parse(v),
    "Topology.span": lambda v: TOPO.span(v),
    "Topology.crossings": lambda v: TOPO.crossings(v),
    "Topology.size": lambda v: TOPO.size(v),
    "megatron_order": lambda v: megatron_order(v),
}

RENDER: dict[str, Callable[[object], object]] = {
    "text(layout)": lambda v: render.text(v),
    "text(ranks_per_node)": lambda v: render.text(LAY, ranks_per_node=v),
    "text(max_groups)": lambda v: render.text(LAY, max_groups=v),
    "text(max_grid)": lambda v: render.text(LAY, max_grid=v),
    "text(max_members)": lambda v: render.text(LAY, max_members=v),
    "html(layout)": lambda v: render.html(v),
    "html(color_by)": lambda v: render.html(LAY, v),
    "html(highlight_rank)": lambda v: render.html(LAY, highlight_rank=v),
    "html(ranks_per_node)": lambda v: render.html(LAY, ranks_per_node=v),
    "html(max_cells)": lambda v: render.html(LAY, max_cells=v),
    "span_table(layout)": lambda v: render.span_table(v, TOPO),
    "span_table(topology)": lambda v: render.span_table(LAY, v),
    "span_table(dims)": lambda v: render.span_table(LAY, TOPO, v),
    "short_list(ranks)": lambda v: render.short_list(v),
    "short_list(limit)": lambda v: render.short_list([0, 1, 2], v),
    "group_ids(layout)": lambda v: render.group_ids(v, "tp"),
    "group_ids(dim)": lambda v: render.group_ids(LAY, v),
}


def test_widget_entry_points_raise_only_type_or_value_errors():
    from meshgroups.render import _widgets as widgets

    sizes = {"pp": 2, "cp": 1, "tp": 2}
    calls = {
        "explore(world)": lambda v: widgets.explore(v, sizes, "", "tp", 0, 4),
        "explore(sizes)": lambda v: widgets.explore(8, v, "", "tp", 0, 4),
        "explore(size)": lambda v: widgets.explore(8, {**sizes, "tp": v}, "", "tp", 0, 4),
        "explore(order)": lambda v: widgets.explore(8, sizes, v, "tp", 0, 4),
        "explore(color_by)": lambda v: widgets.explore(8, sizes, "", v, 0, 4),
        "explore(rank)": lambda v: widgets.explore(8, sizes, "", "tp", v, 4),
        "explore(ranks_per_node)": lambda v: widgets.explore(8, sizes, "", "tp", 0, v),
    }
    escapes = [e for label, call in calls.items() for e in _escapes(call, label)]
    assert not escapes, "\n".join(escapes)


def test_core_entry_points_raise_only_type_or_value_errors():
    escapes = [e for label, call in CORE.items() for e in _escapes(call, label)]
    assert not escapes, "\n".join(escapes)


def test_render_entry_points_raise_only_type_or_value_errors():
    escapes = [e for label, call in RENDER.items() for e in _escapes(call, label)]
    assert not escapes, "\n".join(escapes)


def test_plot_arguments_raise_only_type_or_value_errors():
    pytest.importorskip("matplotlib")
    calls = {
        "plot(layout)": lambda v: render.plot(v),
        "plot(color_by)": lambda v: render.plot(LAY, v),
        "plot(ranks_per_node)": lambda v: render.plot(LAY, ranks_per_node=v),
        "plot(highlight_rank)": lambda v: render.plot(LAY, highlight_rank=v),
        "plot(max_cells)": lambda v: render.plot(LAY, max_cells=v),
        "plot(ax)": lambda v: render.plot(LAY, ax=v),
    }
    escapes = [e for label, call in calls.items() for e in _escapes(call, label)]
    assert not escapes, "\n".join(escapes)


def test_compat_constructors_raise_only_type_or_value_errors():
    gi = pytest.importorskip("meshgroups.compat.group_initializer")
    calls = {
        "set_group_strategy": lambda v: gi.set_group_strategy(v),
        "TrainDP(rank)": lambda v: gi.TrainDPGroupInitializer(v, 4, [0, 1]),
        "TrainDP(world)": lambda v: gi.TrainDPGroupInitializer(0, v, [0, 1]),
        "TrainDP(ranks)": lambda v: gi.TrainDPGroupInitializer(0, 4, v),
        "IntraNode(ranks)": lambda v: gi.IntraNodeGroupInitializer(0, 4, v),
        "WeightTransfer(ranks)": lambda v: gi.WeightTransferGroupInitializer(0, 4, v),
        "DP(size)": lambda v: gi.DPGroupInitializer(0, 4, v),
        "DP(world)": lambda v: gi.DPGroupInitializer(0, v, 2),
        "TP(size)": lambda v: gi.TPGroupInitializer(0, 4, v),
        "SP(size)": lambda v: gi.SPGroupInitializer(0, 4, v),
        "InterNode(size)": lambda v: gi.InterNodeGroupInitializer(0, 4, v),
    }
    escapes = [e for label, call in calls.items() for e in _escapes(call, label)]
    assert not escapes, "\n".join(escapes)


@pytest.mark.parametrize(
    "call",
    [
        lambda: Layout.infer({"tp": [["0", "1"]]}),  # string ranks
        lambda: Layout.infer({"tp": [[0.0, 1.9]]}),  # float ranks (1.9 is no rank 1)
        lambda: Layout.infer({"tp": [[0, 2**64]]}),
        lambda: Topology.parse("node=8,node=16"),
        lambda: Topology.parse("node=1_000"),
        lambda: Topology.parse("node=٣"),
        lambda: Topology(node=4).span([]),
        lambda: Topology(node=4).span(-1),
        lambda: Topology(node=4).span(2**63),
        lambda: Layout(**{f"d{i}": 1 for i in range(65)}),
        lambda: Layout.from_dict(
            {"format": "meshgroups.Layout/1", "dims": [[f"d{i}", 1] for i in range(8000)]}
        ),
        lambda: Layout.infer({f"f{i}": [[0], [1]] for i in range(2000)}),
        lambda: Layout.from_dict(_deep_views(5000)),
        lambda: LAY.select("pp", itertools.count()),
        lambda: LAY.select("pp", itertools.repeat(0)),
        lambda: render.span_table(LAY, "node=8"),  # type: ignore[arg-type]
        lambda: render.text(None),  # type: ignore[arg-type]
    ],
)
def test_nonsense_is_refused(call):
    with pytest.raises((TypeError, ValueError)):
        call()


def test_nonsense_messages_name_the_rule():
    with pytest.raises(LayoutError, match="65 dim names given; a layout has at most 64 dims"):
        Layout(**{f"d{i}": 1 for i in range(65)})
    with pytest.raises(LayoutError, match="'dims' lists 8000 dims; a layout has at most 64"):
        Layout.from_dict({"format": "meshgroups.Layout/1", "dims": [[f"d{i}", 1] for i in range(8000)]})
    with pytest.raises(LayoutError, match="level 'node' is given twice"):
        Topology.parse("node=8,node=16")
    with pytest.raises(LayoutError, match="view 'v' has views of its own"):
        Layout.from_dict(_deep_views(5000))
    with pytest.raises(TypeError, match="dtype float64"):
        Layout.infer({"tp": [[0.0, 1.9]]})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(sorted(CORE)),
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=12),
        st.binary(max_size=4),
        st.lists(st.integers(min_value=-(2**65), max_value=2**65), max_size=6),
        st.lists(st.lists(st.integers(min_value=-4, max_value=2**33), max_size=3), max_size=3),
        st.dictionaries(st.text(max_size=4), st.integers(min_value=-4, max_value=9), max_size=3),
    ),
)
def test_core_entry_points_with_random_values(label, value):
    try:
        CORE[label](value)
    except (TypeError, ValueError):
        pass
