"""Interactive layout explorer for Jupyter (ipywidgets, an optional extra).

    from meshgroups.render._widgets import layout_explorer
    layout_explorer()          # sliders for world and dim sizes, order, dim and rank pickers

The returned box has ``.controls`` (name -> widget) and ``.output`` (the HTML widget it
redraws), so it can be driven and checked without a browser.
"""

from __future__ import annotations

import html as html_lib
from collections.abc import Mapping
from typing import Any

from meshgroups._checks import MAX_RANK, check_int, check_positive, check_size, short_repr
from meshgroups.errors import LayoutError
from meshgroups.layout import Layout
from meshgroups.render._formats import html


def explore(
    world: int, sizes: dict[str, int], order: str, color_by: str, rank: int, ranks_per_node: int
) -> tuple[Layout | None, str]:
    """The layout for these control values and the HTML that shows it (or the error). The values
    themselves must be of the right kind (``TypeError``/``LayoutError`` otherwise); a layout they
    cannot make is shown as the error, as a user moving sliders would see it."""
    _check_controls(world, sizes, order, color_by, rank, ranks_per_node)
    try:
        full = _with_dp(world, sizes)
        layout = Layout.from_order(order.strip(), **full) if order.strip() else Layout(**full)
    except (ValueError, TypeError) as exc:
        return None, f"<p style='color:#b00'>invalid layout: {html_lib.escape(str(exc))}</p>"
    dims = tuple(color_by.split("×"))
    if any(d not in layout.names for d in dims):
        dims = (layout.names[-1],)
    rank = min(rank, layout.max_rank)
    parts = [html(layout, dims, highlight_rank=rank, ranks_per_node=ranks_per_node)]
    rows = []
    for dim in layout.names:
        verdict = layout.node_locality(dim, ranks_per_node=ranks_per_node)
        rows.append(
            f"<tr><td>{dim}</td><td>{layout.group_of(rank, dim).tolist()}</td><td>{verdict}</td></tr>"
        )
    parts.append(
        f"<p>rank {rank}: {layout.coords(rank)}</p><table><tr><th>dim</th><th>group of rank {rank}</th>"
        f"<th>nodes ({ranks_per_node} ranks each)</th></tr>{''.join(rows)}</table>"
    )
    return layout, "".join(parts)


def _check_controls(
    world: object, sizes: object, order: object, color_by: object, rank: object, ranks_per_node: object
) -> None:
    check_positive(world, "world")
    if not isinstance(sizes, Mapping) or set(sizes) != {"pp", "cp", "tp"}:
        raise TypeError(f"sizes must map exactly pp, cp and tp to sizes, got {short_repr(sizes)}")
    for name, size in sizes.items():
        check_size(name, size)
    for value, what in ((order, "order"), (color_by, "color_by")):
        if not isinstance(value, str):
            raise TypeError(f"{what} must be a str, got {short_repr(value)}")
    if check_int(rank, "rank") < 0:
        raise LayoutError(f"rank={rank} must be >= 0")
    check_positive(ranks_per_node, "ranks_per_node", MAX_RANK + 1)


def _with_dp(world: int, sizes: dict[str, int]) -> dict[str, int]:
    fixed = sizes["pp"] * sizes["cp"] * sizes["tp"]
    if world % fixed:
        raise ValueError(f"pp×cp×tp = {fixed} does not divide world={world}")
    return {"pp": sizes["pp"], "dp": world // fixed, "cp": sizes["cp"], "tp": sizes["tp"]}


def layout_explorer(
    world: int = 32, pp: int = 2, cp: int = 1, tp: int = 4, order: str = "", ranks_per_node: int = 8
) -> Any:
    """An ipywidgets box: world and pp/cp/tp sliders (dp is inferred), an order string, a dim
    picker, a rank picker and ranks per node; shows the coloured grid, the rank's groups and
    their intra/inter-node verdicts.

    Args:
        world, pp, cp, tp: the sliders' starting values (dp is inferred).
        order: a Megatron order string (``"tp-cp-dp-pp"``), or ``""`` for row-major.
        ranks_per_node: the starting ranks per node.

    Returns:
        The ipywidgets box (``.controls``, ``.output``).

    >>> from meshgroups.render import layout_explorer
    >>> box = layout_explorer(world=8, pp=1, tp=2)  # a notebook cell's last line shows it
    >>> sorted(box.controls)
    ['color_by', 'cp', 'order', 'pp', 'rank', 'ranks_per_node', 'tp', 'world']
    """
    for value, what, high in ((world, "world", 256), (pp, "pp", 16), (cp, "cp", 16), (tp, "tp", 16)):
        check_positive(value, what, high)  # the sliders' ranges
    check_positive(ranks_per_node, "ranks_per_node", 64)
    if not isinstance(order, str):
        raise TypeError(f"order must be a str, got {short_repr(order)}")
    try:
        import ipywidgets as w
    except ImportError:  # pragma: no cover - depends on the environment
        raise ImportError("layout_explorer needs ipywidgets: pip install 'meshgroups[notebooks]'") from None
    controls = {
        "world": w.IntSlider(value=world, min=1, max=256, description="world"),
        "pp": w.IntSlider(value=pp, min=1, max=16, description="pp"),
        "cp": w.IntSlider(value=cp, min=1, max=16, description="cp"),
        "tp": w.IntSlider(value=tp, min=1, max=16, description="tp"),
        "order": w.Text(
            value=order, description="order", placeholder="e.g. tp-cp-dp-pp (empty: pp,dp,cp,tp)"
        ),
        "color_by": w.Dropdown(
            options=["tp", "cp", "dp", "pp", "dp×cp", "cp×tp", "pp×tp"], value="tp", description="colour by"
        ),
        "rank": w.IntSlider(value=0, min=0, max=max(world - 1, 0), description="rank"),
        "ranks_per_node": w.IntSlider(value=ranks_per_node, min=1, max=64, description="ranks/node"),
    }
    output = w.HTML()

    def redraw(_change: object = None) -> None:
        controls["rank"].max = max(controls["world"].value - 1, 0)
        _, output.value = explore(
            controls["world"].value,
            {k: controls[k].value for k in ("pp", "cp", "tp")},
            controls["order"].value,
            controls["color_by"].value,
            controls["rank"].value,
            controls["ranks_per_node"].value,
        )

    for control in controls.values():
        control.observe(redraw, names="value")
    redraw()
    box = w.VBox([w.HBox(list(controls.values())[:4]), w.HBox(list(controls.values())[4:]), output])
    box.controls = controls
    box.output = output
    return box


__all__ = [
    "explore",
    "layout_explorer",
]
