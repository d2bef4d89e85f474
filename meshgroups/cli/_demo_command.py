"""``python -m meshgroups demo``: its options and how they become the demo's layout and
processes (the demo job itself is :mod:`meshgroups.cli._demo`)::

    python -m meshgroups demo pp=2 dp=2 cp=1 tp=2          # spawns the 8 processes it needs
    python -m meshgroups demo dp=-1 tp=2 --nproc 8 --node 4 --json
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from meshgroups._checks import formula, product
from meshgroups.cli._args import bounded_float, bounded_int, check_order, parse_dims, strict_int
from meshgroups.cli._conventions import add_node, node_of
from meshgroups.cli._demo import MAX_PROCESSES, MAX_TIMEOUT
from meshgroups.layout import Layout

__all__ = ["demo_layout", "register", "run"]


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """The demo's processes: one per rank of the layout. A ``-1`` dim is filled from ``--nproc``
    or torchrun's ``WORLD_SIZE``; a layout of another size than the processes is an error; at most
    ``MAX_PROCESSES`` are spawned on this machine (torchrun starts its own)."""
    from meshgroups.cli._demo import main as demo_main

    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world, source = args.nproc, f"--nproc {args.nproc}"
    if torchrun:
        try:
            world = strict_int(os.environ["WORLD_SIZE"], "WORLD_SIZE")
        except argparse.ArgumentTypeError as exc:
            parser.error(str(exc))
        if args.nproc is not None and args.nproc != world:
            parser.error(
                f"--nproc {args.nproc} but torchrun started WORLD_SIZE={world} processes; drop --nproc"
            )
        source = f"torchrun's WORLD_SIZE={world}"
    if args.dims:
        layout = demo_layout(parser, args, world, source)
        if world is None:
            world = layout.world_size
        elif layout.world_size != world:
            fix = (
                f"start torchrun with {layout.world_size} processes"
                if torchrun
                else f"drop --nproc (it follows the dims) or give --nproc {layout.world_size}"
            )
            parser.error(
                f"the layout has {layout.world_size} ranks but {source}; the demo runs one process per rank: {fix}"
            )
    else:
        world = world or 8
        tp = 2 if world % 2 == 0 else 1
        pp = 2 if world % (2 * tp) == 0 and world > 2 * tp else 1
        layout = Layout(pp=pp, dp=world // (pp * tp), cp=1, tp=tp)
    if not torchrun and world > MAX_PROCESSES:
        parser.error(
            f"the layout has {world} ranks; the demo spawns at most {MAX_PROCESSES} processes on this "
            "machine (one per rank); run it under torchrun for more"
        )
    node = node_of(parser, args)
    status = demo_main(
        layout, world, strategy=args.strategy, timeout=args.timeout, node=node, as_json=args.json
    )
    if torchrun:
        # A torchrun worker whose groups are all destroyed (demo._shut_down) still aborts at
        # interpreter exit now and then (SIGABRT on one rank, about one run in fifty in CI, after
        # every check passed): a gloo worker thread meeting Python's finalization. Nothing is
        # left to finalize, so the worker exits here with its status instead.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


def demo_layout(
    parser: argparse.ArgumentParser, args: argparse.Namespace, world: int | None, source: str
) -> Layout:
    """The demo's layout; a ``-1`` size is the processes' count over the other sizes."""
    pairs = parse_dims(parser, args.dims, args.any_names or bool(args.order))
    unknown = [name for name, size in pairs if size == -1]
    if len(unknown) > 1:
        parser.error(f"only one size may be -1 (inferred), got {', '.join(unknown)}")
    if unknown:
        if world is None:
            parser.error(
                f"{unknown[0]}=-1 needs the number of processes: give --nproc N (or run under torchrun)"
            )
        known = [(n, s) for n, s in pairs if s != -1 and s > 0]
        rest = product(s for _, s in known)
        if len(known) < len(pairs) - 1 or world % rest:
            parser.error(
                f"{formula([n for n, _ in known], [s for _, s in known]) if known else 'the other dims'} "
                f"does not divide the {world} processes of {source}, so {unknown[0]}=-1 cannot be inferred"
            )
        pairs = [(n, world // rest if s == -1 else s) for n, s in pairs]
    try:
        if args.order is not None:
            check_order(parser, args.order)
            return Layout.from_order(args.order, **dict(pairs))
        return Layout(pairs)
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))


def register(sub: Any) -> argparse.ArgumentParser:
    """Add ``demo`` to the command line's subparsers; returns its parser."""
    demo = sub.add_parser("demo", help="build the mesh on real processes and verify every group")
    demo.add_argument(
        "dims", nargs="*", help="name=size words, outermost first (default: pp=2 dp=2 cp=1 tp=2 for 8)"
    )
    demo.add_argument(
        "--nproc",
        type=bounded_int("--nproc", 1, MAX_PROCESSES, " (processes the demo spawns on this machine)"),
        help=f"processes to spawn, at most {MAX_PROCESSES} (default: the layout's world, or 8; a -1 dim "
        "is filled from it); under torchrun, its WORLD_SIZE",
    )
    demo.add_argument("--order", help="Megatron order string, fastest first (e.g. tp-cp-dp-pp)")
    demo.add_argument("--any-names", action="store_true", help="accept dim names that look like typos")
    add_node(
        demo,
        "the report says which groups stay inside a node; under torchrun the node is its "
        "LOCAL_WORLD_SIZE (torchrun itself refuses --node, a prefix of its --node-rank)",
    )
    demo.add_argument(
        "--strategy",
        choices=["global", "local"],
        default="global",
        help="how groups are created: every rank makes every group (global) or only its own (local)",
    )
    demo.add_argument(
        "--timeout",
        type=bounded_float("--timeout", MAX_TIMEOUT, 1.0, " seconds"),
        default=60.0,
        help=f"seconds before a stuck job fails (1 to {MAX_TIMEOUT:g}, default 60)",
    )
    demo.add_argument("--json", action="store_true", help="print the report as one JSON document")
    demo.set_defaults(run=run, parser=demo, world_size=None)
    return demo
