"""The memory accounting against real steps on a bigger sweep than the test: a larger model and
more layouts and policies, each rank's measured peak by category beside the prediction.

Run: ``python benchmarks/bench_cost_memory.py [--layers 6] [--hidden 256] [--vocab 8192]``.
Spawns one world of 4 gloo processes (``tests/support/dist.py``), trains the test transformer
(``tests/support/mem_harness.py``) once per configuration, and prints a Markdown table: per
configuration, the worst rank's measured peak, the prediction, their ratio, and the largest
category difference as a share of the peak. Takes a few minutes on two cores.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from meshgroups import Layout
from meshgroups.cost import Model, rank_memory
from tests.cost.test_cost_memory import plan_of
from tests.support.dist import run

CATEGORIES = ("params", "grads", "optimizer", "activations", "loss", "transient")

POLICIES = ("none", "selective", "op", "layer", "full")


def configs() -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = []
    for policy in POLICIES:
        out.append((f"FSDP2 {policy}", {"sizes": {"dp_shard": 4}, "recompute": policy}))
        out.append((f"TP+SP {policy}", {"sizes": {"dp_shard": 2, "tp": 2}, "sp": True, "recompute": policy}))
        out.append(
            (
                f"CP {policy}",
                {"sizes": {"dp_shard": 2, "cp": 2}, "recompute": policy, "spec": {"seq_len": 512}},
            )
        )
    out += [
        ("HSDP, 2 micro-batches", {"sizes": {"dp_replicate": 2, "dp_shard": 2}, "micro_batches": 2}),
        ("eager", {"sizes": {"dp_shard": 4}, "attention": "eager"}),
        ("1F1B, 8 micro-batches", {"sizes": {"pp": 4}, "micro_batches": 8}),
        ("interleaved, 8 micro-batches", {"sizes": {"pp": 4}, "micro_batches": 8, "schedule": "interleaved",
                                          "virtual_stages": 2, "spec": {"layers": 8}}),
    ]  # fmt: skip
    return out


def worker(
    rank: int, world: int, spec: Model, cfgs: list[tuple[str, dict[str, Any]]]
) -> list[dict[str, Any]]:
    from tests.support.mem_harness import measure

    return [measure(spec.with_(**cfg.get("spec", {})), cfg, rank) for _, cfg in cfgs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    args = parser.parse_args()
    spec = Model(
        layers=args.layers, hidden=args.hidden, heads=8, kv_heads=2, ffn=3 * args.hidden, vocab=args.vocab,
        gated_mlp=True, seq_len=256, micro_batch=2,
    )  # fmt: skip
    cfgs = configs()
    results = run(worker, 4, spec, cfgs, timeout=3600, pg_timeout=600)
    print(f"model: {spec}\n")
    print("| configuration | measured peak (MiB) | predicted (MiB) | ratio | worst category / peak | at |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for i, (label, cfg) in enumerate(cfgs):
        model = spec.with_(**cfg.get("spec", {}))
        rows = []
        for rank in range(4):
            measured = results[rank][i]
            predicted = rank_memory(model, Layout(**cfg["sizes"]), rank, plan_of(cfg))
            got = dict(measured["breakdown"])
            got["activations"] = (
                got.get("activations", 0) + got.pop("other", 0) + got.pop("pipeline buffers", 0)
            )
            worst = max(abs(getattr(predicted, k) - got.get(k, 0)) for k in CATEGORIES)
            rows.append((measured["peak"], predicted.total, worst / measured["peak"], predicted.phase))
        peak, pred, worst, phase = max(rows)
        print(
            f"| {label} | {peak / 2**20:.2f} | {pred / 2**20:.2f} | {pred / peak:.4f} | {worst:.2%} | {phase} |"
        )


if __name__ == "__main__":
    main()
