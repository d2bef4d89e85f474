"""Every notebook runs top to bottom headless; the live widget is unit-tested here instead."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes(path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("JUPYTER_PREFER_ENV_PATH", "1")  # the venv's python3 kernel, not a user one
    monkeypatch.setenv("MPLBACKEND", "Agg")
    book = nbformat.read(path, as_version=4)
    assert all(not cell.get("outputs") for cell in book.cells if cell.cell_type == "code"), (
        "commit without outputs"
    )
    client = NotebookClient(
        book,
        kernel_name="python3",
        timeout=120,
        startup_timeout=120,
        resources={"metadata": {"path": str(path.parent)}},
        skip_cells_with_tag="skip-execution",
        shutdown_kernel="immediate",
    )
    client.execute()  # raises CellExecutionError on any failing cell
    executed = [
        c for c in book.cells if c.cell_type == "code" and "skip-execution" not in c.metadata.get("tags", [])
    ]
    assert all(c.get("execution_count") for c in executed)


def test_notebooks_exist():
    assert {p.name for p in NOTEBOOKS} >= {"explore_layouts.ipynb", "legacy_to_mesh.ipynb"}
    assert os.path.getsize(NOTEBOOKS[0]) > 0


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
