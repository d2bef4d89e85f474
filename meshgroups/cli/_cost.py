"""``python -m meshgroups cost``: what a layout costs, or every layout of a world ranked.

    python -m meshgroups cost tp=8 dp_shard=4 pp=2 --model llama3-8b --node 8
    python -m meshgroups cost --world 64 --model mixtral-8x7b --topology node=8,domain=32 --budget-gib 80
    python -m meshgroups cost --world 16 --hf-config config.json --seq-len 4096 --json
    python -m meshgroups cost dp_shard=8 --model llama3-8b --precision fsdp2 --recompute op \
        --separate-projections --budget-gib 95 --allocator-overhead 1.2
    python -m meshgroups cost dp=4 tp=2 --roles dp=dp_shard --model tiny

Dims are ``name=size`` words, outermost first, as in every subcommand; a dim named like a role
(pp, dp_replicate, dp_shard, ep, cp, tp) plays it, ``dp`` plays ``dp_replicate`` (parameters
replicated, as in Megatron and DDP), and ``--roles name=role`` gives any other dim its role.
The ``--world`` table is ordered by ``--sort`` (default: the pipeline bubble, then the bytes over
the slowest level crossed), says so in its header, and is not a step-time prediction. Every bad
value exits with status 2 and one ``error:`` line naming it and the rule. The CLI wires this in
with :func:`add_parser` and :func:`run`::

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

from meshgroups.cli._args import key_values, parse_dims
from meshgroups.cli._conventions import MODEL_HELP, add_node, model_name, node_of, print_json, topology_of
from meshgroups.cli._cost_text import header, text
from meshgroups.cost import (
    ATTENTION,
    DTYPE_BYTES,
    RECOMPUTE,
    ROLES,
    SORT_KEYS,
    SORT_WORDS,
    Parallelism,
    Precision,
    cost_report,
    enumerate_layouts,
    sort_candidates,
    table,
)
from meshgroups.layout import Layout
from meshgroups.models import Model, preset

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


def _overhead(text: str) -> float:
    if not _NUMBER.fullmatch(text) or not 1 <= float(text) <= 16:
        raise argparse.ArgumentTypeError(
            f"--allocator-overhead must be a decimal number in 1..16 (reserved / allocated bytes), got {text!r}"
        )
    return float(text)


def _split(text: str) -> tuple[int, ...]:
    parts = text.split(",")
    if not all(_DIGITS.fullmatch(p) for p in parts) or len(parts) > 1 << 12:
        raise argparse.ArgumentTypeError(
            f"--layers-per-stage must be layer counts in digits 0-9 separated by commas, got {text!r}"
        )
    return tuple(int(p) for p in parts)


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
        description="What a layout costs for a model: per-rank memory, the pipeline bubble and each "
        "collective's bytes per topology level; with --world, every layout the model admits, in the "
        "order --sort names. None of it is a step-time prediction (compute, overlap and link speeds "
        "are not modelled).",
    )
    p.add_argument(
        "dims",
        nargs="*",
        help="name=size words, outermost first; a dim named like a role plays it (roles: "
        + ", ".join(ROLES)
        + "), dp plays dp_replicate",
    )
    p.add_argument(
        "--roles",
        metavar="NAME=ROLE,...",
        help="the role of each dim not named like one, e.g. dp=dp_shard (default: dp=dp_replicate)",
    )
    p.add_argument(
        "--world", type=_count("--world", MAX_CLI_WORLD), help="enumerate every layout of this many ranks"
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", metavar="MODEL", help=MODEL_HELP)
    source.add_argument("--hf-config", metavar="FILE", help="a Hugging Face config.json")
    add_node(p, "bytes are counted per level, inside a node and beyond")
    p.add_argument(
        "--topology",
        help="levels of consecutive ranks, e.g. node=8,domain=32; --node names the first (default: one level)",
    )
    p.add_argument(
        "--seq-len", type=_count("--seq-len", 1 << 24), help="tokens per sample (default: the model's)"
    )
    p.add_argument(
        "--micro-batch",
        type=_count("--micro-batch", 1 << 16),
        help="samples per micro-batch (default: the model's, 1)",
    )
    p.add_argument(
        "--micro-batches",
        type=_count("--micro-batches", 1 << 16),
        default=1,
        help="micro-batches per step: gradient accumulation, the pipeline's m (default 1)",
    )
    p.add_argument(
        "--separate-projections",
        action="store_true",
        help="q, k, v and the MLP's gate and up as separate matrices (torchtitan, Hugging Face); "
        "default: fused (Megatron)",
    )
    p.add_argument(
        "--recompute",
        choices=RECOMPUTE,
        default="none",
        help="what layers keep for backward: none, selective (Megatron's: the attention core), op "
        "(torchtitan's op-level policy), layer (every --recompute-every-th layer whole), full (default none)",
    )
    p.add_argument(
        "--recompute-every",
        type=_count("--recompute-every", 1 << 16),
        default=2,
        help="the layer policy's k: layers k, 2k, ... recomputed (default 2)",
    )
    p.add_argument(
        "--attention",
        choices=ATTENTION,
        default="flash",
        help="attention kernel: flash (FlashAttention/SDPA, no s² kept) or eager (default flash)",
    )
    p.add_argument(
        "--sequence-parallel", action="store_true", help="tp with sequence parallelism (default off)"
    )
    p.add_argument(
        "--no-vocab-parallel",
        action="store_true",
        help="the embedding, head and loss replicated over tp (default: cut along the vocabulary)",
    )
    p.add_argument(
        "--schedule", choices=("1f1b", "interleaved"), default="1f1b", help="pipeline schedule (default 1f1b)"
    )
    p.add_argument(
        "--virtual-stages",
        type=_count("--virtual-stages", 1 << 10),
        default=1,
        help="model chunks per pipeline stage, interleaved only (default 1)",
    )
    p.add_argument(
        "--layers-per-stage",
        type=_split,
        metavar="N,N,...",
        help="layers of each model chunk in pipeline order, pp × virtual stages entries "
        "(default: as even as the layers allow)",
    )
    p.add_argument(
        "--zero",
        type=int,
        choices=(0, 1, 2),
        default=0,
        help="optimizer sharding over the data-parallel dims FSDP does not shard: 1 the master copy "
        "and moments (Megatron's distributed optimizer), 2 the gradients too (default 0)",
    )
    p.add_argument(
        "--no-reshard-after-forward",
        action="store_true",
        help="FSDP2 keeps each block gathered from forward to backward (default: reshard)",
    )
    p.add_argument(
        "--precision",
        choices=("megatron", "fsdp2", "custom"),
        default="custom",
        help="megatron: bf16 params, fp32 grads, master and moments; fsdp2: fp32 stored, bf16 gathered "
        "and computed, fp32 reduced, no master; custom: the --*-dtype options (default custom)",
    )
    for name, default, what in (
        ("params", "bfloat16", "parameters as stored"),
        ("grads", "float32", "gradients as kept"),
        ("moments", "float32", "Adam's moments"),
        ("activations", "bfloat16", "activations kept and sent"),
    ):
        p.add_argument(
            f"--{name}-dtype",
            choices=sorted(DTYPE_BYTES),
            default=default,
            help=f"dtype of the {what} (default {default}; --precision custom)",
        )
    p.add_argument(
        "--compute-dtype",
        choices=sorted(DTYPE_BYTES),
        help="dtype parameters are gathered and computed in (FSDP2's param_dtype; default: --params-dtype)",
    )
    p.add_argument(
        "--reduce-dtype",
        choices=sorted(DTYPE_BYTES),
        help="dtype gradients are reduced in (FSDP2's reduce_dtype; default: --grads-dtype)",
    )
    p.add_argument(
        "--no-master", action="store_true", help="no fp32 master copy of the parameters (default: one)"
    )
    p.add_argument(
        "--budget-gib",
        type=_gib,
        help="memory per rank, GiB: the fit verdict (with --world: which layouts fit)",
    )
    p.add_argument(
        "--allocator-overhead",
        type=_overhead,
        default=1.0,
        help="reserved / allocated bytes the fit verdict assumes; the prediction is peak allocated "
        "(default 1.0: allocated compared as it is)",
    )
    p.add_argument(
        "--sort",
        choices=SORT_KEYS,
        default="bubble",
        help="order of the --world table: bubble (the pipeline bubble, then bytes over the slowest "
        "level crossed), slow (those bytes first), memory or layout (default bubble)",
    )
    p.add_argument(
        "--top", type=_count("--top", 1 << 20), default=20, help="rows of the --world table (default 20)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(func=run, cost_parser=p)
    return p


def _model(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Model:
    overrides: dict[str, Any] = {
        k: v for k, v in (("seq_len", args.seq_len), ("micro_batch", args.micro_batch)) if v is not None
    }
    if args.separate_projections:
        overrides["fused_projections"] = False
    try:
        if args.model:
            return preset(model_name(parser, args.model)).with_(**overrides)
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


def _layout(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[Layout, dict[str, str]]:
    """The layout of the dims and each dim's role (only those not named like their role)."""
    roles = key_values(parser, "--roles", args.roles, "dp=dp_shard")
    for name, role in roles.items():
        if role not in ROLES:
            parser.error(f"--roles {name}={role}: unknown role; roles are {', '.join(ROLES)}")
    pairs = parse_dims(parser, args.dims, any_names=True)
    for name, size in pairs:
        if size < 1:
            parser.error(f"size of {name!r} must be a positive integer, got {size}")
        if name not in ROLES and name not in roles:
            if name != "dp":
                parser.error(
                    f"dim {name!r} plays no role: name it after one ({', '.join(ROLES)}) "
                    f"or give it one with --roles {name}=ROLE"
                )
            roles["dp"] = "dp_replicate"
    unknown = sorted(set(roles) - {n for n, _ in pairs})
    if unknown:
        parser.error(f"--roles names {unknown[0]!r}, which is not among the dims")
    try:
        return Layout(pairs), {n: r for n, r in roles.items() if n != r}
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
    topology = topology_of(parser, node_of(parser, args), args.topology)
    layout, roles = _layout(parser, args) if args.dims else (None, {})
    try:
        plan = Parallelism(
            roles=roles,
            sequence_parallel=args.sequence_parallel,
            schedule=args.schedule,
            virtual_stages=args.virtual_stages,
            micro_batches=args.micro_batches,
            recompute=args.recompute,
            recompute_every=args.recompute_every,
            attention=args.attention,
            vocab_parallel=not args.no_vocab_parallel,
            zero=args.zero,
            reshard_after_forward=not args.no_reshard_after_forward,
            layers_per_stage=args.layers_per_stage,
            precision=_precision(args),
        )
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    budget = None if args.budget_gib is None else args.budget_gib * 2**30
    overhead = args.allocator_overhead
    if layout is not None:
        try:
            report = cost_report(model, layout, topology, plan, budget, overhead)
        except (ValueError, TypeError) as exc:
            parser.error(str(exc))
        if args.json:
            print_json({**report, "dim_roles": roles} if roles else report)
        else:
            print(text(report, roles))
        return 0
    try:
        found = enumerate_layouts(
            model, args.world, topology, plan, budget=budget, allocator_overhead=overhead
        )
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    found = sort_candidates(found, args.sort)
    if args.json:
        print_json({"model": model.name, "world": args.world, "order": args.sort, "order_means": SORT_WORDS[args.sort],
                    "micro_batches": args.micro_batches, "not_a_step_time_prediction": True,
                    "candidates": [c.to_dict() for c in found]})  # fmt: skip
        return 0
    print(header(model, args, found, budget, overhead))
    print(table(found, limit=args.top))
    if len(found) > args.top:
        print(f"(first {args.top} of {len(found)}; --top N shows more)")
    return 0


def _precision(args: argparse.Namespace) -> Precision:
    if args.precision == "fsdp2":
        return Precision.fsdp2()
    if args.precision == "megatron":
        return Precision.megatron()
    return Precision(
        params=args.params_dtype,
        grads=args.grads_dtype,
        master=None if args.no_master else "float32",
        moments=args.moments_dtype,
        activations=args.activations_dtype,
        compute=args.compute_dtype,
        reduce=args.reduce_dtype,
    )
