"""``WeightSync`` on real gloo processes (world 8): one spawned job, every rollout element
compared with the trainer's weights after real optimizer steps.

The trainer is a tiny Llama-shaped model in Hugging Face names (separate q/k/v with
grouped-query sizes, gate/up, a head tied to the embedding) on FSDP2 × TP; the rollout holds
vLLM's names and layout (fused ``qkv_proj`` / ``gate_up_proj``, each tp rank its shard of q, then
k, then v; vocab-parallel embedding and head) in bf16. The expected rollout tensors are cut from
the trainer's full weights by ``_sync_models.rollout_expected`` — an oracle that never looks at
the plan — and cast with ``.to(torch.bfloat16)``: equal bit for bit.
"""

from __future__ import annotations

import pytest

from meshgroups import Layout, LayoutError

from ..support.dist import run, scaled
from ..support.sync_models import (
    FFN,
    HIDDEN,
    KV,
    LAYERS,
    VOCAB,
    Q,
    full_weights,
    make_trainer,
    rollout_expected,
    rollout_local,
    rollout_module,
    rollout_placements,
    shard_trainer,
    train_step,
    vllm_names,
)
from ..support.transfer_exec_util import _sends_only


def _everyone(full):
    """The trainer's full weights (known on trainer rank 0) on every rank."""
    import torch.distributed as dist

    box = [full]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _check(rollout_tensors, full, tp_rank, what, rank, fp32=()):
    """Every element of this rank's rollout tensors equals the oracle's trainer slice cast with
    ``.to()`` (bf16, or fp32 for the names in ``fp32``); returns the count."""
    import torch

    want = rollout_expected(full, tp_rank, 2, torch.float32)
    checked = 0
    for name, t in rollout_tensors.items():
        local = t.to_local() if hasattr(t, "to_local") else t
        dtype = torch.float32 if name in fp32 else torch.bfloat16
        expect = want[name].to(dtype)
        assert local.dtype == dtype and torch.equal(local, expect), (what, rank, name, local, expect)
        checked += local.numel()
    assert checked, (what, rank)
    return checked


def _rollout_params(module):
    return dict(module.named_parameters())


def _disjoint(rank, out):
    """FSDP2 (dp_shard=2) × TP (tp=2) trainer on ranks 0-3 → a dp=2 × tp=2 vLLM-style rollout on
    ranks 4-7, fp32 → bf16, through a job; forgotten weights first."""
    import torch

    from meshgroups import Topology
    from meshgroups.transfer._names.conventions import vllm_map
    from meshgroups.transfer._run.jobs import init_job
    from meshgroups.transfer._run.sync import WeightSync

    trainer, rollout = Layout(dp_shard=2, tp=2), Layout(dp=2, tp=2, rank_offset=4)
    model = make_trainer()
    names = vllm_names()
    with init_job({"trainer": trainer, "rollout": rollout}) as job:
        mine = model if rank < 4 else None
        if rank < 4:
            shard_trainer(model, job["trainer"].mesh)
        tp_mesh = job["rollout"].mesh["tp"] if rank >= 4 else None
        fresh = rollout_module(tp_mesh, torch.bfloat16) if rank >= 4 else None

        # a rollout weight nothing writes: the map forgets the tied head -> refused on every
        # rank, naming it, before anything moves
        forgot_head = {k: v for k, v in names.items() if k != "lm_head.weight"}
        with pytest.raises(LayoutError, match="'lm_head.weight' has no rule in the name map"):
            WeightSync(mine, trainer, fresh, rollout, name_map=forgot_head, cast="bfloat16", job=job)
        # a trainer weight nothing reads: the rollout lacks the final norm
        if fresh is not None:
            del fresh.model._parameters["norm"]
        no_norm = {k: v for k, v in names.items() if k != "model.norm"}
        with pytest.raises(LayoutError, match="trainer weights no rollout weight reads: model.norm;"):
            WeightSync(mine, trainer, fresh, rollout, name_map=no_norm, cast="bfloat16", job=job)
        # a dtype change no cast allows
        with pytest.raises(LayoutError, match="pass cast='bfloat16'"):
            WeightSync(mine, trainer, fresh, rollout, name_map=no_norm, allow_unused=True, job=job)
        # allowed: listed, and the rest moves
        with WeightSync(
            mine,
            trainer,
            fresh,
            rollout,
            name_map=no_norm,
            cast="bfloat16",
            allow_unused=["model.norm"],
            job=job,
        ) as ws:
            assert ws.unused == ("model.norm",), ws.unused
            if fresh is not None:  # nothing moved before the first sync()
                assert all(torch.isnan(p.to_local()).all() for p in fresh.parameters())
            ws.sync(timeout=60)
            full = _everyone(full_weights(model) if rank < 4 else None)
            if fresh is not None:  # every element but the norm's, which the rollout lacks
                _check(_rollout_params(fresh), full, rollout.coords(rank)["tp"], "unused", rank)

        # the real thing: three steps, each followed by one sync(); plan and groups built once
        roll = rollout_module(tp_mesh, torch.bfloat16) if rank >= 4 else None
        before = {n: p for n, p in roll.named_parameters()} if roll is not None else {}
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01) if rank < 4 else None
        # the ready-made map from the trainer's names (fused q/k/v and gate/up, the tied head)
        ready = vllm_map([n for n, _ in model.named_parameters()], tied=True)
        assert ready.rule("model.layers.1.self_attn.qkv_proj.weight").sources == tuple(
            names["model.layers.1.self_attn.qkv_proj.weight"]
        )
        ws = WeightSync(
            mine, trainer, roll, rollout, name_map=ready, cast="bfloat16", topology=Topology(node=4),
            bucket_bytes=256, job=job, timeout=60,
        )  # fmt: skip
        assert (ws.plans, ws.group_builds) == (1, 1)
        assert sorted(ws.plan.mapping.fused()) == sorted(  # type: ignore[union-attr]
            [
                f"model.layers.{i}.{x}"
                for i in range(LAYERS)
                for x in ("self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight")
            ]
        )
        checked, seen = 0, []
        for step in range(3):
            full = None
            if rank < 4:
                train_step(model, optimizer, step)
                full = full_weights(model)
            full = _everyone(full if rank == 0 else None)
            report = ws.sync(progress=seen.append)
            if roll is not None:
                tp_rank = rollout.coords(rank)["tp"]
                checked += _check(_rollout_params(roll), full, tp_rank, f"step {step}", rank)
                # written in place: the same parameters, no gradient history
                assert all(p is before[n] and p.grad_fn is None for n, p in roll.named_parameters())
                # each element arrived once, cast: bf16 bytes of everything this rank holds
                held = sum(p.to_local().numel() for p in roll.parameters())
                assert report.bytes_received == 2 * held, (report.bytes_received, held)
            else:
                assert report.bytes_received == 0 and report.bytes_copied == 0
            if step == 0:
                out["disjoint_sent"] = report.bytes_sent
            last = full
        assert (ws.plans, ws.group_builds, ws.syncs) == (1, 1, 3), ws
        assert seen and seen[-1].bucket == seen[-1].buckets and seen[-1].buckets > 2, seen[-1:]

        # the rollout's weights change (the final norm kept in fp32 on every rollout rank): every
        # rank sees it at the next sync() and plans again, together; trainer unchanged
        if roll is not None:
            norm = roll.model.norm
            roll.model.norm = torch.nn.Parameter(
                type(norm).from_local(torch.full((HIDDEN,), float("nan")), tp_mesh, norm.placements)
            )
        ws.sync()
        assert (ws.plans, ws.group_builds, ws.syncs) == (2, 2, 4), ws
        if roll is not None:
            assert torch.equal(roll.model.norm.to_local(), last["model.norm"])  # fp32: no cast
            checked += _check(
                _rollout_params(roll),
                last,
                rollout.coords(rank)["tp"],
                "re-planned",
                rank,
                fp32=("model.norm",),
            )
        ws.close()
        ws.close()  # idempotent
        with pytest.raises(RuntimeError, match="closed"):
            ws.sync()
    out["disjoint_checked"] = checked


def _colocated(rank, out):
    """Colocated: trainer dp_shard=4 × tp=2 and a rollout dp=4 × tp=2 on the same 8 ranks, the
    rollout as plain local buffers with ``rollout_weights`` (vLLM holds plain tensors); a bad
    buffer on one rank; a failure mid-transfer and the recovery through ``sync()``."""
    import torch
    import torch.distributed as dist

    from meshgroups.transfer import Shard, Weight
    from meshgroups.transfer._run.execute import TransferError
    from meshgroups.transfer._run.jobs import init_job
    from meshgroups.transfer._run.sync import WeightSync

    trainer, rollout = Layout(dp_shard=4, tp=2), Layout(dp=4, tp=2)
    shapes = {n: tuple(t.shape) for n, t in rollout_local(1, torch.float32).items()}  # global shapes
    axes = rollout_placements()
    roll_w = [
        Weight(n, s, "bfloat16", {} if axes[n] is None else {"tp": Shard(axes[n])}) for n, s in shapes.items()
    ]
    assert shapes["model.layers.0.self_attn.qkv_proj.weight"] == (Q + 2 * KV, HIDDEN)
    assert shapes["model.layers.0.mlp.gate_up_proj.weight"] == (2 * FFN, HIDDEN)
    assert shapes["lm_head.weight"] == (VOCAB, HIDDEN)
    tp_rank = rollout.coords(rank)["tp"]
    model = make_trainer(seed=1)
    with init_job({"trainer": trainer, "rollout": rollout}, sharing="colocated") as job:
        shard_trainer(model, job["trainer"].mesh)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

        # rank 5's qkv buffer has the wrong local shape: its error, raised on every rank
        bad = rollout_local(2, torch.bfloat16)
        if rank == 5:
            bad["model.layers.1.self_attn.qkv_proj.weight"] = bad["model.layers.1.self_attn.qkv_proj.weight"][
                :5
            ]
        with pytest.raises(
            LayoutError,
            match=r"rank 5: rollout tensor 'model.layers.1.self_attn.qkv_proj.weight' has local shape \(5, 8\)",
        ):
            WeightSync(
                model,
                trainer,
                bad,
                rollout,
                rollout_weights=roll_w,
                name_map=vllm_names(),
                cast=True,
                job=job,
            )

        bufs = rollout_local(2, torch.bfloat16)
        ws = WeightSync(
            model, trainer, bufs, rollout, rollout_weights=roll_w, name_map=vllm_names(), cast=True,
            bucket_bytes=200, job=job, timeout=60,
        )  # fmt: skip
        checked = copied = 0
        for step in range(2):
            train_step(model, optimizer, step)
            full = _everyone(full_weights(model))
            report = ws.sync()
            checked += _check(bufs, full, tp_rank, f"colocated step {step}", rank)
            copied += report.bytes_copied
        assert (ws.plans, ws.group_builds) == (1, 1)

        # mid-transfer: rank 2 posts its sends but never its receives, and fails; its peers'
        # sends time out (gloo closes the groups' connections): TransferError in stage
        # "transfer" on every rank, the broken groups closed, the plan kept
        real, dropped = dist.batch_isend_irecv, []
        sends_only = _sends_only(real, dropped)

        train_step(model, optimizer, 2)
        full = _everyone(full_weights(model))
        if rank == 2:
            dist.batch_isend_irecv = sends_only
        with pytest.raises(TransferError, match="rank 2: RuntimeError: injected") as err:
            ws.sync(timeout=scaled(2))
        dist.batch_isend_irecv = real
        assert err.value.stage == "transfer" and 2 in err.value.ranks, err.value
        assert rank != 2 or dropped
        assert ws.groups is None and (ws.plans, ws.group_builds) == (1, 1)
        # the next sync() builds new groups (not a new plan) and moves everything again
        report = ws.sync()
        assert (ws.plans, ws.group_builds, ws.syncs) == (1, 2, 3), ws
        checked += _check(bufs, full, tp_rank, "after the failure", rank)

        # retries=1: the same failure, recovered inside one call
        train_step(model, optimizer, 3)
        full = _everyone(full_weights(model))
        if rank == 2:
            dist.batch_isend_irecv = sends_only
        try:
            ws.sync(timeout=scaled(2), retries=1)
        finally:
            dist.batch_isend_irecv = real
        assert (ws.plans, ws.group_builds, ws.syncs) == (1, 3, 4), ws
        checked += _check(bufs, full, tp_rank, "retried", rank)

        # a new rollout layout (dims in the other order: tp pairs ranks 0-4, 1-5, ...), assigned
        # on every rank: the next sync() plans again and builds new groups
        moved = Layout(tp=2, dp=4)
        assert moved.coords(4)["tp"] == 1 and rollout.coords(4)["tp"] == 0
        ws.rollout_layout = moved
        train_step(model, optimizer, 4)
        full = _everyone(full_weights(model))
        ws.sync()
        assert (ws.plans, ws.group_builds, ws.syncs) == (2, 4, 5), ws
        checked += _check(bufs, full, moved.coords(rank)["tp"], "new layout", rank)
        ws.close()
    out["colocated_checked"] = checked
    out["colocated_copied"] = copied


def _cast_at_the_sender(rank, out):
    """``execute`` casts at the sender: a local copy (rank 0 also holds a rollout replica), a
    send across nodes and the forwards inside the rollout's node carry bf16 / fp16 bits equal
    to ``.to(dtype)`` of the fp32 source — values halfway between two bf16 numbers (ties to
    even), subnormals, infinities, NaN and the largest floats included (compared as bits)."""
    import numpy as np
    import torch

    from meshgroups import Topology
    from meshgroups.transfer import Weight, plan_transfer
    from meshgroups.transfer._run.execute import execute

    one = Layout.from_grid(np.array([0]), ("tp",))
    many = Layout.from_grid(np.array([0, 4, 5, 6]), ("dp",))  # rank 0: a local copy
    bits = torch.tensor(
        [0x3F808000, 0x3F818000, 0x00000001, 0x7F7FFFFF, 0xFF800000, 0x7FC00000], dtype=torch.int64
    )
    edges = bits.to(torch.int32).view(torch.float32)  # 1 + 2^-8 (a tie), 1 + 3·2^-8, ...
    torch.manual_seed(3)
    source = {"w": torch.cat([edges, torch.randn(58) * 1e3]).reshape(8, 8), "h": torch.randn(6, 5)}
    src_w = [Weight("w", (8, 8)), Weight("h", (6, 5))]
    dst_w = [Weight("w", (8, 8), "bfloat16"), Weight("h", (6, 5), "float16")]
    plan = plan_transfer(one, src_w, many, dst_w, Topology(node=4), rank=rank, cast=True)
    bufs = {w.name: torch.full(w.shape, float("nan"), dtype=getattr(torch, w.dtype)) for w in dst_w}
    report = execute(plan, source if rank == 0 else {}, bufs if rank in (0, 4, 5, 6) else {}, timeout=60)
    if rank in (0, 4, 5, 6):
        for name, t in bufs.items():
            want = source[name].to(t.dtype)
            assert torch.equal(t.view(torch.int16), want.view(torch.int16)), (rank, name, t, want)
    if rank == 0:  # one cast copy out of the node, in the wire dtype: 2 bytes an element
        assert report.bytes_sent == 2 * (64 + 30) and report.bytes_copied == 2 * (64 + 30), report
    out["cast_received"] = report.bytes_received


def worker(rank, world):
    import torch.distributed as dist

    from meshgroups.mesh._torch_seam import held_group_count

    held = held_group_count()
    out: dict = {}
    _cast_at_the_sender(rank, out)
    _disjoint(rank, out)
    _colocated(rank, out)
    assert held_group_count() == held, "every job, transfer group and sync closed"
    dist.barrier()
    return out


@pytest.mark.processes
def test_weight_sync_world8():
    results = run(worker, 8, timeout=600, pg_timeout=120)
    per_tp_rank = (
        (VOCAB // 2 * HIDDEN) * 2
        + HIDDEN
        + LAYERS
        * ((Q + 2 * KV) // 2 * HIDDEN + 2 * FFN // 2 * HIDDEN + HIDDEN * Q // 2 + HIDDEN * FFN // 2 + HIDDEN)
    )
    # cast at the sender: each of ranks 4-6 receives the bf16 and fp16 bytes once
    assert [r["cast_received"] for r in results] == [0] + [0] * 3 + [2 * (64 + 30)] * 3 + [0]
    # disjoint: 4 rollout ranks, 3 syncs + the re-planned one; every element of each
    assert sum(r["disjoint_checked"] for r in results) == 4 * 4 * per_tp_rank
    assert sum(r["disjoint_sent"] for r in results[:4]) > 0
    # colocated: 8 rollout ranks, 5 checks each
    assert sum(r["colocated_checked"] for r in results) == 8 * 5 * per_tp_rank
    assert sum(r["colocated_copied"] for r in results) > 0  # colocated: some slices copied locally


# ------------------------------------------------------------------------------- no processes
def test_describe_sees_what_a_plan_depends_on_and_nothing_else():
    import torch

    from meshgroups.transfer._run.torch_io import describe, local_tensors

    t = torch.zeros(4, 2)
    before = describe({"w": t, "b": torch.zeros(3)})
    t.add_(1)  # new values: the same plan
    assert describe({"w": t, "b": torch.zeros(3)}) == before
    assert describe({"w": torch.ones(4, 2), "b": torch.ones(3)}) == before  # another tensor, alike
    assert describe({"w": t.to(torch.bfloat16), "b": torch.zeros(3)}) != before  # a dtype
    assert describe({"w": t[:2], "b": torch.zeros(3)}) != before  # a shape
    assert describe({"v": t, "b": torch.zeros(3)}) != before  # a name
    assert describe(None) == ()
    module = torch.nn.Linear(2, 3)
    local = local_tensors(module)
    assert local["weight"].data_ptr() == module.weight.data_ptr() and not local["weight"].requires_grad
    with pytest.raises(TypeError, match="'w' must be a tensor"):
        local_tensors({"w": [1.0]})
    with pytest.raises(TypeError, match="an nn.Module, a mapping"):
        describe([("w", t)])  # type: ignore[arg-type]


def test_weight_sync_needs_a_process_group():
    from meshgroups.transfer._run.sync import WeightSync

    with pytest.raises(RuntimeError, match="initialised default process group"):
        WeightSync(None, Layout(tp=1), None, Layout(tp=1))


def test_docstring_examples():
    import doctest

    from meshgroups.transfer._run import torch_io

    result = doctest.testmod(torch_io, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
