"""MoE weight sync on real processes (one gloo job of 6 ranks, many checks): an ep=2 × tp=2
trainer of a tiny Qwen3-MoE-shaped model (Hugging Face / Transformers 5 names: packed
``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` sharded over ep and, gate | up, over tp;
``down_proj`` ``[E, H, I]``; q/k norms, a router) on ranks 0-3 → an ep=2 vLLM-style rollout on
ranks 4-5 holding stacked ``experts.w13_weight`` / ``w2_weight`` in round-robin expert order,
through ``WeightSync`` with ``families.hf_to_vllm``. Two syncs side by side: the rollout in
bfloat16, and in block fp8 (experts ``float8_e4m3fn`` with 128 × 128 ``_scale_inv``, quantized by
each sender). After each of three real optimizer steps (Adam on the trainer's local shards),
every rollout element and scale is compared with an oracle built from the gathered full trainer
tensors: the rule written out by hand, and the reference quantizer of ``tests/support/fp8_oracle.py``
on the full stacked tensor (bits)."""

from __future__ import annotations

import pytest

from ..support.dist import run

pytestmark = pytest.mark.processes  # every test here starts processes

H, INTER, E, HEADS, KV, HD, VOCAB, LAYERS = 128, 256, 4, 4, 2, 32, 256, 2


def _trainer_shapes() -> dict:
    out = {"model.embed_tokens.weight": ((VOCAB, H), {"tp": 0}), "model.norm.weight": ((H,), {})}
    out["lm_head.weight"] = ((VOCAB, H), {"tp": 0})
    for i in range(LAYERS):
        a, m = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        out[f"{a}.q_proj.weight"] = ((HEADS * HD, H), {"tp": 0})
        out[f"{a}.k_proj.weight"] = ((KV * HD, H), {"tp": 0})
        out[f"{a}.v_proj.weight"] = ((KV * HD, H), {"tp": 0})
        out[f"{a}.o_proj.weight"] = ((H, HEADS * HD), {"tp": 1})
        out[f"{a}.q_norm.weight"] = ((HD,), {})
        out[f"{a}.k_norm.weight"] = ((HD,), {})
        out[f"{m}.gate.weight"] = ((E, H), {})
        out[f"{m}.experts.gate_up_proj"] = ((E, 2 * INTER, H), {"ep": 0, "tp": 1})
        out[f"{m}.experts.down_proj"] = ((E, H, INTER), {"ep": 0, "tp": 2})
        for n in ("input_layernorm", "post_attention_layernorm"):
            out[f"model.layers.{i}.{n}.weight"] = ((H,), {})
    return out


def _rollout_weights(fp8: bool) -> list:
    from meshgroups.transfer import Shard, Weight
    from meshgroups.transfer._names.quant import BlockFP8

    q = BlockFP8()
    dense = "bfloat16"
    out = [
        Weight("model.embed_tokens.weight", (VOCAB, H), dense),
        Weight("lm_head.weight", (VOCAB, H), dense),
    ]
    out.append(Weight("model.norm.weight", (H,), dense))
    for i in range(LAYERS):
        a, m = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        out += [
            Weight(f"{a}.qkv_proj.weight", ((HEADS + 2 * KV) * HD, H), dense),
            Weight(f"{a}.o_proj.weight", (H, HEADS * HD), dense),
            Weight(f"{a}.q_norm.weight", (HD,), dense),
            Weight(f"{a}.k_norm.weight", (HD,), dense),
            Weight(f"{m}.gate.weight", (E, H), dense),
            Weight(f"model.layers.{i}.input_layernorm.weight", (H,), dense),
            Weight(f"model.layers.{i}.post_attention_layernorm.weight", (H,), dense),
        ]
        for name, shape in (
            (f"{m}.experts.w13_weight", (E, 2 * INTER, H)),
            (f"{m}.experts.w2_weight", (E, H, INTER)),
        ):
            out.append(Weight(name, shape, "float8_e4m3fn" if fp8 else dense, {"ep": Shard(0)}))
            if fp8:
                out.append(Weight(q.scale_name(name), q.scale_shape(shape), "float32", {"ep": Shard(0)}))
    return out


def _expected(full: dict, order: list, ep_rank: int, fp8: bool) -> dict:
    """What rollout ep rank ``ep_rank`` holds, from the full trainer tensors (by hand)."""
    import torch

    from ..support.fp8_oracle import reference_quantize

    bf = torch.bfloat16
    out = {
        n: full[n].to(bf) for n in full if ("experts" not in n and "_proj.weight" not in n) or "o_proj" in n
    }
    for n in ("model.embed_tokens.weight", "lm_head.weight"):
        out[n] = full[n].to(bf)
    local = order[ep_rank * (E // 2) : (ep_rank + 1) * (E // 2)]
    for i in range(LAYERS):
        a, m = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        out[f"{a}.qkv_proj.weight"] = torch.cat([full[f"{a}.{x}_proj.weight"] for x in "qkv"]).to(bf)
        w13 = torch.stack([full[f"{m}.experts.gate_up_proj"][e] for e in order])  # gate rows, then up rows
        w2 = torch.stack([full[f"{m}.experts.down_proj"][e] for e in order])
        rows = slice(ep_rank * (E // 2), (ep_rank + 1) * (E // 2))
        for name, t in ((f"{m}.experts.w13_weight", w13), (f"{m}.experts.w2_weight", w2)):
            if fp8:
                qv, sv = reference_quantize(t, (128, 128))
                out[name], out[name + "_scale_inv"] = qv[rows], sv[rows]
            else:
                out[name] = t[rows].to(bf)
        assert len(local) == E // 2
    return out


def _job(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Replicate as TR
    from torch.distributed.tensor import Shard as TS

    from meshgroups import Layout, Topology
    from meshgroups.transfer import Shard, Weight
    from meshgroups.transfer._names.families import hf_to_vllm
    from meshgroups.transfer._names.quant import BlockFP8
    from meshgroups.transfer._names.stacking import expert_order
    from meshgroups.transfer._run.jobs import init_job
    from meshgroups.transfer._run.sync import WeightSync

    trainer, rollout = Layout(ep=2, tp=2), Layout(ep=2, rank_offset=4)
    shapes = _trainer_shapes()
    gen = torch.Generator().manual_seed(7)
    full0 = {n: torch.randn(s, generator=gen) for n, (s, _) in shapes.items()}  # the same on every rank
    cfg = {
        "model_type": "qwen3_moe",
        "num_hidden_layers": LAYERS,
        "num_experts": E,
        "moe_intermediate_size": INTER,
    }
    nm = hf_to_vllm(cfg, ep=2, placement="round_robin")
    order = expert_order(E, 2, "round_robin")
    out: dict = {"checked": 0, "scales_checked": 0}
    with init_job({"trainer": trainer, "rollout": rollout}) as job:
        params: dict = {}
        placements: dict = {}
        if rank in trainer:
            mesh = job["trainer"].mesh
            for n, (s, pl) in shapes.items():
                w = Weight(n, s, placements={d: Shard(a) for d, a in pl.items()})
                box = w.box(trainer, rank)
                params[n] = torch.nn.Parameter(full0[n][tuple(slice(a, b) for a, b in box)].clone())
                placements[n] = [TS(pl[d]) if d in pl else TR() for d in ("ep", "tp")]
            optimizer = torch.optim.Adam(params.values(), lr=0.05)

        def dtensors() -> dict | None:
            if rank not in trainer:
                return None
            with torch.no_grad():
                return {
                    n: DTensor.from_local(
                        p.data,
                        mesh,
                        placements[n],
                        run_check=False,
                        shape=shapes[n][0],
                        stride=torch.empty(shapes[n][0]).stride(),
                    )
                    for n, p in params.items()
                }

        syncs, buffers = {}, {}
        for fp8 in (False, True):
            rw = _rollout_weights(fp8)
            if rank in rollout:
                m = {}
                for w in rw:
                    box = w.box(rollout, rank)
                    m[w.name] = torch.full(tuple(b - a for a, b in box), float("nan")).to(
                        getattr(torch, w.dtype)
                    )
                buffers[fp8] = m
            syncs[fp8] = WeightSync(
                dtensors(), trainer, buffers.get(fp8), rollout, name_map=nm, cast="bfloat16", rollout_weights=rw,
                quantize=BlockFP8() if fp8 else None, topology=Topology(node=2), bucket_bytes=1 << 18, job=job,
                timeout=120,
            )  # fmt: skip
        for step in range(3):
            if rank in trainer:  # a real step on the local shards (replicas get equal updates)
                optimizer.zero_grad()
                loss = sum((p.sin() * (step + 1) + p.square()).sum() for p in params.values())
                loss.backward()
                optimizer.step()
            for fp8 in (False, True):
                report = syncs[fp8].sync(timeout=120)
                out.setdefault(f"sent_{fp8}", []).append(report.bytes_sent)
            mine = [(n, Weight(n, s, placements={d: Shard(a) for d, a in pl.items()}).box(trainer, rank),
                     params[n].detach().clone()) for n, (s, pl) in shapes.items()] if rank in trainer else []  # fmt: skip
            gathered: list = [None] * world
            dist.all_gather_object(gathered, mine)
            full = {n: torch.empty(s) for n, (s, _) in shapes.items()}
            for part in gathered:
                for n, box, t in part:
                    full[n][tuple(slice(a, b) for a, b in box)] = t
            assert not torch.equal(full["lm_head.weight"], full0["lm_head.weight"])  # it trained
            if rank in rollout:
                ep_rank = rollout.coords(rank)["ep"]
                for fp8 in (False, True):
                    want = _expected(full, order, ep_rank, fp8)
                    assert set(want) == set(buffers[fp8]), sorted(set(want) ^ set(buffers[fp8]))
                    for n, t in want.items():
                        got = buffers[fp8][n]
                        a, b = (
                            (got.view(torch.uint8), t.view(torch.uint8))
                            if t.dtype == torch.float8_e4m3fn
                            else (got, t)
                        )
                        assert got.dtype == t.dtype and torch.equal(a, b), (rank, step, fp8, n)
                        key = "scales_checked" if n.endswith("_scale_inv") else "checked"
                        out[key] += t.numel()
        out["plans"] = [syncs[f].plans for f in (False, True)]
        out["group_builds"] = [syncs[f].group_builds for f in (False, True)]
        for s in syncs.values():
            s.close()
    return out


def test_moe_ep_tp_trainer_into_ep_rollout_bf16_and_block_fp8() -> None:
    results = run(_job, 6, timeout=600, pg_timeout=120)
    for r in results:
        assert r["plans"] == [1, 1] and r["group_builds"] == [1, 1], r
    per_rank_experts = LAYERS * (E // 2) * (2 * INTER * H + H * INTER)
    assert (
        results[4]["scales_checked"]
        == results[5]["scales_checked"]
        == 3 * LAYERS * (E // 2) * (4 * 1 + 1 * 2)
    )
    assert results[4]["checked"] == results[5]["checked"] > 3 * 2 * per_rank_experts
    # fp8 puts one byte an expert element on the wire where bf16 puts two: the trainer sends less
    sent_bf16 = sum(sum(r["sent_False"]) for r in results[:4])
    sent_fp8 = sum(sum(r["sent_True"]) for r in results[:4])
    assert sent_fp8 < sent_bf16
