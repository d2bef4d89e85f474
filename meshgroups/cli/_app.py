"""``python -m meshgroups`` (also the ``meshgroups`` command): show, plot and demo a layout.

    python -m meshgroups show pp=2 dp=2 cp=1 tp=4 --node 8 --rank 5
    python -m meshgroups show tp=2 cp=1 dp=2 pp=2 --order tp-cp-dp-pp --json
    python -m meshgroups show pp=4 dp=8 cp=2 tp=8 --topology node=8,domain=32
    python -m meshgroups show --from-json groups.json      # a running job's groups read back
    python -m meshgroups place pp=4 dp=8 cp=2 tp=8 --node 8 --fast-first tp,cp
    python -m meshgroups plot pp=2 dp=2 cp=1 tp=4 -o layout.png --color-by tp --node 8 --rank 5
    python -m meshgroups demo pp=2 dp=2 cp=1 tp=2          # spawns the 8 processes it needs
    python -m meshgroups shrink pp=2 dp=4 tp=8 --lost 13,14 --node 8   # also grow
    python -m meshgroups transfer --src pp=2 tp=4 --dst tp=8 --dst-offset 8 --node 8
    python -m meshgroups cost tp=8 dp_shard=4 pp=2 --model llama3-8b --node 8

One convention for every subcommand (:mod:`meshgroups.cli._conventions`): dims are
``name=size`` words, outermost first (or in ``--order``, Megatron's fastest-first order),
anywhere among the options; one size may be ``-1`` with ``--world-size``; ``--node N`` is the
ranks per node; ``--json`` prints one JSON document; ``--help`` states every default. A dim name
close to a usual one (``dpp``) is refused with a suggestion unless ``--any-names`` is given.
Every bad value exits with status 2 and a usage line naming the problem and the rule; big
layouts print a bounded summary that says what it left out (``--full`` prints everything). Old
spellings (``--ranks-per-node``) still work, with a ``warning:`` line on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from meshgroups.cli._args import (
    bounded_int,
    check_order,
    key_values,
    parse_dims,
    rank_arg,
    signed_int,
)
from meshgroups.cli._conventions import HelpFormatter, add_node, node_of, print_json, topology_of
from meshgroups.layout import Layout, megatron_order
from meshgroups.render import MAX_DPI, short_list, span_table
from meshgroups.render import text as render_text

DEFAULT_DEMO = ["pp=2", "dp=2", "cp=1", "tp=2"]
#: Without --full, JSON lists at most this many groups per dim, and tables this many members.
SUMMARY_GROUPS = 8
SUMMARY_MEMBERS = 16
#: Largest --from-json file read (a million-rank job's groups fit comfortably).
MAX_JSON_BYTES = 256 * 2**20


def _from_json(parser: argparse.ArgumentParser, path: str) -> Layout:
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_JSON_BYTES + 1)  # bounded: /dev/zero or a huge file is refused
        if len(raw) > MAX_JSON_BYTES:
            parser.error(f"--from-json {path} is larger than {MAX_JSON_BYTES} bytes")
        data = json.loads(raw)
    except OSError as exc:
        parser.error(f"cannot read --from-json {path}: {exc.strerror or exc}")
    except (ValueError, RecursionError) as exc:  # not JSON, not UTF-8, or nested too deep
        parser.error(f"--from-json {path} is not JSON meshgroups can read: {str(exc)[:200]}")
    try:
        if isinstance(data, dict) and "format" in data:
            return Layout.from_dict(data)  # a layout written by show --json --full or to_dict()
        if isinstance(data, dict) and isinstance(data.get("groups"), dict):
            data = data["groups"]  # show --json output: its groups
        elif isinstance(data, dict) and isinstance(data.get("layout"), dict) and "format" in data["layout"]:
            return Layout.from_dict(data["layout"])  # place --json output
        return Layout.infer(data)  # {"tp": [[0, 1], ...], "dp": [...], ...}: read the job back
    except (ValueError, TypeError) as exc:
        parser.error(f"--from-json {path}: {exc}")


def _layout(parser: argparse.ArgumentParser, args: argparse.Namespace, default: Sequence[str] = ()) -> Layout:
    if getattr(args, "from_json", None):
        if args.dims or args.order:
            parser.error("give either --from-json or dims (and --order), not both")
        return _from_json(parser, args.from_json)
    pairs = parse_dims(parser, args.dims or default, getattr(args, "any_names", False) or bool(args.order))
    try:
        if args.order is not None:
            check_order(parser, args.order)
            if any(size == -1 for _, size in pairs):
                parser.error("-1 sizes are not supported with --order")
            layout = Layout.from_order(args.order, **dict(pairs))
            if args.world_size is not None and layout.world_size != args.world_size:
                sizes = " × ".join(f"{n}={s}" for n, s in pairs)
                parser.error(f"{sizes} = {layout.world_size} does not match world size {args.world_size}")
            return layout
        unknown = [name for name, size in pairs if size == -1]
        if unknown and args.world_size is None:
            parser.error(f"{unknown[0]}=-1 needs --world-size N to infer it from")
        return Layout(pairs, world_size=args.world_size)
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))


def _rank_groups(layout: Layout, rank: int) -> dict[str, list[int]]:
    groups = {d: layout.group_of(rank, d).tolist() for d in layout.names}
    for name, view in layout.views.items():
        groups.update(
            {f"{name}.{d}": view.group_of(rank, d).tolist() for d in view.names if d not in layout.names}
        )
    return groups


def _check_rank(parser: argparse.ArgumentParser, layout: Layout, rank: int | None) -> None:
    if rank is not None and rank not in layout:
        parser.error(f"--rank {rank} is not in the layout ({layout.describe_ranks()})")


def _show(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    layout = _layout(parser, args)
    _check_rank(parser, layout, args.rank)
    args.ranks_per_node = node_of(parser, args)
    topology = None if args.topology is None else topology_of(parser, args.ranks_per_node, args.topology)
    if args.json:
        data = _json(layout, args)
        if topology is not None:
            data["span"] = {d: layout.span(d, topology=topology) for d in layout.names}
        print_json(data)
        return 0
    members = None if args.full else SUMMARY_MEMBERS
    print(render_text(layout, ranks_per_node=args.ranks_per_node, max_members=members))
    if topology is not None:
        print()
        print(span_table(layout, topology))
    if args.rank is not None:
        print(f"\nrank {args.rank}: " + ", ".join(f"{k}={v}" for k, v in layout.coords(args.rank).items()))
        for dims, ranks in _rank_groups(layout, args.rank).items():
            print(f"  {dims} group: {short_list(ranks, members)}")
    if not args.full and (layout.world_size > 256 or max(layout.shape) > SUMMARY_MEMBERS):
        print(
            "\n(a summary: groups are cut to their first members and the grid is not printed; --full prints all)"
        )
    return 0


def _json(layout: Layout, args: argparse.Namespace) -> dict[str, object]:
    groups: dict[str, object] = {}
    omitted: dict[str, int] = {}
    for name in layout.names:
        rows = layout.groups(name)
        keep = rows if args.full else rows[:SUMMARY_GROUPS]
        groups[name] = keep.tolist()
        if len(keep) < len(rows):
            omitted[name] = len(rows) - len(keep)
    data: dict[str, object] = {"fingerprint": layout.fingerprint(), "groups": groups}
    data["layout"] = layout.to_dict() if args.full or layout.is_affine else {"repr": repr(layout)}
    if omitted:
        data["omitted_groups"] = omitted
        data["note"] = f"first {SUMMARY_GROUPS} groups per dim; --full lists every group"
    if args.ranks_per_node:
        data["nodes"] = {n: layout.node_locality(n, ranks_per_node=args.ranks_per_node) for n in layout.names}
    if args.rank is not None:
        data["rank"] = {
            "rank": args.rank,
            "coords": layout.coords(args.rank),
            "groups": _rank_groups(layout, args.rank),
        }
    return data


def _place(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    pairs = parse_dims(parser, args.dims, args.any_names)
    topology = topology_of(parser, node_of(parser, args), args.topology, required=True)
    if topology is None:  # an invariant of topology_of(required=True), not a check of user input
        raise RuntimeError("meshgroups internal error: topology is None (required)")
    require = key_values(parser, "--require", args.require, "tp=node")
    fast = [d for d in (args.fast_first or "").split(",") if d]
    if len(set(fast)) < len(fast):
        parser.error(f"--fast-first names a dim twice: {args.fast_first!r}")
    try:
        layout = Layout.place(dict(pairs), topology, fast_first=fast, require=require)
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    order, why = megatron_order(layout)
    if args.json:
        spans = {d: layout.span(d, topology=topology) for d in layout.names}
        data = {
            "layout": layout.to_dict(),
            "span": spans,
            "megatron_order": order,
            "megatron_order_note": why,
        }
        print_json(data)
        return 0
    print(render_text(layout, max_members=SUMMARY_MEMBERS))
    print()
    print(span_table(layout, topology))
    print()
    if order is not None:
        print(
            f"Megatron order string: {order} (initialize_model_parallel(order={order!r}) gives these groups)"
        )
    else:
        print(f"not a Megatron order string: {why}")
    return 0


def _plot(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    layout = _layout(parser, args)
    _check_rank(parser, layout, args.rank)
    if not args.output.strip() or args.output.endswith(("/", os.sep)) or os.path.isdir(args.output):
        parser.error(f"-o needs a file name such as layout.png, got {args.output!r}")
    color_by = tuple(args.color_by.split(",")) if args.color_by is not None else None
    node = node_of(parser, args)
    try:
        from meshgroups.render import legend, plot

        fig = plot(layout, color_by, ranks_per_node=node, highlight_rank=args.rank)
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    except ImportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        fig.savefig(args.output, dpi=args.dpi)
    except OSError as exc:
        parser.error(f"cannot write -o {args.output}: {exc.strerror or exc}")
    except ValueError as exc:  # e.g. an extension matplotlib has no writer for
        parser.error(f"cannot write -o {args.output}: {exc}")
    if args.json:
        keys = legend(layout, color_by, ranks_per_node=node, highlight_rank=args.rank)
        print_json({"wrote": args.output, "layout": repr(layout), "legend": keys})
    else:
        print(f"wrote {args.output}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``meshgroups`` command line: ``show``, ``place``, ``plot``, ``demo``, ``transfer``,
    ``shrink``, ``grow`` and ``cost``, one convention for all (:mod:`meshgroups.cli._conventions`),
    and ``store`` (an elastic job's store, no layout).

    Returns:
        The ``argparse`` parser; ``main`` uses it.
    """
    parser = argparse.ArgumentParser(
        prog="meshgroups",
        description="Show, plot, demo, cost and plan rank layouts.",
        formatter_class=HelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def layout_args(p: argparse.ArgumentParser, node: str) -> None:
        p.add_argument("dims", nargs="*", help="name=size words, outermost first (e.g. pp=2 dp=2 tp=4)")
        p.add_argument("--order", help="Megatron order string, fastest first (e.g. tp-cp-dp-pp)")
        p.add_argument(
            "--world-size",
            type=signed_int("--world-size"),
            help="check the sizes against it (one size may be -1, inferred from it)",
        )
        add_node(p, node)
        p.add_argument("--rank", type=rank_arg, help="show this rank's coordinates and groups")
        p.add_argument("--any-names", action="store_true", help="accept dim names that look like typos")

    show = sub.add_parser("show", help="print a layout and its groups")
    layout_args(show, "each dim's groups are said to stay inside a node (intra) or not")
    show.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    show.add_argument(
        "--topology",
        help="levels of consecutive ranks, smallest first (node=8,domain=32): which groups leave them",
    )
    show.add_argument(
        "--from-json",
        metavar="FILE",
        help="read the layout from a JSON file: a job's groups {name: [[ranks], ...]} or a layout dict",
    )
    show.add_argument("--full", action="store_true", help="print every group and member, however big")
    show.set_defaults(run=_show, parser=show)
    place = sub.add_parser("place", help="order dims so the bandwidth-hungry ones stay on fast levels")
    place.add_argument("dims", nargs="*", help="name=size words, outermost first (e.g. pp=4 dp=8 tp=8)")
    add_node(place, "the first level dims are placed on (this or --topology is required)")
    place.add_argument("--topology", help="levels, smallest first (e.g. node=8,domain=32)")
    place.add_argument("--fast-first", help="dims by bandwidth need, most first (e.g. tp,cp,dp)")
    place.add_argument("--require", help="constraints dim=level, comma separated (e.g. tp=node)")
    place.add_argument("--json", action="store_true", help="print the layout and spans as one JSON document")
    place.add_argument("--any-names", action="store_true", help="accept dim names that look like typos")
    place.set_defaults(run=_place, parser=place)
    plot = sub.add_parser("plot", help="draw a layout to a PNG (needs matplotlib)")
    layout_args(plot, "node boundaries drawn as thick lines, each row labelled with its nodes")
    plot.add_argument("-o", "--output", default="layout.png", help="output file (default layout.png)")
    plot.add_argument(
        "--color-by", help="dim or comma-separated dims whose groups get colours (default: the innermost dim)"
    )
    plot.add_argument(
        "--dpi",
        type=bounded_int("--dpi", 1, MAX_DPI, " (a 16 x 12 inch figure at most)"),
        default=120,
        help=f"resolution of the PNG (default 120, at most {MAX_DPI})",
    )
    plot.add_argument("--json", action="store_true", help="print the file written and the legend as JSON")
    plot.set_defaults(run=_plot, parser=plot)
    commands = {"show": show, "place": place, "plot": plot}
    from meshgroups.cli._cost import add_parser as add_cost  # what a layout costs
    from meshgroups.cli._cost import run as run_cost
    from meshgroups.cli._demo_command import register as register_demo  # the demo's processes
    from meshgroups.cli._elastic import register as register_elastic  # recovery plans
    from meshgroups.cli._store import register as register_store  # an elastic job's store
    from meshgroups.cli._transfer import register as register_transfer  # weight transfer

    commands["demo"] = register_demo(sub)
    commands["transfer"] = register_transfer(sub)
    commands.update(register_elastic(sub))
    commands["store"] = register_store(sub)
    cost = add_cost(sub)
    cost.set_defaults(run=lambda _parser, args: run_cost(args), parser=cost)
    commands["cost"] = cost
    for command in commands.values():
        command.formatter_class = HelpFormatter
    parser.set_defaults(commands=commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line (``python -m meshgroups ...``).

    Args:
        argv: the words after the program name (default: ``sys.argv[1:]``).

    Returns:
        The exit status: 0 on success, 1 when a demo check fails or the plot extra is missing; a
        bad value exits with status 2 and the usage line (``SystemExit``), never a traceback.

    >>> main(["show", "dp=2", "tp=2"])  # python -m meshgroups show dp=2 tp=2  # doctest: +ELLIPSIS
    Layout(dp=2, tp=2)
    ...
    0
    """
    parser = build_parser()
    words = list(sys.argv[1:] if argv is None else argv)
    # Dims may sit anywhere among the options: the subcommand parses its words intermixed.
    commands = parser.get_default("commands")
    if words and words[0] in commands:
        args = commands[words[0]].parse_intermixed_args(words[1:])
    else:
        args = parser.parse_args(words)
    try:
        return int(args.run(args.parser, args))
    except BrokenPipeError:
        # The reader left (``| head``): stop quietly, as other command-line tools do, with no
        # traceback from the interpreter flushing stdout at exit either.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a tool killed by the signal
    except (ValueError, TypeError) as exc:
        # The last net: every check above names its option; a value error from deeper in the
        # library is still a usage error (exit 2, one message), never a traceback.
        command: argparse.ArgumentParser = args.parser
        command.error(str(exc))


if __name__ == "__main__":
    sys.exit(main())
