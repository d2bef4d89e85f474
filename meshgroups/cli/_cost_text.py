"""The text ``python -m meshgroups cost`` prints: one layout's report, and the header of the
``--world`` table (its order, and that it is not a step-time prediction)::

    >>> from meshgroups import Layout
    >>> from meshgroups.cost import Parallelism, cost_report, preset
    >>> report = cost_report(preset("tiny"), Layout(pp=2, dp=2), plan=Parallelism(roles={"dp": "dp_replicate"}))
    >>> print(text(report, {"dp": "dp_replicate"}).splitlines()[2])
    pipeline bubble: 0.500 of the step (a stage's idle share; not a step-time prediction)
"""

from __future__ import annotations

import argparse
from typing import Any

from meshgroups.cost import SORT_WORDS, format_bytes
from meshgroups.models import Model

__all__ = ["header", "text"]


def header(
    model: Model, args: argparse.Namespace, found: list[Any], budget: float | None, overhead: float
) -> str:
    """What the --world table is: how many layouts, which fit, its order, and what it is not
    (``found``: the candidates, ``budget``: bytes per rank or None)."""
    fits = sum(c.fits for c in found)
    basis = "allocated" if overhead == 1.0 else f"allocated × {overhead:g}"
    m = args.micro_batches
    return "\n".join(
        [
            f"{len(found)} layouts of {args.world} ranks admit {model.name or 'the model'}"
            + (f"; {fits} fit {args.budget_gib:g} GiB per rank ({basis})" if budget is not None else ""),
            f"ordered by {SORT_WORDS[args.sort]} (--sort); not a step-time prediction: compute, overlap "
            "and link speeds are not modelled",
            f"bubble: the share of a step a pipeline stage idles, (pp-1)/(m+pp-1) with m={m} micro-batches "
            "(--micro-batches); bytes are per step, all ranks",
            "",
        ]
    )


def text(report: dict[str, Any], roles: dict[str, str]) -> str:
    """One layout's report (:func:`meshgroups.cost.cost_report`) as text; ``roles``: the dims
    not named after the role they play."""
    peak = report["peak_memory"]
    parts = ", ".join(
        f"{k} {format_bytes(peak[k])}"
        for k in ("params", "grads", "master", "optimizer", "activations", "loss", "transient")
    )
    played = "".join(f"  ({dim} plays {role})" for dim, role in roles.items())
    lines = [
        f"{report['layout']}  model {report['model']}  {report['topology'] or 'no topology'}{played}",
        f"peak memory per rank: {format_bytes(peak['total'])} at the {peak['phase']} ({parts}; peak allocated)",
        f"pipeline bubble: {report['bubble_fraction']:.3f} of the step (a stage's idle share; not a "
        "step-time prediction)",
    ]
    verdict = report.get("fit")
    if verdict:
        lines.append(
            f"fits {format_bytes(verdict['budget'])} per rank: {'yes' if verdict['fits'] else 'no'} "
            f"({verdict['basis']}: {format_bytes(verdict['needed'])})"
        )
    fams = report["traffic"]["families"]
    levels = list(report["traffic"]["by_level"])
    lines.append("")
    head = ["family", "group size", "sent/rank", *levels]
    rows = [
        [
            f,
            str(d["group_size"]),
            format_bytes(d["sent_per_rank"]),
            *(format_bytes(d["by_level"][lv]) for lv in levels),
        ]
        for f, d in fams.items()
    ]
    rows.append(["all", "", "", *(format_bytes(report["traffic"]["by_level"][lv]) for lv in levels)])
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, *rows]:
        lines.append("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
    lines.append(
        f"slowest level crossed: {report['traffic']['slowest_level'] or 'none'} (bytes per step, all ranks)"
    )
    return "\n".join(lines)
