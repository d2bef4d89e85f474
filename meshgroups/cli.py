"""``python -m meshgroups`` (also the ``meshgroups`` command): show, plot and demo a layout.

    python -m meshgroups show pp=2 dp=2 cp=1 tp=4 --ranks-per-node 8 --rank 5
    python -m meshgroups show tp=2 cp=1 dp=2 pp=2 --order tp-cp-dp-pp --json
    python -m meshgroups plot pp=2 dp=2 cp=1 tp=4 -o layout.png --color-by tp
    python -m meshgroups demo --nproc 8 pp=2 dp=2 cp=1 tp=2

Dims are ``name=size`` words, outermost first (or in ``--order``, Megatron's fastest-first
order); one size may be ``-1`` with ``--world-size``. Bad arguments exit with status 2 and a
usage message naming the problem.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from .layout import Layout
from .render import text as render_text

DEFAULT_DEMO = ["pp=2", "dp=2", "cp=1", "tp=2"]


def _parse_dims(parser: argparse.ArgumentParser, words: Sequence[str]) -> list[tuple[str, int]]:
    pairs = []
    for word in words:
        name, sep, size = word.partition("=")
        if not sep or not name:
            parser.error(f"dims are name=size words like tp=4, got {word!r}")
        try:
            pairs.append((name, int(size)))
        except ValueError:
            parser.error(f"size of {name!r} must be an integer, got {size!r}")
    if not pairs:
        parser.error("give at least one dim, e.g. pp=2 dp=2 tp=4")
    return pairs


def _layout(parser: argparse.ArgumentParser, args: argparse.Namespace, default: Sequence[str] = ()) -> Layout:
    pairs = _parse_dims(parser, args.dims or default)
    try:
        if args.order:
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


def _show(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    layout = _layout(parser, args)
    if args.rank is not None and args.rank not in layout:
        parser.error(
            f"--rank {args.rank} is not in the layout (ranks {layout.rank_offset}..{layout.max_rank})"
        )
    if args.json:
        data: dict[str, object] = {
            "layout": layout.to_dict(),
            "fingerprint": layout.fingerprint(),
            "groups": {n: layout.groups(n).tolist() for n in layout.names},
        }
        if args.ranks_per_node:
            data["nodes"] = {
                n: layout.node_locality(n, ranks_per_node=args.ranks_per_node) for n in layout.names
            }
        if args.rank is not None:
            data["rank"] = {
                "rank": args.rank,
                "coords": layout.coords(args.rank),
                "groups": _rank_groups(layout, args.rank),
            }
        print(json.dumps(data, indent=1))
        return 0
    print(render_text(layout, ranks_per_node=args.ranks_per_node))
    if args.rank is not None:
        print(f"\nrank {args.rank}: " + ", ".join(f"{k}={v}" for k, v in layout.coords(args.rank).items()))
        for dims, ranks in _rank_groups(layout, args.rank).items():
            print(f"  {dims} group: {ranks}")
    return 0


def _plot(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    layout = _layout(parser, args)
    color_by = tuple(args.color_by.split(",")) if args.color_by else None
    try:
        from .render import plot

        fig = plot(layout, color_by, ranks_per_node=args.ranks_per_node, highlight_rank=args.rank)
    except ValueError as exc:
        parser.error(str(exc))
    except ImportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    fig.savefig(args.output, dpi=args.dpi)
    print(f"wrote {args.output}")
    return 0


def _demo(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    import os

    from .demo import main as demo_main

    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world = int(os.environ["WORLD_SIZE"]) if torchrun else args.nproc
    if world < 1:
        parser.error(f"--nproc {world} must be positive")
    if args.dims:
        args.world_size = world
        layout = _layout(parser, args)
    else:
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
        p.add_argument("--ranks-per-node", type=int, help="report intra/inter-node groups")
        p.add_argument("--rank", type=int, help="show this rank's coordinates and groups")

    show = sub.add_parser("show", help="print a layout and its groups")
    layout_args(show)
    show.add_argument("--json", action="store_true", help="print JSON instead of tables")
    show.set_defaults(run=_show, parser=show)
    plot = sub.add_parser("plot", help="draw a layout to a PNG (needs matplotlib)")
    layout_args(plot)
    plot.add_argument("-o", "--output", default="layout.png", help="output file (default layout.png)")
    plot.add_argument("--color-by", help="dim or comma-separated dims whose groups get colours")
    plot.add_argument("--dpi", type=int, default=120)
    plot.set_defaults(run=_plot, parser=plot)
    demo = sub.add_parser("demo", help="build the mesh on real processes and verify every group")
    demo.add_argument("dims", nargs="*", help="name=size words (default: pp=2 dp=2 cp=1 tp=2 for 8)")
    demo.add_argument("--nproc", type=int, default=8, help="processes to spawn (ignored under torchrun)")
    demo.add_argument("--order", help="Megatron order string, fastest first")
    demo.add_argument("--strategy", choices=["global", "local"], default="global")
    demo.add_argument("--timeout", type=float, default=60.0, help="seconds before a stuck job fails")
    demo.set_defaults(run=_demo, parser=demo, world_size=None)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.run(args.parser, args))


if __name__ == "__main__":
    sys.exit(main())
