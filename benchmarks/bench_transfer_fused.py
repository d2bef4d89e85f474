"""Fused rollout names and fp32 -> bf16: the mapped plan against gather-then-fuse-then-send.

Run: ``python benchmarks/bench_transfer_fused.py [--worlds 1024,16384]``. Prints Markdown.

The job of ``bench_transfer.py`` (half the ranks train ``pp=8 × dp × tp=8``, half generate
``dp × tp=4``, 8 ranks per node) with the ``llama-70b`` preset in real names: the trainer holds
float32 weights in Hugging Face names (``q_proj``, ``k_proj``, ``v_proj``, ``gate_proj``,
``up_proj`` apart), the rollout bfloat16 in vLLM's (``qkv_proj`` = q ‖ k ‖ v with GQA sizes
8192 / 1024 / 1024 rows, ``gate_up_proj`` = gate ‖ up, each part sharded over tp=4 on its own).

Schemes (``bench_transfer.baselines``' closed forms on the fused bf16 weights, each fused
weight on the pipeline stage of its parts; every scheme casts before bytes leave a rank, so
they are compared at bf16 — gathering fp32 first would double their gather bytes):
- ``rank-0 broadcast``: trainer rank 0 gathers every shard, fuses, broadcasts each fused weight
  to every rollout rank (one ring);
- ``per-stage sender``: per stage one rank all-gathers its tp group's shards, fuses, and
  broadcasts through its stage's ring;
- ``all-gather + scatter``: every tp group all-gathers and fuses its stage; each rollout rank
  pulls its shard of each fused weight from one trainer rank of the stage (round-robin);
- ``plan``: ``plan_transfer(..., name_map=vllm_map(cfg), cast="bfloat16")``: each trainer piece
  goes straight into its place in the fused shard;
- ``plan, no fusion``: the same plan with the rollout in Hugging Face names (the unmapped
  problem, bf16): fusing costs the plan no byte;
- ``plan, fp32 on the wire``: the mapped plan to a float32 rollout (no cast): twice the bytes.

A second table times one rank's part (``rank=r``), each in a fresh process, mapped against the
unmapped problem (both sides in Hugging Face names, bf16), from 16k to 1M ranks: a rank's part
stays O(its shards) through the map.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from bench_transfer import NODE, PP, TP_ROLL, TP_TRAIN, Row, baselines, plan_row

from meshgroups import Layout, Topology
from meshgroups.transfer import Weight, plan_transfer
from meshgroups.transfer._names.conventions import vllm_map
from meshgroups.transfer._names.presets import model_config, model_weights

MODEL = "llama-70b"


def staged(rollout_w: list[Weight], trainer_w: list[Weight], name_map: object) -> list[Weight]:
    """The rollout weights, each on the pipeline stage of its (first) trainer part, as the
    baselines' closed forms read stages."""
    stage = {w.name: w.stage for w in trainer_w}
    nm = vllm_map([w.name for w in trainer_w])
    return [
        Weight(w.name, w.shape, w.dtype, w.placements, stage[nm.rule(w.name).sources[0]]) for w in rollout_w
    ]


def layouts(world: int) -> tuple[Layout, Layout]:
    half = world // 2
    return (
        Layout(pp=PP, dp=half // (PP * TP_TRAIN), tp=TP_TRAIN),
        Layout(dp=half // TP_ROLL, tp=TP_ROLL, rank_offset=half),
    )


def rank_part(world: int, mapped: bool, rank: int) -> None:
    """Print the CPU seconds of ``rank``'s part (run in a fresh process by :func:`fresh`)."""
    trainer, rollout = layouts(world)
    dtype = "float32" if mapped else "bfloat16"
    t_w = model_weights(MODEL, trainer, names="hf", dtype=dtype)
    r_w = model_weights(MODEL, rollout, names="vllm" if mapped else "hf", dtype="bfloat16")
    kw = {"name_map": vllm_map(model_config(MODEL)), "cast": "bfloat16"} if mapped else {}
    c0 = time.process_time()
    plan_transfer(trainer, t_w, rollout, r_w, Topology(node=NODE), rank=rank, **kw)  # type: ignore[arg-type]
    print(time.process_time() - c0)


def fresh(world: int, mapped: bool, rank: int) -> float:
    args = [sys.executable, __file__, "--rank-part", f"{world},{int(mapped)},{rank}"]
    return float(subprocess.run(args, check=True, capture_output=True, text=True).stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="1024,16384")
    parser.add_argument("--rank-worlds", default="16384,131072,1048576")
    parser.add_argument("--rank-part", help=argparse.SUPPRESS)  # world,mapped,rank: one timing
    args = parser.parse_args()
    if args.rank_part:
        world, mapped, rank = args.rank_part.split(",")
        rank_part(int(world), bool(int(mapped)), int(rank))
        return
    cfg = model_config(MODEL)
    nm = vllm_map(cfg)
    topo = Topology(node=NODE)
    print(
        f"{MODEL}: trainer float32 in HF names, rollout bfloat16 in vLLM's fused names; {NODE} ranks per node.\n"
    )
    print("| ranks | scheme | cross-node GB | busiest sender GB | messages | est. time (s) | vs plan |")
    print("|---|---|---|---|---|---|---|")
    for world in (int(x) for x in args.worlds.split(",")):
        trainer, rollout = layouts(world)
        t_w = model_weights(MODEL, trainer, names="hf", dtype="float32")
        r_w = model_weights(MODEL, rollout, names="vllm", dtype="bfloat16")
        t0 = time.process_time()
        plan = plan_transfer(trainer, t_w, rollout, r_w, topo, name_map=nm, cast="bfloat16")
        seconds = time.process_time() - t0
        assert plan.cross_node_bytes == plan.cross_node_lower_bound
        assert plan.mapping is not None and len(plan.mapping.fused()) == 2 * cfg.layers
        plain_r = model_weights(MODEL, rollout, names="hf", dtype="bfloat16")
        plain_t = model_weights(MODEL, trainer, names="hf", dtype="bfloat16")
        plain = plan_transfer(trainer, plain_t, rollout, plain_r, topo)
        wide_r = model_weights(MODEL, rollout, names="vllm", dtype="float32")
        wide = plan_transfer(trainer, t_w, rollout, wide_r, topo, name_map=nm)
        assert plan.cross_node_bytes == plain.cross_node_bytes == wide.cross_node_bytes // 2
        mine = plan_row(plan)
        rows: list[Row] = [*baselines(trainer, rollout, staged(r_w, t_w, nm)), mine]
        for label, p in (("plan, no fusion", plain), ("plan, fp32 on the wire", wide)):
            row = plan_row(p)
            row.scheme = label
            rows.append(row)
        for row in rows:
            print(
                f"| {world:,} | {row.scheme} | {row.cross / 1e9:,.0f} | {row.busiest / 1e9:,.1f} "
                f"| {row.messages:,.0f} | {row.seconds:,.2f} | {row.seconds / mine.seconds:,.1f}× |"
            )
        print(f"<!-- {world:,} ranks: the mapped plan took {seconds:.2f} CPU s -->")
    print()
    print("One rank's part alone, CPU seconds, each in a fresh process: mapped (fp32 HF names into")
    print("bf16 vLLM names) against unmapped (bf16 HF names on both sides):\n")
    print("| ranks | trainer rank 0: mapped | unmapped | rollout rank 0: mapped | unmapped |")
    print("|---|---|---|---|---|")
    for world in (int(x) for x in args.rank_worlds.split(",")):
        cells = [f"{fresh(world, m, rank):.3f}" for rank in (0, world // 2) for m in (True, False)]
        print(f"| {world:,} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
