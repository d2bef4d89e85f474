"""The costs shown: a text table of candidates, an HTML table for notebooks, and one layout's
full report as a JSON-ready dict::

    >>> from meshgroups.cost.model import preset
    >>> print(table(enumerate_layouts(preset("tiny"), 2), limit=1).splitlines()[0])
    layout  fits  memory/rank  slowest level  bytes there  world
"""

from __future__ import annotations

import html as html_mod
from collections.abc import Sequence

from meshgroups.layout import Layout, Topology

from .enumerate import Candidate
from .memory import peak_memory, rank_memory
from .model import Model
from .roles import Parallelism, bubble_fraction
from .traffic import traffic

__all__ = ["SORT_KEYS", "cost_report", "format_bytes", "html_table", "sort_candidates", "table"]

#: How :func:`sort_candidates` can order: bytes over the slowest level crossed, memory, label.
SORT_KEYS = ("slow", "memory", "layout")


def format_bytes(n: float) -> str:
    """``n`` bytes with a binary unit.

    Args:
        n: bytes.

    Returns:
        e.g. ``"1.50 GiB"``.

    >>> format_bytes(1.5 * 2**30), format_bytes(12)
    ('1.50 GiB', '12 B')
    """
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def sort_candidates(candidates: Sequence[Candidate], by: str = "slow") -> list[Candidate]:
    """``candidates`` ordered by ``by``: ``"slow"`` (bytes per level from the slowest, as
    enumerated), ``"memory"`` (peak bytes per rank) or ``"layout"`` (the label).

    Args:
        candidates: the candidates. by: a key of :data:`SORT_KEYS`.

    Returns:
        a new list.

    Raises:
        LayoutError: an unknown key.

    >>> [c.label() for c in sort_candidates(enumerate_layouts(preset("tiny"), 2), "layout")][:2]
    ['cp=2', 'dp_replicate=2']
    """
    from meshgroups import LayoutError

    keys = {
        "slow": lambda c: (c.traffic.order_key(), c.memory.total),
        "memory": lambda c: (c.memory.total, c.traffic.order_key()),
        "layout": lambda c: c.label(),
    }
    if by not in keys:
        raise LayoutError(f"sort by {by!r}? one of {', '.join(SORT_KEYS)}")
    return sorted(candidates, key=keys[by])


def _rows(candidates: Sequence[Candidate], limit: int | None) -> tuple[list[str], list[list[str]]]:
    levels = candidates[0].traffic.levels if candidates else ("world",)
    head = ["layout", "fits", "memory/rank", "slowest level", "bytes there", *levels]
    rows = [
        [
            c.label(),
            "yes" if c.fits else "no",
            format_bytes(c.memory.total),
            c.slowest_level or "-",
            format_bytes(c.slow_bytes),
            *(format_bytes(c.traffic.by_level[lv]) for lv in levels),
        ]
        for c in list(candidates)[:limit]
    ]
    return head, rows


def table(candidates: Sequence[Candidate], limit: int | None = None) -> str:
    """A text table of ``candidates`` in their order: sizes, fit, peak memory per rank, the
    slowest level crossed and the bytes there, the bytes on every level (all ranks, one step).

    Args:
        candidates: the candidates. limit: at most this many rows.

    Returns:
        the table.

    >>> print(table(enumerate_layouts(preset("tiny"), 2), limit=1).splitlines()[2])
    pp=2    yes   ...
    """
    head, rows = _rows(candidates, limit)
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in [head, *rows]]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def html_table(
    candidates: Sequence[Candidate], highlight: Layout | None = None, limit: int | None = None
) -> str:
    """An HTML version of :func:`table` (no pandas), the row of ``highlight`` in bold.

    Args:
        candidates: the candidates. highlight: a layout to mark. limit: at most this many rows.

    Returns:
        the HTML.

    >>> "<table" in html_table(enumerate_layouts(preset("tiny"), 2))
    True
    """
    head, rows = _rows(candidates, limit)
    out = ["<table>", "<tr>" + "".join(f"<th>{html_mod.escape(h)}</th>" for h in head) + "</tr>"]
    for c, row in zip(candidates, rows):
        style = (
            ' style="font-weight:bold;background:#ffe9a8"'
            if highlight is not None and c.layout == highlight
            else ""
        )
        out.append(f"<tr{style}>" + "".join(f"<td>{html_mod.escape(v)}</td>" for v in row) + "</tr>")
    return "\n".join([*out, "</table>"])


def cost_report(
    model: Model, layout: Layout, topology: Topology | None = None, plan: Parallelism | None = None
) -> dict[str, object]:
    """Everything the cost model says about one layout, as a JSON-ready dict: the role sizes,
    each pipeline stage's peak memory, the bubble fraction, every collective and the traffic
    per family and per level.

    Args:
        model: the model. layout: the layout. topology: the machine. plan: roles and dtypes.

    Returns:
        the dict.

    Raises:
        LayoutError: as :func:`meshgroups.cost.calls.collectives`.

    >>> cost_report(preset("tiny"), Layout(pp=2, dp_shard=4))["bubble_fraction"]
    0.5
    """
    plan = plan or Parallelism()
    sizes = plan.sizes(layout)
    dims = plan.dims(layout)
    t = traffic(model, layout, topology, plan)
    zero = {d: 0 for d in layout.names}
    stages = []
    for k in range(sizes["pp"]):
        rank = layout.rank_at(**{**zero, **({dims["pp"]: k} if "pp" in dims else {})})
        stages.append(rank_memory(model, layout, rank, plan).to_dict())
    return {
        "model": model.name or repr(model),
        "layout": repr(layout),
        "roles": dict(sizes),
        "topology": repr(topology) if topology is not None else None,
        "peak_memory": peak_memory(model, layout, plan).to_dict(),
        "stage_memory": stages,
        "bubble_fraction": bubble_fraction(sizes["pp"], plan.micro_batches, plan.virtual_stages),
        "collectives": [c.to_dict() for c in t.collectives],
        "traffic": t.to_dict(),
    }
