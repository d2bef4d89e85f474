"""``python -m meshgroups cost``: what a layout costs, or every layout of a world ranked.

    python -m meshgroups cost tp=8 dp_shard=4 pp=2 --model llama3-8b --topology node=8
    python -m meshgroups cost --world 64 --model mixtral-8x7b --topology node=8 --budget-gib 80
    python -m meshgroups cost --world 16 --hf-config config.json --seq-len 4096 --json

Dims are ``role=size`` words (roles: pp, dp_replicate, dp_shard, ep, cp, tp), outermost first.
Every bad value exits with status 2 and one ``error:`` line naming it and the rule. The CLI wires
this in with :func:`add_parser` and :func:`run`::

    >>> import argparse
    >>> sub = argparse.ArgumentParser(prog="meshgroups").add_subparsers()
    >>> add_parser(sub).prog
    'meshgroups cost'
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

from meshgroups.cost import (
    DTYPE_BYTES,
    PRESETS,
    ROLES,
    SORT_KEYS,
    Model,
    Parallelism,
    Precision,
    cost_report,
    enumerate_layouts,
    format_bytes,
    preset,
    sort_candidates,
    table,
)
from meshgroups.layout import Layout, Topology

__all__ = ["add_parser", "run"]

#: Largest config file read, and largest --world enumerated from the command line.
MAX_CONFIG_BYTES = 1 << 20
MAX_CLI_WORLD = 1 << 14
_DIGITS = re.compile(r"[0-9]+", re.ASCII)
_NUMBER = re.compile(r"[0-9]+(\.[0-9]+)?", re.ASCII)


def _count(what: str, high: int) -> Any:
    def parse(text: str) -> int:
        if not _DIGITS.fullmatch(text):
            raise argparse.ArgumentTypeError(f"{what} must be an integer in digits 0-9, got {text!r}")
        value = int(text)
        if not 1 <= value <= high:
            raise argparse.ArgumentTypeError(f"{what} must be in 1..{high}, got {text!r}")
        return value

    return parse


def _gib(text: str) -> float:
    if not _NUMBER.fullmatch(text) or not 0 < float(text) <= 1 << 20:
        raise argparse.ArgumentTypeError(
            f"--budget-gib must be a positive decimal number of GiB, got {text!r}"
        )
    return float(text)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``cost`` subcommand to an argparse ``subparsers`` object.

    Args:
        subparsers: what ``ArgumentParser.add_subparsers()`` returned.

    Returns:
        the new subparser (its default ``func`` is :func:`run`).

    >>> parser = argparse.ArgumentParser(prog="meshgroups")
    >>> add_parser(parser.add_subparsers()).get_default("func") is run
    True
    """
    p = subparsers.add_parser(
        "cost",
        help="memory per rank and bytes per group family and topology level of a layout, or of every layout of a world",
        description="What a layout costs for a model: per-rank memory and each collective's bytes per "
        "topology level; with --world, every layout the model admits, ordered by the bytes over the "
        "slowest level crossed (not a predicted step time).",
    )
    p.add_argument(
        "dims", nargs="*", help="role=size words, outermost first (roles: " + ", ".join(ROLES) + ")"
    )
    p.add_argument(
        "--world", type=_count("--world", MAX_CLI_WORLD), help="enumerate every layout of this many ranks"
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", choices=sorted(PRESETS), help="a preset model")
    source.add_argument("--hf-config", metavar="FILE", help="a Hugging Face config.json")
    p.add_argument("--topology", help="levels of consecutive ranks, e.g. node=8,domain=32")
    p.add_argument("--seq-len", type=_count("--seq-len", 1 << 24))
    p.add_argument("--micro-batch", type=_count("--micro-batch", 1 << 16))
    p.add_argument("--micro-batches", type=_count("--micro-batches", 1 << 16), default=1)
    p.add_argument("--recompute", choices=("none", "selective", "full"), default="none")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--schedule", choices=("1f1b", "interleaved"), default="1f1b")
    p.add_argument("--virtual-stages", type=_count("--virtual-stages", 1 << 10), default=1)
    for name, default in (
        ("params", "bfloat16"),
        ("grads", "float32"),
        ("moments", "float32"),
        ("activations", "bfloat16"),
    ):
        p.add_argument(f"--{name}-dtype", choices=sorted(DTYPE_BYTES), default=default)
    p.add_argument("--no-master", action="store_true", help="no fp32 master copy of the parameters")
    p.add_argument("--budget-gib", type=_gib, help="memory per rank, GiB (with --world: which layouts fit)")
    p.add_argument("--sort", choices=SORT_KEYS, default="slow", help="order of the --world table")
    p.add_argument("--top", type=_count("--top", 1 << 20), default=20, help="rows of the --world table")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run, cost_parser=p)
    return p


def _model(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Model:
    overrides = {
        k: v for k, v in (("seq_len", args.seq_len), ("micro_batch", args.micro_batch)) if v is not None
    }
    try:
        if args.model:
            return preset(args.model).with_(**overrides)
        try:
            with open(args.hf_config, "rb") as f:
                raw = f.read(MAX_CONFIG_BYTES + 1)
        except OSError as exc:
            parser.error(f"cannot read --hf-config {args.hf_config}: {exc.strerror or exc}")
        if len(raw) > MAX_CONFIG_BYTES:
            parser.error(f"--hf-config {args.hf_config} is larger than {MAX_CONFIG_BYTES} bytes")
        try:
            config = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            parser.error(f"--hf-config {args.hf_config} is not JSON: {str(exc)[:200]}")
        return Model.from_hf_config(config, **overrides)
    except (ValueError, TypeError) as exc:
        parser.error(f"the model: {exc}")


def _layout(parser: argparse.ArgumentParser, words: list[str]) -> Layout:
    pairs: dict[str, int] = {}
    for word in words:
        name, sep, size = word.partition("=")
        if not sep or name not in ROLES:
            parser.error(f"dims are role=size words with roles {', '.join(ROLES)}; got {word!r}")
        if not _DIGITS.fullmatch(size) or int(size) < 1:
            parser.error(f"size of {name!r} must be a positive integer in digits 0-9, got {size!r}")
        if name in pairs:
            parser.error(f"dim {name!r} is given twice")
        pairs[name] = int(size)
    try:
        return Layout(**pairs)
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))


def run(args: argparse.Namespace) -> int:
    """Run ``cost`` with parsed ``args`` (from the parser :func:`add_parser` made).

    Args:
        args: the namespace.

    Returns:
        the exit status (0; a bad value exits with 2 through the parser).

    >>> parser = argparse.ArgumentParser(prog="meshgroups")
    >>> _ = add_parser(parser.add_subparsers())
    >>> run(parser.parse_args(["cost", "tp=2", "--model", "tiny"]))
    Layout(tp=2)  model tiny  no topology
    ...
    0
    """
    parser: argparse.ArgumentParser = args.cost_parser
    if bool(args.dims) == (args.world is not None):
        parser.error("give either dims (one layout) or --world N (every layout), not both or neither")
    model = _model(parser, args)
    topology = None
    if args.topology is not None:
        try:
            topology = Topology.parse(args.topology)
        except (ValueError, TypeError) as exc:
            parser.error(f"--topology {args.topology!r}: {exc}")
    try:
        precision = Precision(
            params=args.params_dtype,
            grads=args.grads_dtype,
            master=None if args.no_master else "float32",
            moments=args.moments_dtype,
            activations=args.activations_dtype,
        )
        plan = Parallelism(
            sequence_parallel=args.sequence_parallel,
            schedule=args.schedule,
            virtual_stages=args.virtual_stages,
            micro_batches=args.micro_batches,
            recompute=args.recompute,
            precision=precision,
        )
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    budget = None if args.budget_gib is None else args.budget_gib * 2**30
    if args.world is None:
        layout = _layout(parser, args.dims)
        try:
            report = cost_report(model, layout, topology, plan)
        except (ValueError, TypeError) as exc:
            parser.error(str(exc))
        if budget is not None:
            report["budget"] = budget
            report["fits"] = report["peak_memory"]["total"] <= budget  # type: ignore[index]
        if args.json:
            print(json.dumps(report, indent=1))
        else:
            print(_text(report))
        return 0
    try:
        found = enumerate_layouts(model, args.world, topology, plan, budget=budget)
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    found = sort_candidates(found, args.sort)
    if args.json:
        print(json.dumps({"model": model.name, "world": args.world, "order": args.sort,
                          "candidates": [c.to_dict() for c in found]}, indent=1))  # fmt: skip
        return 0
    fits = sum(c.fits for c in found)
    print(f"{len(found)} layouts of {args.world} ranks admit {model.name or 'the model'}"
          + (f"; {fits} fit {args.budget_gib:g} GiB per rank" if budget is not None else ""))  # fmt: skip
    print(
        f"ordered by {'bytes over the slowest level crossed (not step time)' if args.sort == 'slow' else args.sort}; bytes are per step, all ranks\n"
    )
    print(table(found, limit=args.top))
    if len(found) > args.top:
        print(f"(first {args.top} of {len(found)}; --top N shows more)")
    return 0


def _text(report: dict[str, Any]) -> str:
    peak = report["peak_memory"]
    lines = [
        f"{report['layout']}  model {report['model']}  {report['topology'] or 'no topology'}",
        f"peak memory per rank: {format_bytes(peak['total'])} (params {format_bytes(peak['params'])}, "
        f"grads {format_bytes(peak['grads'])}, master {format_bytes(peak['master'])}, "
        f"optimizer {format_bytes(peak['optimizer'])}, activations {format_bytes(peak['activations'])})",
        f"pipeline bubble: {report['bubble_fraction']:.3f} of the step",
    ]
    if "fits" in report:
        lines.append(f"fits {format_bytes(report['budget'])} per rank: {'yes' if report['fits'] else 'no'}")
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
