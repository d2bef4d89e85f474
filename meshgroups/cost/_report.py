"""The costs shown: a text table of candidates, an HTML table for notebooks, and one layout's
full report as a JSON-ready dict::

    >>> from meshgroups.cost._model import preset
    >>> print(table(enumerate_layouts(preset("tiny"), 2), limit=1).splitlines()[0])
    layout  fits  memory/rank  bubble  slowest level  bytes there  world
"""

from __future__ import annotations

import html as html_mod
from collections.abc import Sequence

from meshgroups.cost._enumerate import Candidate
from meshgroups.cost._model import Model
from meshgroups.cost._peak import RankMemory, fit, peak_memory, rank_memory
from meshgroups.cost._roles import Parallelism, bubble_fraction
from meshgroups.cost._traffic import traffic
from meshgroups.layout import Layout, Topology

__all__ = [
    "SORT_KEYS",
    "SORT_WORDS",
    "breakdown",
    "breakdown_html",
    "cost_report",
    "format_bytes",
    "html_table",
    "sort_candidates",
    "table",
]

#: The categories of a peak, in the order they are shown.
CATEGORIES = ("params", "grads", "master", "optimizer", "activations", "loss", "transient")

#: How :func:`sort_candidates` can order: bytes over the slowest level crossed, the pipeline
#: bubble (then those bytes), memory, label.
SORT_KEYS = ("slow", "bubble", "memory", "layout")
#: What each order is, in the words a table's header uses.
SORT_WORDS = {
    "slow": "bytes over the slowest level crossed, then the next level, then memory",
    "bubble": "pipeline bubble, then bytes over the slowest level crossed, then memory",
    "memory": "memory (the peak per rank), then bytes over the slowest level crossed",
    "layout": "the layout's sizes, as text",
}


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


def breakdown(memory: RankMemory, budget: float | None = None, allocator_overhead: float = 1.0) -> str:
    """A peak in words: the total, where it is, each category, and against ``budget`` the fit
    verdict with the basis it used (:func:`meshgroups.cost._peak.fit`).

    Args:
        memory: a rank's peak. budget: bytes per rank (``None``: no verdict).
        allocator_overhead: reserved/allocated assumed by the verdict.

    Returns:
        the text (two or three lines).

    >>> print(breakdown(RankMemory(0, 2**30, 0, 0, 2**31, 2**31, 2**30, 0, "loss backward"), 8 * 2**30, 1.2))
    peak 6.00 GiB per rank (rank 0, at the loss backward)
      params 1.00 GiB, grads 0 B, master 0 B, optimizer 2.00 GiB, activations 2.00 GiB, loss 1.00 GiB, transient 0 B
      fits 8.00 GiB: yes (reserved (allocated × 1.20): 7.20 GiB)
    """
    parts = ", ".join(f"{k} {format_bytes(getattr(memory, k))}" for k in CATEGORIES)
    lines = [
        f"peak {format_bytes(memory.total)} per rank (rank {memory.rank}, at the {memory.phase or 'step'})",
        f"  {parts}",
    ]
    if budget is not None:
        f = fit(memory, budget, allocator_overhead)
        lines.append(
            f"  fits {format_bytes(budget)}: {'yes' if f.fits else 'no'} ({f.basis}: {format_bytes(f.needed)})"
        )
    return "\n".join(lines)


def breakdown_html(memory: RankMemory, budget: float | None = None, allocator_overhead: float = 1.0) -> str:
    """:func:`breakdown` as an HTML bar and table (notebooks): each category's share of the
    peak, and the verdict.

    Args:
        memory, budget, allocator_overhead: as :func:`breakdown`.

    Returns:
        the HTML.

    >>> "transient" in breakdown_html(RankMemory(0, 1, 0, 0, 2, 3, 4, 5, "loss backward"))
    True
    """
    colours = dict(
        zip(CATEGORIES, ("#4c78a8", "#72b7b2", "#9ecae9", "#54a24b", "#f58518", "#e45756", "#b279a2"))
    )
    total = memory.total or 1
    bar = "".join(
        f'<div title="{k}" style="display:inline-block;height:14px;width:{100 * getattr(memory, k) / total:.2f}%;'
        f'background:{colours[k]}"></div>'
        for k in CATEGORIES
    )
    rows = "".join(
        f'<tr><td><span style="color:{colours[k]}">&#9632;</span> {k}</td><td>{format_bytes(getattr(memory, k))}</td></tr>'
        for k in CATEGORIES
    )
    head = html_mod.escape(breakdown(memory, budget, allocator_overhead).splitlines()[0])
    verdict = ""
    if budget is not None:
        verdict = f"<p>{html_mod.escape(breakdown(memory, budget, allocator_overhead).splitlines()[-1].strip())}</p>"
    return f'<p>{head}</p><div style="width:420px;border:1px solid #999">{bar}</div><table>{rows}</table>{verdict}'


def sort_candidates(candidates: Sequence[Candidate], by: str = "slow") -> list[Candidate]:
    """``candidates`` ordered by ``by``: ``"slow"`` (bytes per level from the slowest, as
    enumerated), ``"bubble"`` (the pipeline bubble, then as ``"slow"``), ``"memory"`` (peak bytes
    per rank) or ``"layout"`` (the label). None of them is a predicted step time.

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
        "bubble": lambda c: (c.bubble, c.traffic.order_key(), c.memory.total),
        "memory": lambda c: (c.memory.total, c.traffic.order_key()),
        "layout": lambda c: c.label(),
    }
    if by not in keys:
        raise LayoutError(f"sort by {by!r}? one of {', '.join(SORT_KEYS)}")
    return sorted(candidates, key=keys[by])


def _rows(candidates: Sequence[Candidate], limit: int | None) -> tuple[list[str], list[list[str]]]:
    levels = candidates[0].traffic.levels if candidates else ("world",)
    head = ["layout", "fits", "memory/rank", "bubble", "slowest level", "bytes there", *levels]
    rows = [
        [
            c.label(),
            "yes" if c.fits else "no",
            format_bytes(c.memory.total),
            f"{c.bubble:.0%}",
            c.slowest_level or "-",
            format_bytes(c.slow_bytes),
            *(format_bytes(c.traffic.by_level[lv]) for lv in levels),
        ]
        for c in list(candidates)[:limit]
    ]
    return head, rows


def table(candidates: Sequence[Candidate], limit: int | None = None) -> str:
    """A text table of ``candidates`` in their order: sizes, fit, peak memory per rank, the
    pipeline bubble (the share of a step a stage idles), the slowest level crossed and the bytes
    there, the bytes on every level (all ranks, one step).

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
    model: Model,
    layout: Layout,
    topology: Topology | None = None,
    plan: Parallelism | None = None,
    budget: float | None = None,
    allocator_overhead: float = 1.0,
) -> dict[str, object]:
    """Everything the cost model says about one layout, as a JSON-ready dict: the role sizes,
    the peak memory by category and each pipeline stage's, the fit verdict (with a budget),
    the bubble fraction, every collective and the traffic per family and per level.

    Args:
        model: the model. layout: the layout. topology: the machine. plan: roles and dtypes.
        budget: bytes per rank for the verdict (``None``: none). allocator_overhead:
            reserved/allocated assumed by it (:func:`meshgroups.cost._peak.fit`).

    Returns:
        the dict.

    Raises:
        LayoutError: as :func:`meshgroups.cost._calls.collectives`.

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
    peak = peak_memory(model, layout, plan)
    verdict = None
    if budget is not None:
        f = fit(peak, budget, allocator_overhead)
        verdict = {
            "fits": f.fits,
            "needed": f.needed,
            "budget": f.budget,
            "overhead": f.overhead,
            "basis": f.basis,
        }
    return {
        "model": model.name or repr(model),
        "layout": repr(layout),
        "roles": dict(sizes),
        "topology": repr(topology) if topology is not None else None,
        "peak_memory": peak.to_dict(),
        "fit": verdict,
        "stage_memory": stages,
        "bubble_fraction": bubble_fraction(sizes["pp"], plan.micro_batches, plan.virtual_stages),
        "collectives": [c.to_dict() for c in t.collectives],
        "traffic": t.to_dict(),
    }
