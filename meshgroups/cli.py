"""``python -m meshgroups`` (also the ``meshgroups`` command): show, plot and demo a layout.

    python -m meshgroups show pp=2 dp=2 cp=1 tp=4 --ranks-per-node 8 --rank 5
    python -m meshgroups show tp=2 cp=1 dp=2 pp=2 --order tp-cp-dp-pp --json
    python -m meshgroups show pp=4 dp=8 cp=2 tp=8 --topology node=8,domain=32
    python -m meshgroups show --from-json groups.json      # a running job's groups read back
    python -m meshgroups place pp=4 dp=8 cp=2 tp=8 --topology node=8,domain=32 --fast-first tp,cp
    python -m meshgroups plot pp=2 dp=2 cp=1 tp=4 -o layout.png --color-by tp
    python -m meshgroups demo pp=2 dp=2 cp=1 tp=2          # spawns the 8 processes it needs

Dims are ``name=size`` words, outermost first (or in ``--order``, Megatron's fastest-first
order), anywhere among the options; one size may be ``-1`` with ``--world-size``. A dim name
close to a usual one (``dpp``) is refused with a suggestion unless ``--any-names`` is given.
Every bad value exits with status 2 and a usage line naming the problem and the rule; big
layouts print a bounded summary that says what it left out (``--full`` prints everything).
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from collections.abc import Callable, Sequence

from .layout import Layout
from .render import short_list, span_table
from .render import text as render_text
from .topology import Topology

DEFAULT_DEMO = ["pp=2", "dp=2", "cp=1", "tp=2"]
#: Megatron's order tokens (RankGenerator accepts these and no others).
ORDER_TOKENS = ("tp", "cp", "ep", "dp", "pp")
#: Names a dim is usually called; a name close to one of these but not it is probably a typo.
USUAL_NAMES = (
    *ORDER_TOKENS,
    "etp",
    "edp",
    "sp",
    "dp_replicate",
    "dp_shard",
    "expt_tp",
    "expt_dp",
    "world",
    "node",
    "local",
)
#: Without --full, JSON lists at most this many groups per dim, and tables this many members.
SUMMARY_GROUPS = 8
SUMMARY_MEMBERS = 16


def _positive(kind: Callable[[str], float], what: str) -> Callable[[str], float]:
    def parse(value: str) -> float:
        try:
            number = kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be a number, got {value!r}") from None
        if not number > 0 or number != number or number == float("inf"):
            raise argparse.ArgumentTypeError(f"{what} must be positive, got {value!r}")
        return number

    return parse


def _non_negative_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {value!r}") from None
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value!r}")
    return number


def _parse_dims(
    parser: argparse.ArgumentParser, words: Sequence[str], any_names: bool
) -> list[tuple[str, int]]:
    pairs = []
    for word in words:
        name, sep, size = word.partition("=")
        if not sep or not name:
            parser.error(f"dims are name=size words like tp=4, got {word!r}")
        try:
            pairs.append((name, int(size)))
        except ValueError:
            parser.error(f"size of {name!r} must be an integer, got {size!r}")
        if not any_names and name not in USUAL_NAMES:
            close = difflib.get_close_matches(name, USUAL_NAMES, n=2, cutoff=0.6)
            if close:
                parser.error(
                    f"unknown dim {name!r}: did you mean {' or '.join(map(repr, close))}? "
                    "(pass --any-names to use it as it is)"
                )
    if not pairs:
        parser.error("give at least one dim, e.g. pp=2 dp=2 tp=4")
    return pairs


def _check_order(parser: argparse.ArgumentParser, order: str) -> None:
    if not order.strip():
        parser.error("--order is empty; give Megatron's tokens fastest first, e.g. tp-cp-ep-dp-pp")
    for token in order.lower().split("-"):
        if token not in ORDER_TOKENS:
            close = difflib.get_close_matches(token, ORDER_TOKENS, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            parser.error(
                f"--order token {token!r} is not one of Megatron's ({', '.join(ORDER_TOKENS)}); {hint}"
                "without --order, any dim names may be used"
            )


def _from_json(parser: argparse.ArgumentParser, path: str) -> Layout:
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as exc:
        parser.error(f"cannot read --from-json {path}: {exc.strerror or exc}")
    except json.JSONDecodeError as exc:
        parser.error(f"--from-json {path} is not JSON: {exc}")
    try:
        if isinstance(data, dict) and "format" in data:
            return Layout.from_dict(data)  # a layout written by show --json --full or to_dict()
        if isinstance(data, dict) and isinstance(data.get("groups"), dict):
            data = data["groups"]  # show --json output: its groups
        return Layout.infer(data)  # {"tp": [[0, 1], ...], "dp": [...], ...}: read the job back
    except (ValueError, TypeError) as exc:
        parser.error(f"--from-json {path}: {exc}")
    raise AssertionError("unreachable")


def _topology(parser: argparse.ArgumentParser, text: str | None) -> Topology | None:
    if text is None:
        return None
    try:
        return Topology.parse(text)
    except (ValueError, TypeError) as exc:
        parser.error(f"--topology {text!r}: {exc}")
    raise AssertionError("unreachable")


def _layout(parser: argparse.ArgumentParser, args: argparse.Namespace, default: Sequence[str] = ()) -> Layout:
    if getattr(args, "from_json", None):
        if args.dims or args.order:
            parser.error("give either --from-json or dims (and --order), not both")
        return _from_json(parser, args.from_json)
    pairs = _parse_dims(parser, args.dims or default, getattr(args, "any_names", False) or bool(args.order))
    try:
        if args.order is not None:
            _check_order(parser, args.order)
            if any(size == -1 for _, size in pairs):
                parser.error("-1 sizes are not supported with --order")
            layout = Layout.from_order(args.order, **dict(pairs))
            if args.world_size is not None and layout.world_size != args.world_size:
                sizes = " × ".join(f"{n}={s}" for n, s in pairs)
                parser.error(f"{sizes} = {layout.world_size} does not match world size {args.world_size}")
            return layout
        return Layout(pairs, world_size=args.world_size)
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    raise AssertionError("unreachable")  # parser.error exits


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
    topology = _topology(parser, args.topology)
    if args.json:
        data = _json(layout, args)
        if topology is not None:
            data["span"] = {d: layout.span(d, topology=topology) for d in layout.names}
        print(json.dumps(data, indent=1))
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
    pairs = _parse_dims(parser, args.dims, args.any_names)
    topology = _topology(parser, args.topology)
    assert topology is not None  # required by the parser
    require = {}
    for word in (args.require or "").split(","):
        if word:
            dim, sep, level = word.partition("=")
            if not sep:
                parser.error(f"--require takes dim=level pairs like tp=node, got {word!r}")
            require[dim] = level
    fast = [d for d in (args.fast_first or "").split(",") if d]
    try:
        layout = Layout.place(dict(pairs), topology, fast_first=fast, require=require)
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    if args.json:
        spans = {d: layout.span(d, topology=topology) for d in layout.names}
        print(json.dumps({"layout": layout.to_dict(), "span": spans}, indent=1))
        return 0
    print(render_text(layout, max_members=SUMMARY_MEMBERS))
    print()
    print(span_table(layout, topology))
    return 0


def _plot(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    layout = _layout(parser, args)
    _check_rank(parser, layout, args.rank)
    color_by = tuple(args.color_by.split(",")) if args.color_by else None
    try:
        from .render import plot

        fig = plot(layout, color_by, ranks_per_node=args.ranks_per_node, highlight_rank=args.rank)
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
    print(f"wrote {args.output}")
    return 0


def _demo(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    import os

    from .demo import main as demo_main

    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if args.dims:
        args.world_size = None
        layout = _layout(parser, args)
        world = int(os.environ["WORLD_SIZE"]) if torchrun else args.nproc or layout.world_size
        if not torchrun and layout.max_rank >= world:
            parser.error(
                f"the layout has {layout.world_size} ranks but --nproc {world}; drop --nproc "
                f"(it follows the dims) or give --nproc {layout.max_rank + 1}"
            )
    else:
        world = int(os.environ["WORLD_SIZE"]) if torchrun else args.nproc or 8
        tp = 2 if world % 2 == 0 else 1
        pp = 2 if world % (2 * tp) == 0 and world > 2 * tp else 1
        layout = Layout(pp=pp, dp=world // (pp * tp), cp=1, tp=tp)
    return demo_main(layout, world, strategy=args.strategy, timeout=args.timeout)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshgroups", description="Show, plot and demo rank layouts.")
    sub = parser.add_subparsers(dest="command", required=True)

    def layout_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("dims", nargs="*", help="name=size words, outermost first (e.g. pp=2 dp=2 tp=4)")
        p.add_argument("--order", help="Megatron order string, fastest first (e.g. tp-cp-dp-pp)")
        p.add_argument("--world-size", type=int, help="check the sizes against it (one size may be -1)")
        p.add_argument(
            "--ranks-per-node", type=_positive(int, "--ranks-per-node"), help="report intra/inter-node groups"
        )
        p.add_argument("--rank", type=_non_negative_int, help="show this rank's coordinates and groups")
        p.add_argument("--any-names", action="store_true", help="accept dim names that look like typos")

    show = sub.add_parser("show", help="print a layout and its groups")
    layout_args(show)
    show.add_argument("--json", action="store_true", help="print JSON instead of tables")
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
    place.add_argument("--topology", required=True, help="levels, smallest first (e.g. node=8,domain=32)")
    place.add_argument("--fast-first", help="dims by bandwidth need, most first (e.g. tp,cp,dp)")
    place.add_argument("--require", help="constraints dim=level, comma separated (e.g. tp=node)")
    place.add_argument("--json", action="store_true", help="print the layout and spans as JSON")
    place.add_argument("--any-names", action="store_true", help="accept dim names that look like typos")
    place.set_defaults(run=_place, parser=place)
    plot = sub.add_parser("plot", help="draw a layout to a PNG (needs matplotlib)")
    layout_args(plot)
    plot.add_argument("-o", "--output", default="layout.png", help="output file (default layout.png)")
    plot.add_argument("--color-by", help="dim or comma-separated dims whose groups get colours")
    plot.add_argument(
        "--dpi", type=_positive(int, "--dpi"), default=120, help="resolution of the PNG (default 120)"
    )
    plot.set_defaults(run=_plot, parser=plot)
    demo = sub.add_parser("demo", help="build the mesh on real processes and verify every group")
    demo.add_argument("dims", nargs="*", help="name=size words (default: pp=2 dp=2 cp=1 tp=2 for 8)")
    demo.add_argument(
        "--nproc",
        type=_positive(int, "--nproc"),
        help="processes to spawn (default: the layout's world, or 8; ignored under torchrun)",
    )
    demo.add_argument("--order", help="Megatron order string, fastest first")
    demo.add_argument("--any-names", action="store_true", help="accept dim names that look like typos")
    demo.add_argument("--strategy", choices=["global", "local"], default="global")
    demo.add_argument(
        "--timeout", type=_positive(float, "--timeout"), default=60.0, help="seconds before a stuck job fails"
    )
    demo.set_defaults(run=_demo, parser=demo, world_size=None)
    parser.set_defaults(commands={"show": show, "place": place, "plot": plot, "demo": demo})
    from ._cli_transfer import register as register_transfer  # weight transfer: its own module

    parser.get_default("commands")["transfer"] = register_transfer(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    words = list(sys.argv[1:] if argv is None else argv)
    # Dims may sit anywhere among the options: the subcommand parses its words intermixed.
    commands = parser.get_default("commands")
    if words and words[0] in commands:
        args = commands[words[0]].parse_intermixed_args(words[1:])
        return int(args.run(args.parser, args))
    args = parser.parse_args(words)
    return int(args.run(args.parser, args))


if __name__ == "__main__":
    sys.exit(main())
