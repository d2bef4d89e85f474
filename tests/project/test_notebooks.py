"""Every notebook runs top to bottom headless under several parameter sets (papermill-style: a
cell injected after the ``parameters`` cell) — the defaults, bigger worlds, worlds that are not a
whole number of nodes, one-dim layouts, the largest world the drawing window holds and random sets
(random dim names and sizes included) — and every plotting cell shows a figure of readable width.

The harness retries a kernel start that lost jupyter_client's port race and fails fast when the
kernel dies; the live widget is unit-tested here instead of in a browser.
"""

from __future__ import annotations

import base64
import keyword
import math
import os
import random
import string
import time
from pathlib import Path

import pytest
from meshgroups.compat.megatron_layout import megatron_plan

from meshgroups import Layout

from ..support.timing import scaled

NOTEBOOKS = Path(__file__).parents[2] / "notebooks"
# Random parameter sets are drawn from this seed (set MESHGROUPS_NOTEBOOK_SEED to draw others);
# the test id shows each set, so a failure can be rerun as it was.
RNG = random.Random(int(os.environ.get("MESHGROUPS_NOTEBOOK_SEED", "2026")))
LARGEST = 1024  # render's drawing window (max_cells): the largest world drawn whole


def _random_names(n: int) -> list[str]:
    names: list[str] = []
    while len(names) < n:
        name = "".join(RNG.choice(string.ascii_lowercase + "_") for _ in range(RNG.randint(1, 7)))
        if name.isidentifier() and not keyword.iskeyword(name) and name not in names:
            names.append(name)
    return names


def _random_layout_params() -> dict:
    names = _random_names(RNG.randint(2, 4))
    sizes = {n: RNG.randint(1, 5) for n in names}
    world = math.prod(sizes.values())
    color_by = RNG.choice([names[0], names[-1], tuple(RNG.sample(names, min(2, len(names))))])
    return {
        "sizes": sizes,
        "rank": RNG.randint(-world, 3 * world),
        "ranks_per_node": RNG.randint(1, 9),
        "color_by": color_by,
    }


def _random_legacy_params() -> dict:
    tp = RNG.choice([1, 2, 3, 4, 8])
    world = tp * RNG.randint(1, 12)
    return {
        "world_size": world,
        "rank": RNG.randint(0, 999),
        "tensor_parallel_size": tp,
        "ranks_per_node": RNG.randint(1, 9),
    }


def _random_megatron_params() -> dict:
    tp, pp, cp, etp = RNG.choice([1, 2, 4]), RNG.choice([1, 2, 3]), RNG.choice([1, 2]), RNG.choice([1, 2])
    ep = RNG.choice([1, 2, 4])
    dp = RNG.randint(1, 4) * ep * etp  # the expert side (ep×etp) divides the dense dp×cp×tp ranks
    return {
        "world_size": tp * pp * cp * dp,
        "tp": tp,
        "pp": pp,
        "cp": cp,
        "ep": ep,
        "etp": etp,
        "order": "tp-cp-ep-dp-pp",
        "alt_order": RNG.choice(["tp-cp-ep-pp-dp", "tp-pp-cp-ep-dp", "tp-cp-dp-ep-pp"]),
        "ranks_per_node": RNG.randint(1, 9),
        "rank": RNG.randint(-50, 5000),
    }


PARAMETER_SETS = {
    "explore_layouts.ipynb": [
        {},
        {"sizes": {"pp": 4, "dp": 4, "cp": 2, "tp": 8}, "rank": 200, "ranks_per_node": 8, "color_by": "cp"},
        # the cases: no cp dim, 9 ranks on nodes of 4 (a partial last node), an unknown color_by
        {"sizes": {"dp": 3, "tp": 3}, "rank": -1, "ranks_per_node": 4, "color_by": "xx"},
        _random_layout_params(),
        {"sizes": {"ranks": LARGEST}, "rank": 1000, "ranks_per_node": 8, "color_by": "ranks"},  # one dim
        # the cost view's knobs: a pipeline of an MoE model, recomputation, eager attention,
        # Megatron's dtypes, a reserved-memory verdict
        {
            "sizes": {"pp": 2, "dp": 2, "tp": 2},
            "cost_model": "tiny-moe",
            "recompute": "op",
            "attention": "eager",
            "precision": "megatron",
            "micro_batches": 2,
            "allocator_overhead": 1.2,
            "budget_mib": 2.0,
        },
    ],
    "legacy_to_mesh.ipynb": [
        {},
        {"world_size": 12, "rank": -1, "tensor_parallel_size": 3, "ranks_per_node": 8},  # partial node
        _random_legacy_params(),
        {"world_size": LARGEST, "rank": 777, "tensor_parallel_size": 1, "ranks_per_node": 8},
    ],
    "megatron_layouts.ipynb": [
        {},
        {
            "world_size": 64,
            "tp": 4,
            "pp": 2,
            "cp": 2,
            "ep": 4,
            "etp": 1,
            "rank": 37,
            "alt_order": "tp-pp-cp-ep-dp",
        },
        _random_megatron_params(),
        # the largest world, one dim of size > 1 (dp), on a partial last node of 48
        {
            "world_size": LARGEST,
            "tp": 1,
            "pp": 1,
            "cp": 1,
            "ep": 1,
            "etp": 1,
            "ranks_per_node": 48,
            "rank": 999,
        },
    ],
    "elastic.ipynb": [
        {},
        # HSDP x TP on nodes of 4: the replicate dim is dp_replicate; a lost rank takes its node
        {
            "sizes": {"pp": 2, "dp_replicate": 3, "dp_shard": 2, "tp": 4},
            "lost": [9],
            "ranks_per_node": 4,
            "rank": 40,
        },
        # substitute a spare node for the lost one
        {"lost": [13], "spares": list(range(64, 72)), "rank": 69},
        # every replica hit (the notebook substitutes fresh ranks), ranks failing alone, no dp-like name
        {"sizes": {"a": 2, "b": 3}, "lost": [0, 3, -1], "ranks_per_node": 0, "rank": 4},
    ],
    "weight_transfer.ipynb": [
        {},
        {
            "src": {"dp": 2, "tp": 4},
            "dst": {"tp": 2, "dp": 4},
            "dst_offset": 0,
            "ranks_per_node": 4,
            "rank": 3,
        },
        # 128 ranks on nodes of 6 (partial nodes), an out-of-range rank
        {
            "src": {"pp": 4, "dp": 2, "tp": 8},
            "dst": {"dp": 4, "tp": 4},
            "dst_offset": 64,
            "ranks_per_node": 6,
            "rank": -1,
        },
        # Megatron names (trainer tp=2) into Hugging Face names, fp8 on the wire
        {
            "src": {"dp_shard": 2, "tp": 2},
            "dst": {"tp": 4},
            "dst_offset": 4,
            "name_map": "megatron-to-hf",
            "cast": "float8_e4m3fn",
        },
    ],
}
CASES = [(name, i) for name, sets in PARAMETER_SETS.items() for i in range(len(sets))]
IDS = [f"{n.removesuffix('.ipynb')}-{i}-{PARAMETER_SETS[n][i] or 'defaults'}" for n, i in CASES]
MAX_WIDTH_PX = 1700  # the widest grid render.plot draws (16 in at the inline backend's 100 dpi) + labels


def _inject(book, overrides):
    import nbformat

    if not overrides:
        return book
    index = next(i for i, c in enumerate(book.cells) if "parameters" in c.metadata.get("tags", []))
    source = "# injected parameters\n" + "\n".join(f"{k} = {v!r}" for k, v in overrides.items())
    book.cells.insert(
        index + 1, nbformat.v4.new_code_cell(source, metadata={"tags": ["injected-parameters"]})
    )
    return book


def _execute(book, path, attempts=3):
    import zmq
    from nbclient import NotebookClient
    from nbclient.exceptions import DeadKernelError

    for attempt in range(attempts):
        client = NotebookClient(
            book,
            kernel_name="python3",
            timeout=int(scaled(120)),
            startup_timeout=int(scaled(60)),
            resources={"metadata": {"path": str(path.parent)}},
            skip_cells_with_tag="skip-execution",
            shutdown_kernel="immediate",
        )
        try:
            client.execute()  # raises CellExecutionError on any failing cell, DeadKernelError at once
            return book
        except (zmq.error.ZMQError, DeadKernelError, RuntimeError) as exc:
            # a kernel that could not bind its ports or died while starting: start a fresh one
            started = any(c.get("execution_count") for c in book.cells if c.cell_type == "code")
            if started or attempt == attempts - 1:
                raise
            print(f"kernel start failed ({type(exc).__name__}: {exc}); retrying")
            time.sleep(1)
    return book


@pytest.mark.processes
@pytest.mark.parametrize(("name", "index"), CASES, ids=IDS)
def test_notebook_runs_and_shows_its_figures(name, index, monkeypatch):
    import nbformat

    monkeypatch.setenv("JUPYTER_PREFER_ENV_PATH", "1")  # the venv's python3 kernel, not a user one
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the notebook's own %matplotlib inline decides
    path = NOTEBOOKS / name
    book = nbformat.read(path, as_version=4)
    assert all(not cell.get("outputs") for cell in book.cells if cell.cell_type == "code"), (
        "commit without outputs"
    )
    _execute(_inject(book, PARAMETER_SETS[name][index]), path)
    executed = [
        c for c in book.cells if c.cell_type == "code" and "skip-execution" not in c.metadata.get("tags", [])
    ]
    assert all(c.get("execution_count") for c in executed)
    plots = [c for c in executed if "plot" in c.metadata.get("tags", [])]
    assert plots, "every notebook draws something"
    for cell in plots:
        images = [o for o in cell.outputs if "image/png" in o.get("data", {})]
        assert images, f"plotting cell shows no figure: {cell.source[:80]!r}"
        assert len(images) <= cell.source.count("display("), "a figure shown twice"
        for image in images:
            width = _png_width(image["data"]["image/png"])
            assert width <= MAX_WIDTH_PX, f"a {width}-px-wide figure (title or labels wider than the grid)"
    text = "".join(o.get("text", "") for c in executed for o in c.outputs)
    if name == "explore_layouts.ipynb":  # issue 52: the grid's legend names every mark, rows their nodes
        pages = [o.get("data", {}).get("text/html", "") for c in executed for o in c.outputs]
        page = "".join("".join(p) if isinstance(p, list) else p for p in pages)
        assert "red outline: rank" in page and "bold: rank" in page and "<th>nodes</th>" in page
    assert "AssertionError" not in text and "<Figure size" not in text and "Traceback" not in text


def _png_width(data: str) -> int:
    png = base64.b64decode(data)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(png[16:20], "big")  # IHDR's width field


FIGURES = {
    "megatron 16, views in the repr": lambda: megatron_plan(16, 2, 2, expert_model_parallel_size=2).layout,
    "megatron 64": lambda: (
        megatron_plan(64, 4, 2, context_parallel_size=2, expert_model_parallel_size=4).layout
    ),
    "9 ranks": lambda: Layout(pp=1, dp=3, cp=1, tp=3),
    "one dim of 1024": lambda: Layout(ranks=1024),
    "long names": lambda: Layout(a_very_long_dim_name_indeed=2, another_quite_long_dim_name=3),
}


@pytest.mark.parametrize("make", FIGURES.values(), ids=FIGURES.keys())
def test_plot_keeps_title_and_labels_inside_the_figure(make):
    """What made megatron_layouts' figures 1,740 px wide: a title wider than the figure (the
    inline backend crops to everything drawn). Nothing drawn may stick out of the figure."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from meshgroups.render._formats import plot

    lay = make()
    for color_by in (lay.names[-1], lay.names[:2]):
        fig = plot(lay, color_by, ranks_per_node=8, highlight_rank=1)
        canvas = FigureCanvasAgg(fig)
        canvas.draw()
        drawn = fig.get_tightbbox(canvas.get_renderer())  # inches
        assert drawn.width <= fig.get_figwidth() + 0.05, (repr(lay), drawn.width, fig.get_figwidth())


def test_every_notebook_is_tested():
    assert {p.name for p in NOTEBOOKS.glob("*.ipynb")} == set(PARAMETER_SETS)
    assert all(os.path.getsize(NOTEBOOKS / n) > 0 for n in PARAMETER_SETS)


def test_layout_explorer_widget_reacts_to_its_controls():
    from meshgroups.render._widgets import layout_explorer

    box = layout_explorer(world=16, pp=2, cp=1, tp=4, ranks_per_node=8)
    assert "Layout(pp=2, dp=2, cp=1, tp=4)" in box.output.value
    box.controls["tp"].value = 2
    assert "Layout(pp=2, dp=4, cp=1, tp=2)" in box.output.value
    box.controls["rank"].value = 5
    assert "group of rank 5" in box.output.value and "[4, 5]" in box.output.value
    box.controls["order"].value = "tp-cp-pp-dp"
    assert "Layout(dp=4, pp=2, cp=1, tp=2)" in box.output.value
    box.controls["tp"].value = 3  # 2×1×3 does not divide 16
    assert "invalid layout" in box.output.value and "does not divide world=16" in box.output.value
    box.controls["world"].value = 12
    assert "invalid layout" not in box.output.value
    assert box.controls["rank"].max == 11
