"""Every notebook runs top to bottom headless under at least two parameter sets (papermill-style:
a cell injected after the ``parameters`` cell), and every plotting cell shows a figure.

The harness retries a kernel start that lost jupyter_client's port race and fails fast when the
kernel dies; the live widget is unit-tested here instead of in a browser.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).parent.parent / "notebooks"
PARAMETER_SETS = {
    "explore_layouts.ipynb": [
        {},
        {"sizes": {"pp": 4, "dp": 4, "cp": 2, "tp": 8}, "rank": 200, "ranks_per_node": 8, "color_by": "cp"},
        {"sizes": {"pp": 3, "dp": 2, "cp": 1, "tp": 2}, "rank": 7, "ranks_per_node": 4, "color_by": "dp"},
    ],
    "legacy_to_mesh.ipynb": [{}, {"world_size": 64, "rank": 37, "tensor_parallel_size": 8}],
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
    ],
}
CASES = [(name, i) for name, sets in PARAMETER_SETS.items() for i in range(len(sets))]


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
            timeout=120,
            startup_timeout=60,
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


@pytest.mark.parametrize(("name", "index"), CASES, ids=[f"{n}-{i}" for n, i in CASES])
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
        assert cell.source.count("display(") == len(images)  # one picture per display call
    text = "".join(o.get("text", "") for c in executed for o in c.outputs)
    assert "AssertionError" not in text and "<Figure size" not in text


def test_every_notebook_is_tested():
    assert {p.name for p in NOTEBOOKS.glob("*.ipynb")} == set(PARAMETER_SETS)
    assert all(os.path.getsize(NOTEBOOKS / n) > 0 for n in PARAMETER_SETS)


def test_layout_explorer_widget_reacts_to_its_controls():
    from meshgroups.widgets import layout_explorer

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
