"""Delta sync (``WeightSync(delta=True)``) on real gloo processes (world 8), one spawned job.

The tiny Llama-shaped trainer of ``support/sync_models`` (FSDP2 dp_shard=2 × TP tp=2, fp32, on
ranks 0-3) trained a few Adam steps at a small learning rate; the rollout in vLLM's names and
layout (fused ``qkv_proj`` / ``gate_up_proj``, vocab-parallel head) in bf16, dp=2 × tp=2 on
ranks 4-7, one node of 4 (so the trainer sends each box into the node once and the rollout
ranks forward it: deltas at step 0 and at step 1, point to point and broadcast). After every
sync every rollout element equals the oracle's ``.to(torch.bfloat16)`` of the trainer's
weights, bit for bit; the bytes sent against dense are recorded per step. Then the receivers
that do not hold the base — one restored to the version before (it missed a sync), one with a
changed element (same version, other values), one of unknown version — are each detected
(every rank names the same receiver and reason) and healed by a dense sync to it, the others
taking their deltas.
"""

from __future__ import annotations

import pytest

from meshgroups import Layout

from ..support.dist import run
from ..support.sync_models import (
    full_weights,
    make_trainer,
    rollout_expected,
    rollout_module,
    shard_trainer,
    train_step,
    vllm_names,
)


def _everyone(full):
    import torch.distributed as dist

    box = [full]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _exact(roll, full, tp_rank) -> int:
    """Every element of this rollout rank equals the oracle's bf16 cast, bit for bit."""
    import torch

    want = rollout_expected(full, tp_rank, 2, torch.float32)
    n = 0
    for name, p in roll.named_parameters():
        local = p.to_local()
        expect = want[name].to(torch.bfloat16)
        assert torch.equal(local.view(torch.int16), expect.view(torch.int16)), name
        n += local.numel()
    return n


def _job(rank, world):
    import torch

    from meshgroups import Topology
    from meshgroups.errors import VersionError
    from meshgroups.transfer._run.jobs import init_job
    from meshgroups.transfer._run.sync import WeightSync

    trainer, rollout = Layout(dp_shard=2, tp=2), Layout(dp=2, tp=2, rank_offset=4)
    out: dict = {"steps": []}
    model = make_trainer(seed=3)
    with init_job({"trainer": trainer, "rollout": rollout}) as job:
        if rank < 4:
            shard_trainer(model, job["trainer"].mesh)
        roll = rollout_module(job["rollout"].mesh["tp"], torch.bfloat16) if rank >= 4 else None
        tp_rank = rollout.coords(rank)["tp"] if rank >= 4 else None
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-5) if rank < 4 else None
        ws = WeightSync(
            model if rank < 4 else None, trainer, roll, rollout, name_map=vllm_names(), cast="bfloat16",
            topology=Topology(node=4), bucket_bytes=512, job=job, timeout=60, delta=True,
        )  # fmt: skip

        def step_and_sync(label: str, train: bool = True, **kw):
            if train and rank < 4:
                train_step(model, optimizer, len(out["steps"]))
            full = _everyone(full_weights(model) if rank < 4 else None)
            report = ws.sync(**kw)
            d = report.delta
            checked = _exact(roll, full, tp_rank) if roll is not None else 0
            out["steps"].append(
                dict(label=label, version=d.version, base=d.base, ratio=d.ratio, payload=d.payload_ratio, dense=d.total_dense,
                     sent=d.total_sent, refused=list(d.refused), reasons=list(d.reasons), modes=dict(d.modes),
                     checked=checked, held=ws.version)
            )  # fmt: skip
            return report

        first = step_and_sync("first (dense)", train=False)
        out["shadow_bytes"], out["dense_sent"] = ws.shadow_bytes, first.bytes_sent
        for i in range(3):
            step_and_sync(f"adam {i + 1}")
        # a receiver that missed a sync: rank 5 restored to the values of the version before
        saved = {n: p.to_local().clone() for n, p in roll.named_parameters()} if roll is not None else {}
        step_and_sync("before the skip")
        if rank == 5:
            with torch.no_grad():
                for n, p in roll.named_parameters():
                    p.to_local().copy_(saved[n])
            ws.version -= 1
        step_and_sync("rank 5 missed one")
        # the same version, other values: one element of rank 6 changed
        if rank == 6:
            with torch.no_grad():
                w = dict(roll.named_parameters())["model.layers.1.self_attn.qkv_proj.weight"].to_local()
                w.view(-1)[3] = w.view(-1)[3] + 1.0
        step_and_sync("rank 6 changed")
        # unknown: rank 7 forgets what it holds
        if rank == 7:
            ws.forget()
        step_and_sync("rank 7 unknown")
        step_and_sync("all on the base again")
        # versions only increase, every rank alike, before anything moves
        try:
            ws.sync(version=2)
            out["stale"] = "no error"
        except VersionError as exc:
            out["stale"] = f"VersionError: {exc}"
        step_and_sync("explicit version", version=20)
        out["counters"] = (ws.plans, ws.group_builds, ws.syncs)
        ws.close()
    return out


@pytest.mark.processes
def test_delta_sync_bit_exact_and_healed() -> None:
    results = run(_job, 8, timeout=240)
    steps = [r["steps"] for r in results]
    rows = steps[0]
    labels = [r["label"] for r in rows]
    # every rank saw the same versions, refusals and totals
    for other in steps[1:]:
        assert [(r["version"], r["refused"], r["dense"], r["sent"]) for r in other] == [
            (r["version"], r["refused"], r["dense"], r["sent"]) for r in rows
        ]
    for r in results[4:]:  # every rollout element checked after every sync
        assert all(s["checked"] > 0 for s in r["steps"]), r["steps"]
    first, *adam = rows[:4]
    assert first["base"] is None and first["ratio"] == 1.0 and first["version"] == 1
    print(
        "\ndelta sync, world 8:",
        [(row["label"], round(row["ratio"], 3), round(row["payload"], 3), row["modes"]) for row in rows],
    )
    for i, row in enumerate(adam, 2):
        assert row["version"] == i and row["base"] == i - 1 and not row["refused"], row
        # only what changed crossed (this model's slices are a few dozen elements: the 48 bytes
        # of header and base check per slice weigh; the payload alone is the figure that scales)
        assert 0 < row["payload"] < 0.5, row
    by = dict(zip(labels, rows))
    skip = by["rank 5 missed one"]
    assert skip["refused"] == [5] and "rank 5 holds version 4, but" in skip["reasons"][0], skip
    changed = by["rank 6 changed"]
    assert changed["refused"] == [6] and "digests differ" in changed["reasons"][0], changed
    assert "model.layers.1.self_attn.qkv_proj.weight" in changed["reasons"][0], changed
    unknown = by["rank 7 unknown"]
    assert unknown["refused"] == [7] and "holds no known version" in unknown["reasons"][0], unknown
    healed = by["all on the base again"]
    assert not healed["refused"] and healed["payload"] < 0.5, healed
    # a refusing receiver costs its dense share: more bytes than the syncs without one
    assert skip["sent"] > healed["sent"]
    assert all(
        r["stale"].startswith("VersionError") and "is older than version" in r["stale"] for r in results
    )
    assert rows[-1]["version"] == 20 and all(r["steps"][-1]["held"] == 20 for r in results)
    assert all(r["counters"] == (1, 1, len(rows)) for r in results)
    # the shadow: what a rank sends in a dense sync, each box once (trainer ranks send into the
    # node once; the rollout ranks that forward keep what they forward)
    for r in results:
        assert r["shadow_bytes"] <= r["dense_sent"]
    assert all(r["shadow_bytes"] > 0 for r in results[:4])


@pytest.mark.parametrize("bad", [0, "x", -3])
def test_delta_policy_refuses_bad_values(bad) -> None:
    from meshgroups.transfer._run.delta_codec import DeltaPolicy

    with pytest.raises((ValueError, TypeError)):
        DeltaPolicy(block=bad)
    with pytest.raises(TypeError, match="True, False or a DeltaPolicy"):
        DeltaPolicy.of("yes")


def _lora_model():
    """A PEFT-shaped model (PEFT's names: ``base_layer``, ``lora_A.default``, ``lora_B.default``,
    ``peft_config``) without PEFT: q (column-parallel in the rollout) and o (row-parallel)."""
    from types import SimpleNamespace

    import torch
    from torch import nn

    class Lin(nn.Module):
        def __init__(self, i: int, o: int, r: int) -> None:
            super().__init__()
            self.base_layer = nn.Linear(i, o, bias=False)
            self.lora_A = nn.ModuleDict({"default": nn.Linear(i, r, bias=False)})
            self.lora_B = nn.ModuleDict({"default": nn.Linear(r, o, bias=False)})

        def forward(self, x):
            return self.base_layer(x) + 2.0 * self.lora_B["default"](self.lora_A["default"](x))

    class Inner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj, self.o_proj = Lin(8, 16, 4), Lin(16, 8, 4)
            self.norm = nn.Parameter(torch.ones(8))

    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = Inner()

    class Peft(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.base_model = Wrapper()
            self.peft_config = {"default": SimpleNamespace(r=4, lora_alpha=8, use_rslora=False)}

        def forward(self, x):
            m = self.base_model.model
            return m.o_proj(m.q_proj(x * m.norm))

    torch.manual_seed(11)
    return Peft()


def _merged_job(rank, world):
    import torch

    from meshgroups.engines.vllm._lora import merge, merged_weights
    from meshgroups.transfer import Shard, Weight
    from meshgroups.transfer._run.jobs import init_job
    from meshgroups.transfer._run.sync import WeightSync

    trainer, rollout = Layout(dp=2), Layout(tp=2, rank_offset=2)
    model = _lora_model()
    weights = [
        Weight("q_proj.weight", (16, 8), "bfloat16", {"tp": Shard(0)}),
        Weight("o_proj.weight", (8, 16), "bfloat16", {"tp": Shard(1)}),
        Weight("norm", (8,), "bfloat16", {}),
    ]
    out = {"exact": [], "ratios": []}
    with init_job({"trainer": trainer, "rollout": rollout}) as job:
        bufs = None
        if rank >= 2:
            r = rank - 2
            bufs = {"q_proj.weight": torch.full((8, 8), float("nan"), dtype=torch.bfloat16),
                    "o_proj.weight": torch.full((8, 8), float("nan"), dtype=torch.bfloat16),
                    "norm": torch.full((8,), float("nan"), dtype=torch.bfloat16)}  # fmt: skip
        else:
            from torch.distributed.fsdp import fully_shard

            fully_shard(model, mesh=job["trainer"].mesh)
            opt = torch.optim.Adam([p for n, p in model.named_parameters() if "lora_" in n], lr=1e-2)
        merged = merged_weights(model) if rank < 2 else None
        ws = WeightSync(merged, trainer, bufs, rollout, rollout_weights=weights, cast="bfloat16", job=job,
                        timeout=60, delta=True)  # fmt: skip
        for step in range(3):
            if step and rank < 2:
                opt.zero_grad()
                model(torch.ones(3, 8)).square().mean().backward()
                opt.step()
                ws.trainer = merged_weights(model)
            state = [None]
            if rank < 2:
                st = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in model.named_parameters()}  # fmt: skip
                state = [st if rank == 0 else None]
            import torch.distributed as dist

            dist.broadcast_object_list(state, src=0)
            full = state[0]
            report = ws.sync()
            out["ratios"].append(report.delta.payload_ratio)
            if bufs is not None:
                p = "base_model.model."
                want = {}
                for short in ("q_proj", "o_proj"):
                    w, a, b = (
                        full[f"{p}{short}.{k}"]
                        for k in ("base_layer.weight", "lora_A.default.weight", "lora_B.default.weight")
                    )
                    want[f"{short}.weight"] = merge(w, a, b, 2.0).to(torch.bfloat16)
                    # cut anywhere, the merge is the same bit for bit
                    assert torch.equal(merge(w[3:11], a, b[3:11], 2.0), merge(w, a, b, 2.0)[3:11])
                    assert torch.equal(merge(w[:, 5:7], a[:, 5:7], b, 2.0), merge(w, a, b, 2.0)[:, 5:7])
                got_q = bufs["q_proj.weight"]
                got_o = bufs["o_proj.weight"]
                same = torch.equal(
                    got_q.view(torch.int16), want["q_proj.weight"][8 * r : 8 * r + 8].view(torch.int16)
                )
                same &= torch.equal(
                    got_o.view(torch.int16),
                    want["o_proj.weight"][:, 8 * r : 8 * r + 8].view(torch.int16),
                )
                same &= torch.equal(bufs["norm"], full[f"{p}norm"].to(torch.bfloat16))
                out["exact"].append(bool(same))
        ws.close()
    return out


@pytest.mark.processes
def test_lora_merged_at_the_sender_bit_exact() -> None:
    """``merged_weights``: W + scale·B·A merged on each trainer rank's own FSDP shard, moved
    into a rollout whose q is column-parallel and o row-parallel (bf16), as delta syncs over
    three adapter steps: every rollout element equals the reference merge of the full tensors,
    cast, bit for bit."""
    results = run(_merged_job, 4, timeout=180)
    for r in results[2:]:
        assert r["exact"] == [True, True, True], r
    print("\nmerged LoRA payload ratios:", [round(x, 3) for x in results[0]["ratios"]])
