"""Weight transfer between colocated layouts (trainer and rollout on the same ranks): the plan's
busiest sender against the issue's ideal and the achievable bound.

Run: ``OMP_NUM_THREADS=1 python benchmarks/bench_transfer_colocated.py [--world 1024]``. Prints
Markdown. The model is ``model_weights("llama-70b", layout)`` (the public preset: tp Megatron-
style, pp stages, ``dp_shard`` FSDP2 after tp, other dims replicated), 8 ranks per node.

Colocated, a rollout rank holds part of what it needs (local copies) and fetches the rest from
trainer ranks on its own node, so the send load is set by which ranks hold what: the achievable
bound (``Plan.send_lower_bound``: the bytes only a group of holders has, over its ranks) can sit
above the issue's ideal (step-0 bytes over every rank holding data). The last columns say how
close the plan's busiest sender comes to each, and what the planner guarantees.
"""

from __future__ import annotations

import argparse

from meshgroups import Layout, Topology
from meshgroups.transfer import plan_transfer
from meshgroups.transfer._names.presets import model_weights


def cases(world: int) -> list[tuple[str, Layout, Layout]]:
    return [
        ("dp × tp=8 → dp × tp=4", Layout(dp=world // 8, tp=8), Layout(dp=world // 4, tp=4)),
        ("pp=8 × dp × tp=8 → dp × tp=4", Layout(pp=8, dp=world // 64, tp=8), Layout(dp=world // 4, tp=4)),
        ("dp_shard × tp=2 → dp × tp=4", Layout(dp_shard=world // 2, tp=2), Layout(dp=world // 4, tp=4)),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=1024)
    args = parser.parse_args()
    print(f"{args.world:,} ranks, 8 per node, llama-70b preset (bf16):\n")
    print(
        "| layouts | messages | local copies | busiest / ideal | busiest / achievable | guarantee / achievable |"
    )
    print("|---|---|---|---|---|---|")
    for name, src, dst in cases(args.world):
        plan = plan_transfer(
            src, model_weights("llama-70b", src), dst, model_weights("llama-70b", dst), Topology(node=8)
        )
        b = plan.busiest_send_bytes
        print(
            f"| {name} | {plan.n_messages:,} | {plan.n_local:,} | {b / plan.ideal_send_bytes:.3f} "
            f"| {b / plan.send_lower_bound:.3f} | {plan.busiest_send_bound / plan.send_lower_bound:.3f} |"
        )


if __name__ == "__main__":
    main()
