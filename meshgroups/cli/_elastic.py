"""``python -m meshgroups shrink`` / ``grow``: a recovery plan from the command line (numpy only,
no processes)::

    python -m meshgroups shrink pp=2 dp=4 tp=8 --lost 13,14 --node 8
    python -m meshgroups shrink pp=2 dp=4 tp=8 --lost 13 --spares 64-71 --node 8   # substitute
    python -m meshgroups grow --from-json plan.json --ranks 8-15,40-47 --node 8
    python -m meshgroups shrink pp=2 dp=4 cp=2 tp=4 --lost 5 --flatten dp,cp --rank 7 --json

The layout is ``name=size`` words, outermost first, as in every subcommand (the old ``--layout
pp=2,dp=4,tp=8`` still works, with a warning). Ranks are comma-separated numbers or ``a-b`` ranges. ``--from-json`` reads a layout dict
(``Layout.to_dict``) or a plan printed with ``--json`` (its new layout), so plans chain: a shrink,
then a grow of its result. Bad input exits with status 2, naming the rule.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from meshgroups._checks import formula
from meshgroups.cli._args import parse_dims, rank_arg
from meshgroups.cli._conventions import add_node, deprecated, node_of, print_json, topology_of
from meshgroups.elastic import RecoveryPlan, family_label, plan_grow, plan_shrink, plan_substitute
from meshgroups.layout import Layout, Topology

#: Without --full, the tables and JSON list at most this many groups per family.
SHOWN = 8
#: Largest rank list accepted on the command line (a range counts its ranks).
MAX_RANKS = 1 << 22


def rank_list(text: str) -> list[int]:
    """``"13,14"`` or ``"8-15,40-47"`` as a list of ranks, in the order written."""
    out: list[int] = []
    for word in text.replace(" ", "").split(","):
        if not word:
            continue
        low, sep, high = word.partition("-")
        if not low.isdigit() or (sep and not high.isdigit()):
            raise argparse.ArgumentTypeError(
                f"ranks are numbers or ranges a-b, comma separated; got {word!r}"
            )
        first, last = int(low), int(high) if sep else int(low)
        if last < first:
            raise argparse.ArgumentTypeError(f"range {word!r} runs backwards; write {last}-{first}")
        if len(out) + last - first + 1 > MAX_RANKS:
            raise argparse.ArgumentTypeError(f"more than {MAX_RANKS} ranks given")
        out.extend(range(first, last + 1))
    if not out:
        raise argparse.ArgumentTypeError(f"no ranks in {text!r}")
    return out


def dim_sets(text: str) -> list[tuple[str, ...]]:
    """``"dp,cp;pp,tp"`` as ``[("dp", "cp"), ("pp", "tp")]``."""
    return [tuple(w for w in part.split(",") if w) for part in text.split(";") if part.strip(", ")]


def _layout(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Layout:
    words = list(args.dims)
    if args.layout is not None:
        old = [w for w in args.layout.replace(" ", ",").split(",") if w]
        if not old:
            parser.error("--layout takes name=size words: pp=2 dp=4 tp=8 (dims as words, no --layout)")
        deprecated(f"--layout {args.layout}", " ".join(old) + " (dims as words, no --layout)")
        words += old
    if bool(words) == (args.from_json is not None):
        parser.error(
            "give the current layout as dims (pp=2 dp=4 tp=8) or with --from-json FILE (one of them)"
        )
    if args.from_json is not None:
        try:
            with open(args.from_json) as f:
                data = json.load(f)
        except (OSError, ValueError) as exc:
            parser.error(f"cannot read --from-json {args.from_json}: {exc}")
        if isinstance(data, dict) and isinstance(data.get("new_layout"), dict):
            data = data["new_layout"]  # a plan printed with --json: continue from its result
        try:
            return Layout.from_dict(data)
        except (ValueError, TypeError) as exc:
            parser.error(f"--from-json {args.from_json}: {exc}")
    try:
        return Layout(parse_dims(parser, words, args.any_names), rank_offset=args.offset)
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))


def _topology(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Topology | None:
    return topology_of(parser, node_of(parser, args), args.topology)


def ranges(ranks: Sequence[int], limit: int = 0) -> str:
    """``[8, 9, 10, 12]`` as ``"8-10, 12"`` (at most ``limit`` runs, 0: all)."""
    runs: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        runs.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    if limit and len(runs) > limit:
        return ", ".join(runs[:limit]) + f", … ({len(ranks)} ranks)"
    return ", ".join(runs) or "none"


def index_runs(index_map: Sequence[int | None]) -> str:
    """``(0, 2, 3, None)`` as ``"0<-0, 1-2<-2-3, 3<-new"``: runs of consecutive indices."""
    runs: list[str] = []
    i = 0
    while i < len(index_map):
        j = i
        old = index_map[i]
        while j + 1 < len(index_map) and (
            (old is None and index_map[j + 1] is None)
            or (old is not None and index_map[j + 1] == old + j + 1 - i)
        ):
            j += 1
        new = str(i) if i == j else f"{i}-{j}"
        was = "new" if old is None else str(old) if i == j else f"{old}-{old + j - i}"
        runs.append(f"{new}<-{was}")
        i = j + 1
    return ", ".join(runs)


def report(plan: RecoveryPlan, rank: int | None = None, full: bool = False) -> str:
    """The plan as text: layouts, moved ranks, and per family the groups kept/created/gone."""
    lay, limit = plan.layout, 0 if full else SHOWN
    new_shape = plan.new_shape()
    what = {
        "shrink": f"shrink along {plan.dim}",
        "grow": f"grow along {plan.dim}",
        "substitute": "substitute",
    }
    lines = [
        f"{what[plan.kind]}: {formula(lay.names, lay.shape)} ({lay.describe_ranks()})",
        f"new layout: {formula(lay.names, new_shape)}",
    ]
    if plan.lost:
        lines.append(f"lost: {ranges(plan.lost, limit)}")
    if plan.drained:
        lines.append(f"drained (alive, on a lost {plan.topology.names[0]}): {ranges(plan.drained, limit)}")  # type: ignore[union-attr]
    if plan.replacements:
        pairs = sorted(plan.replacements.items())
        some = pairs if full else pairs[:SHOWN]
        more = "" if len(some) == len(pairs) else f", … ({len(pairs)} in all)"
        lines.append("replacements: " + ", ".join(f"{a}->{b}" for a, b in some) + more)
    if plan.admitted and not plan.replacements:
        lines.append(f"admitted: {ranges(plan.admitted, limit)}")
    lines.append(f"spares (idle): {ranges(plan.spares, limit)}")
    if plan.index_map:
        mapping = index_runs(plan.index_map)
        lines.append(f"{plan.dim} index map (new<-old, for the dataloader): {mapping}")
    lines += [
        "",
        f"{'family':<14}{'owner':<16}{'size':>7}{'kept':>8}{'created':>9}{'gone':>7}  created groups",
    ]
    for change in plan.changes().values():
        c = change.counts()
        before = change.old.size(*change.dims)
        after = change.new.size(*change.dims) if change.new is not None else 0
        size = str(before) if before == after else f"{before}->{after}"
        rows = change.created.tolist()
        shown = "; ".join(ranges(r, 4) for r in (rows if full else rows[:3]))
        if len(rows) > 3 and not full:
            shown += f"; … ({len(rows)})"
        lines.append(
            f"{change.label:<14}{change.owner:<16}{size:>7}{c['kept']:>8}{c['created']:>9}{c['gone']:>7}  {shown}"
        )
    if rank is not None:
        lines += [
            "",
            f"rank {rank}: {plan.role(rank)}; old coords {plan.old_coords(rank)}; new {plan.new_coords(rank)}",
        ]
        for key in plan.families:
            group = plan.new_group(rank, key)
            members = "" if group is None else f" {ranges(group.tolist(), limit)}"
            lines.append(f"  {family_label(key):<14}{plan.status(rank, key) or '-'}{members}")
    return "\n".join(line.rstrip() for line in lines)


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Run ``shrink``/``grow`` for parsed ``args``; bad input exits 2 through ``parser.error``."""
    layout = _layout(parser, args)
    topology = _topology(parser, args)
    common: dict[str, Any] = {"topology": topology, "flatten": dim_sets(args.flatten or "")}
    if args.command == "grow":
        plan = plan_grow(layout, args.ranks, dim=args.dim, **common)
    elif args.spares is not None:
        if args.dim is not None:
            parser.error("--dim has no meaning with --spares (a substitute keeps every replica)")
        plan = plan_substitute(layout, args.lost, args.spares, **common)
    else:
        plan = plan_shrink(layout, args.lost, dim=args.dim, **common)
    if args.rank is not None and args.rank not in layout and plan.role(args.rank) == "outside":
        parser.error(f"--rank {args.rank} is neither in the layout nor among the ranks of the plan")
    if args.json:
        data = plan.summary(limit=0 if args.full else SHOWN)
        if args.rank is not None:
            data["rank"] = {
                "rank": args.rank,
                "role": plan.role(args.rank),
                "old_coords": plan.old_coords(args.rank),
                "new_coords": plan.new_coords(args.rank),
                "status": {family_label(k): plan.status(args.rank, k) for k in plan.families},
            }
        print_json(data)
    else:
        print(report(plan, args.rank, args.full))
    return 0


def register(sub: Any) -> dict[str, argparse.ArgumentParser]:
    """Add ``shrink`` and ``grow`` to ``cli.py``'s subparsers; returns their parsers by name."""
    out = {}
    for name, text in (
        ("shrink", "drop the replicas that hold lost ranks (or substitute spares with --spares)"),
        ("grow", "re-admit ranks as new replicas along the replicate dim"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument(
            "dims", nargs="*", help="the current layout: name=size words, outermost first (pp=2 dp=4 tp=8)"
        )
        p.add_argument("--layout", help=argparse.SUPPRESS)  # the old spelling: pp=2,dp=4,tp=8
        p.add_argument("--offset", type=rank_arg, default=0, help="first rank of the layout (default 0)")
        p.add_argument("--any-names", action="store_true", help="accept dim names that look like typos")
        p.add_argument(
            "--from-json", metavar="FILE", help="current layout: a Layout.to_dict file or a --json plan"
        )
        if name == "shrink":
            p.add_argument("--lost", type=rank_list, required=True, help="lost ranks: 13,14 or 8-15")
            p.add_argument(
                "--spares", type=rank_list, help="substitute these idle ranks instead of shrinking"
            )
        else:
            p.add_argument(
                "--ranks", type=rank_list, required=True, help="ranks of the new replicas: 8-15,40-47"
            )
        p.add_argument("--dim", help="the replicate dim (default: the outermost of dp_replicate, dp, ...)")
        add_node(p, "lost ranks take their node along")
        p.add_argument("--topology", help="levels, smallest first (node=8,domain=32); --node names the first")
        p.add_argument("--flatten", help="flattened dim sets to include, e.g. dp,cp;pp,tp")
        p.add_argument("--rank", type=rank_arg, help="also show this rank's role, coordinates and groups")
        p.add_argument("--json", action="store_true", help="print the plan as one JSON document")
        p.add_argument("--full", action="store_true", help="list every group and rank, however many")
        p.set_defaults(run=run, parser=p, command=name)
        out[name] = p
    return out


__all__ = ["dim_sets", "ranges", "rank_list", "register", "report"]
