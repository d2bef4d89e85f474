"""``python -m meshgroups transfer``: what a weight transfer between two layouts moves, per node
and per rank, from the plan (numpy only, no processes)::

    python -m meshgroups transfer --src pp=2 tp=4 --dst tp=8 --dst-offset 8 --node 8
    python -m meshgroups transfer --src dp_shard=4 tp=2 --dst dp=2 tp=4 --model llama3-8b --json
    python -m meshgroups transfer --src tp=4 --dst tp=2 --dst-offset 4 --weights weights.json
    python -m meshgroups transfer --src dp_shard=4 tp=2 --dst tp=4 --dst-offset 8 --name-map vllm --cast bfloat16

``--src`` and ``--dst`` take ``name=size`` words, outermost first, like every subcommand's dims
(the old ``--src pp=2,tp=4`` still works, with a warning). Models are the package's presets
(:data:`meshgroups.models.PRESETS`, the names ``cost`` takes), placed per layout (``tp`` like
Megatron, ``pp`` stages, ``ep``/``etp`` experts, ``dp_shard``/``fsdp`` FSDP2 after ``tp``; other
dims replicate). ``--weights FILE`` reads ``{"src": [...], "dst": [...]}`` instead, each
weight as ``Weight.to_dict`` writes it: ``{"name", "shape", "dtype", "placements": {dim:
"Shard(0)" | "Replicate()"}, "stage": [dim, i], "shard_order": [dims]}`` (all but name and
shape optional). ``--name-map`` maps rollout names to trainer weights (fusions, splits, ties):
a JSON file as ``NameMap.save`` writes it, or a ready-made map by name (``vllm``,
``hf-to-megatron``, ``megatron-to-hf``; with ``--model`` the two sides are then the preset in
those conventions' names); the fused weights are listed with their sources and one rank's
buffer. ``--cast DTYPE`` casts at the sender to the rollout's dtype (the preset's rollout in
DTYPE; ``--src-dtype`` sets the trainer preset's, e.g. float32 master weights). Bad input
exits with status 2.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from meshgroups.cli._args import parse_dims
from meshgroups.cli._conventions import MODEL_HELP, add_node, dim_words, model_name, node_of, print_json
from meshgroups.layout import Layout, Topology
from meshgroups.transfer import (
    PRESET_MAPS,
    NameMap,
    Weight,
    model_config,
    model_weights,
    plan_transfer,
    preset_map,
)

#: Per ready-made map: the conventions of the trainer's and the rollout's names.
MAP_NAMES = {
    "vllm": ("hf", "vllm"),
    "hf-to-megatron": ("hf", "megatron"),
    "megatron-to-hf": ("megatron", "hf"),
}

#: Without --full, the per-rank table shows this many ranks (the busiest).
SHOWN_RANKS = 32


def read_weights(path: str) -> tuple[list[Weight], list[Weight]]:
    """``(src weights, dst weights)`` from a JSON file ``{"src": [...], "dst": [...]}``."""
    with open(path) as f:
        data = json.load(f)
    if (
        not isinstance(data, dict)
        or not isinstance(data.get("src"), list)
        or not isinstance(data.get("dst"), list)
    ):
        raise ValueError(f'--weights {path}: expected an object {{"src": [...], "dst": [...]}}')
    out: tuple[list[Weight], list[Weight]] = ([], [])
    for side, weights in zip(("src", "dst"), out):
        for item in data[side]:
            if not isinstance(item, dict) or "name" not in item or "shape" not in item:
                raise ValueError(
                    f"--weights {path} {side}: each weight needs 'name' and 'shape', got {item!r}"
                )
            weights.append(Weight.from_dict(item))
    return out


def _bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{int(n)} B"


def _table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [list(map(str, header))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells)


def report(plan: Any, src: Layout, dst: Layout, node: int | None) -> dict[str, Any]:
    """The summary as data: totals, per node, per rank (every rank of either layout)."""
    s = plan.stats
    ranks = np.union1d(src.grid.ravel(), dst.grid.ravel())
    per_rank = []
    for r in ranks.tolist():
        role = "src+dst" if r in src and r in dst else ("src" if r in src else "dst")
        per_rank.append(
            {
                "rank": r,
                "role": role,
                "node": r // node if node else r,
                "sent": int(s.send[r]),
                "received": int(s.recv[r]),
                "sent_cross_node": int(s.send_cross[r]),
                "received_cross_node": int(s.recv_cross[r]),
                "messages_sent": int(s.n_send[r]),
                "messages_received": int(s.n_recv[r]),
                "forwards_sent": int(s.n_send_step1[r]),
            }
        )
    nodes: dict[int, dict[str, int]] = {}
    for row in per_rank:
        agg = nodes.setdefault(row["node"], {"node": row["node"], "ranks": 0, "sent": 0, "received": 0})
        agg["ranks"] += 1
        for key in ("sent", "received", "sent_cross_node", "received_cross_node"):
            agg[key] = agg.get(key, 0) + row[key]
    return {
        "src": src.to_dict(),
        "dst": dst.to_dict(),
        "ranks_per_node": node,
        "messages": int(plan.n_messages),
        "local_copies": int(plan.n_local),
        "bytes_sent": int(s.send.sum()),
        "cross_node_bytes": int(plan.cross_node_bytes),
        "cross_node_lower_bound": plan.cross_node_lower_bound,
        "busiest_send_bytes": int(plan.busiest_send_bytes),
        "ideal_send_bytes": float(plan.ideal_send_bytes),
        "send_lower_bound": float(plan.send_lower_bound),
        "busiest_send_bound": float(plan.busiest_send_bound),
        "per_node": list(nodes.values()) if node else [],
        "per_rank": per_rank,
    }


def fused(plan: Any, limit: int | None) -> list[dict[str, Any]]:
    """The fused (or split, interleaved) rollout weights of a mapped plan: their sources along
    the axis and, on the first rank that holds one, where each lands in its local buffer."""
    if plan.mapping is None:
        return []
    out = []
    for name in plan.mapping.fused()[:limit]:
        links = plan.mapping.sources(name)
        ranks = plan.dst.grid.ravel().tolist()
        rank = next((r for r in ranks if plan.mapping.buffer_shape(name, r) is not None), None)
        local = []
        for ln in links:
            box = ln.dst_local(rank) if rank is not None else None
            if box is not None and ln.axis is not None:
                local.append({"source": ln.source, "rows": list(box[ln.axis])})
        dw = links[0].parts[0]
        out.append(
            {
                "rollout": name,
                "dtype": links[0].wire_dtype,
                "axis": links[0].axis,
                "parts_sharded_separately": len(links[0].parts) > 1,
                "sources": [
                    {
                        "source": ln.source,
                        "start": ln.src_start,
                        "stop": ln.src_start + ln.dst.shape[ln.axis or 0],
                    }
                    for ln in links
                ],
                "rank": rank,
                "buffer_shape": None if rank is None else list(plan.mapping.buffer_shape(name, rank)),
                "local": local,
                "placements": {d: repr(p) for d, p in dw.placements.items()},
            }
        )
    return out


def _print_fused(data: dict[str, Any]) -> None:
    if not data.get("fused"):
        return
    print(f"\nfused rollout weights ({data['n_fused']}, {len(data['fused'])} shown; --full for all)")
    for f in data["fused"]:
        how = "parts sharded separately" if f["parts_sharded_separately"] else "sharded as one tensor"
        print(f"  {f['rollout']} {f['dtype']} axis {f['axis']}, {how}")
        print("    = " + " ‖ ".join(f"{s['source']}[{s['start']}:{s['stop']}]" for s in f["sources"]))
        if f["rank"] is not None:
            rows = ", ".join(
                f"{a}:{b} <- {s}" for s, (a, b) in ((x["source"], x["rows"]) for x in f["local"])
            )
            print(f"    rank {f['rank']} buffer {tuple(f['buffer_shape'])}: {rows}")
    if data.get("unused"):
        print(f"unused trainer weights (allowed): {', '.join(data['unused'])}")


def _print(data: dict[str, Any], plan: Any, n_weights: int, total: int, full: bool) -> None:
    print(f"src {Layout.from_dict(data['src'])!r} -> dst {Layout.from_dict(data['dst'])!r}")
    print(f"{n_weights} weights, {_bytes(total)} ({total:,} bytes)")
    print(plan.summary())
    if data["per_node"]:
        print("\nper node")
        node_rows: list[tuple[object, ...]] = [
            (n["node"], n["ranks"], _bytes(n["sent"]), _bytes(n["received"]), _bytes(n["sent_cross_node"]),
             _bytes(n["received_cross_node"]))
            for n in data["per_node"]
        ]  # fmt: skip
        print(_table(("node", "ranks", "sent", "received", "sent out", "received in"), node_rows))
    per_rank = data["per_rank"]
    shown = per_rank
    if not full and len(per_rank) > SHOWN_RANKS:
        shown = sorted(per_rank, key=lambda r: -(r["sent"] + r["received"]))[:SHOWN_RANKS]
        shown.sort(key=lambda r: r["rank"])
    print(
        f"\nper rank{'' if shown is per_rank else f' (the {len(shown)} busiest of {len(per_rank)}; --full for all)'}"
    )
    rows: list[tuple[object, ...]] = [
        (r["rank"], r["role"], r["node"], _bytes(r["sent"]), _bytes(r["received"]), r["messages_sent"],
         r["messages_received"], r["forwards_sent"])
        for r in shown
    ]  # fmt: skip
    print(_table(("rank", "role", "node", "sent", "received", "msgs out", "msgs in", "forwards"), rows))
    _print_fused(data)


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Run ``transfer`` for parsed ``args``; bad input exits 2 through ``parser.error``."""
    src_pairs = parse_dims(parser, dim_words(parser, args.src, "--src"), args.any_names)
    dst_pairs = parse_dims(parser, dim_words(parser, args.dst, "--dst"), args.any_names)
    args.model = model_name(parser, args.model)
    args.ranks_per_node = node_of(parser, args)
    try:
        src = Layout(src_pairs, rank_offset=args.src_offset)
        dst = Layout(dst_pairs, rank_offset=args.dst_offset)
        name_map: NameMap | None = None
        src_names, dst_names = MAP_NAMES.get(args.name_map or "", ("preset", "preset"))
        if args.name_map in PRESET_MAPS:
            tp = src.size("tp") if "tp" in src.names else 1
            name_map = preset_map(args.name_map, model_config(args.model), trainer_tp=tp)
        elif args.name_map:
            name_map = NameMap.load(args.name_map)
        if args.weights:
            src_w, dst_w = read_weights(args.weights)
        else:
            src_w = model_weights(args.model, src, names=src_names, dtype=args.src_dtype)
            dst_w = model_weights(args.model, dst, names=dst_names, dtype=args.cast)
        topology = Topology(node=args.ranks_per_node) if args.ranks_per_node else None
        mapped = {"name_map": name_map or {}, "cast": args.cast, "allow_unused": args.allow_unused}
        plan = plan_transfer(
            src, src_w, dst, dst_w, topology=topology, min_part_bytes=args.min_part_bytes,
            **(mapped if name_map is not None or args.cast or args.allow_unused else {}),
        )  # fmt: skip
    except OSError as exc:
        what = f"--weights {args.weights}" if args.weights else f"--name-map {args.name_map}"
        parser.error(f"cannot read {what}: {exc.strerror or exc}")
    except json.JSONDecodeError as exc:
        parser.error(
            f"{'--weights ' + args.weights if args.weights else '--name-map ' + args.name_map} is not JSON: {exc}"
        )
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    data = report(plan, src, dst, args.ranks_per_node)
    if plan.mapping is not None:
        data["n_fused"] = len(plan.mapping.fused())
        data["fused"] = fused(plan, None if args.full or args.json else 4)
        data["unused"] = list(plan.mapping.unused)
    if args.json:
        print_json(data)
    else:
        _print(data, plan, len(dst_w), sum(w.nbytes for w in dst_w), args.full)
    return 0


def register(sub: Any) -> argparse.ArgumentParser:
    """Add the ``transfer`` subcommand to ``cli.py``'s subparsers; returns its parser."""
    p = sub.add_parser("transfer", help="plan a weight transfer between two layouts and summarise it")
    p.add_argument(
        "--src",
        nargs="+",
        required=True,
        metavar="NAME=SIZE",
        help="trainer dims, outermost first: pp=2 tp=4",
    )
    p.add_argument(
        "--dst", nargs="+", required=True, metavar="NAME=SIZE", help="rollout dims, outermost first: tp=8"
    )
    for side in ("src", "dst"):
        p.add_argument(
            f"--{side}-offset", type=_offset, default=0, help=f"first rank of the {side} layout (default 0)"
        )
    add_node(p, "bytes that leave a node are counted apart and kept to the least possible")
    p.add_argument("--any-names", action="store_true", help="accept dim names that look like typos")
    p.add_argument(
        "--min-part-bytes",
        type=_positive,
        default=1 << 16,
        help="cut pieces on multiples of this many bytes to balance senders (default 65536)",
    )
    p.add_argument("--model", default="small", metavar="MODEL", help=f"{MODEL_HELP} (default small)")
    p.add_argument("--weights", metavar="FILE", help='JSON {"src": [...], "dst": [...]} instead of --model')
    p.add_argument(
        "--name-map",
        metavar="FILE|NAME",
        help=f"rollout name -> trainer weights: a JSON file, or one of {', '.join(PRESET_MAPS)}",
    )
    p.add_argument(
        "--cast", metavar="DTYPE", help="cast at the sender to the rollout's dtype (bfloat16, ...)"
    )
    p.add_argument("--src-dtype", metavar="DTYPE", help="the trainer preset's dtype (default: the preset's)")
    p.add_argument(
        "--allow-unused",
        action="store_true",
        help="allow trainer weights no rollout weight reads, and list them",
    )
    p.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    p.add_argument("--full", action="store_true", help="list every rank, however many")
    p.set_defaults(run=run, parser=p)
    return p


def _offset(value: str) -> int:
    if not value.isdigit():
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {value!r}")
    return int(value)


def _positive(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value!r}")
    return int(value)


__all__ = ["fused", "read_weights", "register", "report"]
