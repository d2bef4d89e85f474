"""MoE weight transfer with block-fp8 rollouts: DeepSeek-V3- and Qwen3-235B-shaped presets.

Run: ``python benchmarks/bench_transfer_moe.py [--layers 2] [--gloo-steps 5]``. Prints Markdown.

The job: an ep trainer (Transformers 5 names: packed ``mlp.experts.gate_up_proj`` ``[E, 2I, H]``
and ``down_proj`` ``[E, H, I]`` sharded ``Shard(0)`` over ``ep``; attention, routers, norms,
shared experts and embeddings replicated over ``ep``, as data-parallel attention) in float32 →
an ep rollout in vLLM's names (``families.hf_to_vllm``: stacked ``experts.w13_weight`` /
``w2_weight`` in round-robin expert order, fused ``qkv_proj`` / ``fused_qkv_a_proj``), experts
block-fp8 (``float8_e4m3fn`` + 128 × 128 float32 ``_scale_inv``, quantized by the senders), the
rest bfloat16, 8 ranks per node. Every layer of a preset is alike, so ``--layers`` MoE layers
are planned in full and the figures are multiplied up to the model's layer count (the dense
first layers of DeepSeek-V3 and the embeddings are planned once, whole).

Printed per preset: cross-node bytes and the lower bound, the busiest trainer sender (step-0
bytes; rollout ranks forward inside their node besides) and its bound, messages per sync
unpacked (one per slice) and packed (one per peer, direction, step and bucket of 1 GiB), and the
link model's time (``bench_transfer.py``'s: NVLink 300 GB/s, NIC 50 GB/s per rank, 10 µs a
message). Then real gloo time per ``execute`` on two small MoE models (4 processes on this machine):
unpacked one bucket at a time (before), packed, and packed with the next bucket posted while the
last is unpacked (``overlap``), interleaved call by call. The notes' published figures are printed beside, labelled as such:
other systems, other hardware, not measured here.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np

from meshgroups import Layout, Topology
from meshgroups.transfer import Shard, Weight, plan_transfer
from meshgroups.transfer._names.families import hf_to_vllm
from meshgroups.transfer._names.quant import BlockFP8
from meshgroups.transfer._run.buckets import Buckets, parts_by_bucket

NODE = 8
INTRA_BW, INTER_BW, INTER_LAT = 300e9, 50e9, 10e-6
BUCKET = 1 << 30
Q8 = BlockFP8()


@dataclass(frozen=True)
class Preset:
    name: str
    model_type: str
    layers: int
    dense_layers: int  # leading dense layers (DeepSeek-V3's first_k_dense_replace)
    hidden: int
    experts: int
    moe_inter: int
    dense_inter: int
    vocab: int
    trainer_ep: int
    rollout_ep: int
    attn: dict[str, tuple[int, ...]]  # one layer's attention weights (HF names after "self_attn.")
    shared_inter: int = 0
    published: str = ""


def _dsv3() -> Preset:
    h = 7168
    attn = {
        "q_a_proj.weight": (1536, h), "q_a_layernorm.weight": (1536,), "q_b_proj.weight": (128 * 192, 1536),
        "kv_a_proj_with_mqa.weight": (512 + 64, h), "kv_a_layernorm.weight": (512,),
        "kv_b_proj.weight": (128 * 256, 512), "o_proj.weight": (h, 128 * 128),
    }  # fmt: skip
    return Preset(
        "DeepSeek-V3 (671B)", "deepseek_v3", 61, 3, h, 256, 2048, 18432, 129280, 64, 32, attn, 2048,
        "NeMo-RL reshard: DeepSeek-V3 PP16×EP16 → TP32×DP8 in 7.65–9.94 s (published, their hardware)",
    )  # fmt: skip


def _qwen235() -> Preset:
    h = 4096
    attn = {
        "q_proj.weight": (64 * 128, h), "k_proj.weight": (4 * 128, h), "v_proj.weight": (4 * 128, h),
        "o_proj.weight": (h, 64 * 128), "q_norm.weight": (128,), "k_norm.weight": (128,),
    }  # fmt: skip
    return Preset(
        "Qwen3-235B-A22B", "qwen3_moe", 94, 0, h, 128, 1536, 12288, 151936, 32, 16, attn, 0,
        "vLLM sharded RDT: Qwen3-235B 8→8 H100 in 3.3 s (published, their hardware)",
    )  # fmt: skip


def config(p: Preset, layers: int) -> dict[str, object]:
    return {
        "model_type": p.model_type, "num_hidden_layers": layers, "num_experts": p.experts,
        "n_routed_experts": p.experts, "moe_intermediate_size": p.moe_inter,
        "first_k_dense_replace": min(p.dense_layers, layers), "n_shared_experts": 1 if p.shared_inter else 0,
        "q_lora_rank": 1536 if p.model_type == "deepseek_v3" else None,
    }  # fmt: skip


def weights(p: Preset, layers: list[int], with_embed: bool) -> tuple[list[Weight], list[Weight]]:
    """Trainer (HF, float32) and rollout (vLLM, bf16 + fp8 experts) weights of ``layers``."""
    h, ep = p.hidden, {"ep": Shard(0)}
    t: dict[str, tuple[tuple[int, ...], dict]] = {}
    r: dict[str, tuple[tuple[int, ...], str, dict]] = {}
    if with_embed:
        for n in ("model.embed_tokens.weight", "lm_head.weight"):
            t[n] = ((p.vocab, h), {})
            r[n] = ((p.vocab, h), "bfloat16", {})
        t["model.norm.weight"] = ((h,), {})
        r["model.norm.weight"] = ((h,), "bfloat16", {})
    for i in layers:
        pre = f"model.layers.{i}"
        a = f"{pre}.self_attn"
        for n, s in p.attn.items():
            t[f"{a}.{n}"] = (s, {})
        if p.model_type == "deepseek_v3":
            qa, kva = p.attn["q_a_proj.weight"], p.attn["kv_a_proj_with_mqa.weight"]
            fused = {"fused_qkv_a_proj.weight": (qa[0] + kva[0], h)}
            keep = {
                n: s for n, s in p.attn.items() if n not in ("q_a_proj.weight", "kv_a_proj_with_mqa.weight")
            }
        else:
            q, k = p.attn["q_proj.weight"], p.attn["k_proj.weight"]
            fused = {"qkv_proj.weight": (q[0] + 2 * k[0], h)}
            keep = {
                n: s
                for n, s in p.attn.items()
                if n not in ("q_proj.weight", "k_proj.weight", "v_proj.weight")
            }
        for n, s in {**fused, **keep}.items():
            r[f"{a}.{n}"] = (s, "bfloat16", {})
        for n in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            t[f"{pre}.{n}"] = ((h,), {})
            r[f"{pre}.{n}"] = ((h,), "bfloat16", {})
        m = f"{pre}.mlp"
        if i < p.dense_layers:
            t.update(
                {
                    f"{m}.gate_proj.weight": ((p.dense_inter, h), {}),
                    f"{m}.up_proj.weight": ((p.dense_inter, h), {}),
                }
            )
            t[f"{m}.down_proj.weight"] = ((h, p.dense_inter), {})
            r[f"{m}.gate_up_proj.weight"] = ((2 * p.dense_inter, h), "bfloat16", {})
            r[f"{m}.down_proj.weight"] = ((h, p.dense_inter), "bfloat16", {})
            continue
        t[f"{m}.gate.weight"] = ((p.experts, h), {})
        r[f"{m}.gate.weight"] = ((p.experts, h), "bfloat16", {})
        if p.model_type == "deepseek_v3":
            t[f"{m}.gate.e_score_correction_bias"] = ((p.experts,), {})
            r[f"{m}.gate.e_score_correction_bias"] = ((p.experts,), "float32", {})
        if p.shared_inter:
            s = f"{m}.shared_experts"
            t[f"{s}.gate_proj.weight"] = ((p.shared_inter, h), {})
            t[f"{s}.up_proj.weight"] = ((p.shared_inter, h), {})
            t[f"{s}.down_proj.weight"] = ((h, p.shared_inter), {})
            r[f"{s}.gate_up_proj.weight"] = ((2 * p.shared_inter, h), "bfloat16", {})
            r[f"{s}.down_proj.weight"] = ((h, p.shared_inter), "bfloat16", {})
        e = f"{m}.experts"
        t[f"{e}.gate_up_proj"] = ((p.experts, 2 * p.moe_inter, h), ep)
        t[f"{e}.down_proj"] = ((p.experts, h, p.moe_inter), ep)
        for n, s in (
            (f"{e}.w13_weight", (p.experts, 2 * p.moe_inter, h)),
            (f"{e}.w2_weight", (p.experts, h, p.moe_inter)),
        ):
            r[n] = (s, "float8_e4m3fn", ep)
            r[Q8.scale_name(n)] = (Q8.scale_shape(s), "float32", ep)
    tw = [Weight(n, s, "float32", pl) for n, (s, pl) in t.items()]
    rw = [Weight(n, s, dt, pl) for n, (s, dt, pl) in r.items()]
    return tw, rw


def messages(plan: object) -> tuple[int, int]:
    """Point-to-point messages per sync over all ranks (sends + receives): one per slice, and
    packed (one per peer, direction, step and bucket)."""
    pairs = plan.weights  # type: ignore[attr-defined]
    buckets = Buckets.of([d for _, d in pairs], BUCKET)
    index = {d.name: i for i, (_, d) in enumerate(pairs)}
    msgs = [m for m in plan.messages if m.src != m.dst]  # type: ignore[attr-defined]
    unpacked = 2 * len(msgs)
    keys = set()
    for b, parts in parts_by_bucket(msgs, index, buckets).items():
        for part in parts:
            keys.add((b, part.step, part.src, part.dst))
    return unpacked, 2 * len(keys)


def link_seconds(plan: object, messages_per_rank: np.ndarray | None = None) -> float:
    s = plan.stats  # type: ignore[attr-defined]
    port = np.maximum.reduce([s.send_cross / INTER_BW, s.recv_cross / INTER_BW,
                              (s.send - s.send_cross) / INTRA_BW, (s.recv - s.recv_cross) / INTRA_BW])  # fmt: skip
    n = (s.n_send + s.n_recv) if messages_per_rank is None else messages_per_rank
    return float((port + n * INTER_LAT).max())


def preset_rows(p: Preset, layers: int) -> dict[str, object]:
    trainer = Layout(ep=p.trainer_ep)
    rollout = Layout(ep=p.rollout_ep, rank_offset=p.trainer_ep)
    topo = Topology(node=NODE)
    total: dict[str, float] = {}
    busiest = np.zeros(trainer.world_size + rollout.world_size)
    seconds = 0.0
    t0 = time.process_time()
    # the dense first layers and the embeddings once; the MoE layers planned `layers` at a time
    moe_first = p.dense_layers
    groups = [
        (list(range(p.dense_layers)), True, 1),
        (list(range(moe_first, moe_first + layers)), False, (p.layers - p.dense_layers) / layers),
    ]
    for ids, embed, scale in groups:
        if not ids and not embed:
            continue
        tw, rw = weights(p, ids, embed)
        cfg = config(p, max(ids, default=-1) + 1)
        nm = hf_to_vllm(cfg, ep=p.rollout_ep, placement="round_robin")
        nm = type(nm)({k: v for k, v in nm.items() if int(k.split(".")[2]) in ids})
        plan = plan_transfer(trainer, tw, rollout, rw, topo, name_map=nm, cast="bfloat16", quantize=Q8)
        un, pk = messages(plan)
        for k, v in (("cross", plan.cross_node_bytes), ("bound", plan.cross_node_lower_bound),
                     ("unpacked", un), ("packed", pk), ("bytes", sum(w.nbytes for w in rw))):  # fmt: skip
            total[k] = total.get(k, 0) + v * scale
        busiest += plan.stats.send_step0 * scale  # the trainer's sends (rollout forwards are intra-node)
        total["send_bound"] = total.get("send_bound", 0) + plan.send_lower_bound * scale
        seconds += link_seconds(plan) * scale
    return {
        "preset": p.name, "trainer": f"ep={p.trainer_ep}", "rollout": f"ep={p.rollout_ep}", **total,
        "busiest": float(busiest.max()), "seconds": seconds, "cpu": time.process_time() - t0, "published": p.published,
    }  # fmt: skip


# ------------------------------------------------------------------------------ gloo, real
#: Two small MoE models for the real gloo runs: few large slices, and many small ones (where a
#: message's and an agreement's fixed cost show).
GLOO_MODELS = {
    "2 layers, H=I=256": dict(H=256, I=256, E=8, LAYERS=2, BUCKET=1 << 22),
    "16 layers, H=I=64": dict(H=64, I=64, E=8, LAYERS=16, BUCKET=1 << 18),
}
#: (label, packed, overlap): before this work, packing alone, packing with the next bucket
#: posted while the last is unpacked.
GLOO_MODES = (("unpacked, one bucket at a time", False, False),
              ("packed, one bucket at a time", True, False),
              ("packed, overlapped", True, True))  # fmt: skip


def _gloo_job(rank: int, world: int, port: int, steps: int, q: object) -> None:
    import torch
    import torch.distributed as dist

    from meshgroups.transfer._names.mapped import view_source
    from meshgroups.transfer._run.execute import execute
    from meshgroups.transfer._run.steps import PackBuffers

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    trainer, rollout = Layout(ep=2), Layout(ep=2, rank_offset=2)
    ep = {"ep": Shard(0)}
    out: dict = {}
    for model, size in GLOO_MODELS.items():
        h, i, e, layers = size["H"], size["I"], size["E"], size["LAYERS"]
        tw, rw = [], []
        for layer in range(layers):
            x = f"model.layers.{layer}.mlp.experts"
            tw += [
                Weight(f"{x}.gate_up_proj", (e, 2 * i, h), "float32", ep),
                Weight(f"{x}.down_proj", (e, h, i), "float32", ep),
            ]
            for n, s in ((f"{x}.w13_weight", (e, 2 * i, h)), (f"{x}.w2_weight", (e, h, i))):
                rw += [Weight(n, s, "bfloat16", ep)]
        cfg = {
            "model_type": "qwen3_moe",
            "num_hidden_layers": layers,
            "num_experts": e,
            "moe_intermediate_size": i,
        }
        nm = hf_to_vllm(cfg, ep=2, placement="round_robin")
        plan = plan_transfer(
            trainer, tw, rollout, rw, Topology(node=2), rank=rank, name_map=nm, cast="bfloat16"
        )
        m = plan.mapping
        full = {w.name: torch.randn(w.shape) for w in tw}
        local = {
            w.name: full[w.name][tuple(slice(a, b) for a, b in bx)]
            for w in tw
            if (bx := w.box(trainer, rank))
        }
        bufs = {
            w.name: torch.empty(s, dtype=torch.bfloat16)
            for w in rw
            if (s := m.buffer_shape(w.name, rank)) is not None
        }
        srcs, dsts = {}, {}
        for ln in m.links.values():
            if (b := ln.src_local(rank)) is not None:
                srcs[ln.name] = view_source(local[ln.source][tuple(slice(x, y) for x, y in b)], ln.src_axes)
            if (b := ln.dst_local(rank)) is not None:
                dsts[ln.name] = bufs[ln.rollout][tuple(slice(x, y) for x, y in b)]
        packs = PackBuffers()
        times: dict[str, list[float]] = {label: [] for label, _, _ in GLOO_MODES}
        msgs: dict[str, int] = {}
        buckets = 0
        for s in range(steps + 1):  # the modes interleaved, so a load change hits them alike
            for label, packed, overlap in GLOO_MODES:
                dist.barrier()
                t0 = time.perf_counter()
                rep = execute(plan, srcs, dsts, bucket_bytes=size["BUCKET"], packed=packed, overlap=overlap,
                              buffers=packs, timeout=120)  # fmt: skip
                dist.barrier()
                if s:  # the first round warms up
                    times[label].append(time.perf_counter() - t0)
                msgs[label], buckets = rep.p2p_messages, rep.buckets
        out[model] = {label: (statistics.median(times[label]), msgs[label]) for label in times}
        out[model]["buckets"] = buckets
    gathered: list = [None] * world
    dist.all_gather_object(gathered, out)
    if rank == 0:
        q.put(gathered)  # type: ignore[attr-defined]
    dist.destroy_process_group()


def gloo_times(steps: int) -> list[dict]:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    mp.start_processes(_gloo_job, args=(4, port, steps, q), nprocs=4, start_method="spawn")
    return q.get(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--layers", type=int, default=2, help="MoE layers planned in full (figures scaled to the model)"
    )
    ap.add_argument("--gloo-steps", type=int, default=5)
    args = ap.parse_args()
    rows = [preset_rows(p, args.layers) for p in (_dsv3(), _qwen235())]
    print("| preset | trainer → rollout | rollout GB | cross-node GB | lower bound GB | busiest sender GB |"
          " (its bound) | messages unpacked | packed | est. time, unpacked (s) | published (others' systems) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['preset']} | {r['trainer']} → {r['rollout']} | {r['bytes'] / 1e9:,.0f} | {r['cross'] / 1e9:,.1f} | "
              f"{r['bound'] / 1e9:,.1f} | {r['busiest'] / 1e9:,.2f} | {r['send_bound'] / 1e9:,.2f} | {r['unpacked']:,.0f} | {r['packed']:,.0f} | "
              f"{r['seconds']:.2f} | {r['published']} |")  # fmt: skip
    print()
    print(
        "("
        + ", ".join(f"{r['preset']}: planned in {r['cpu']:.1f} CPU s" for r in rows)
        + f"; {args.layers} MoE layers planned, scaled)"
    )
    print()
    g = gloo_times(args.gloo_steps)
    print(f"gloo, 4 processes on this machine (ep=2 → ep=2, {next(iter(GLOO_MODELS.values()))['E']} experts a layer, "
          f"float32 → bfloat16), median of {args.gloo_steps} calls after one warm-up, the slowest rank:\n")  # fmt: skip
    print("| model | buckets | mode | seconds per sync | vs. before | p2p messages per sync (all ranks) |")
    print("|---|---|---|---|---|---|")
    for model, size in GLOO_MODELS.items():
        mb = size["LAYERS"] * size["E"] * 3 * size["I"] * size["H"] * 2 / 1e6
        base = max(x[model][GLOO_MODES[0][0]][0] for x in g)
        for label, _, _ in GLOO_MODES:
            t = max(x[model][label][0] for x in g)
            n = sum(x[model][label][1] for x in g)
            print(
                f"| {model} ({mb:.1f} MB bf16) | {g[0][model]['buckets']} | {label} | {t:.3f} | {t / base:.2f}× | {n} |"
            )
    print("\nPublished (the notes, others' systems, not measured here): slime, Qwen3-30B-A3B colocated: "
          "120 s → 7 s with one packed buffer per peer per bucket; Kimi-K2 1T fp8 on 256 H20: 16 s (checkpoint-engine).")  # fmt: skip


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))
    main()
