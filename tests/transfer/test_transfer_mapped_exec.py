"""A mapped plan runs through ``execute`` unchanged when each link's tensors are views: the
trainer's local shard cut to ``link.src_local(rank)``, the rollout's fused buffer cut to
``link.dst_local(rank)`` (writing the view writes the buffer). One gloo job, four processes:
a tp=2 trainer with separate q, k, v (GQA sizes) and gate, up into a tp=2 rollout holding
vLLM's fused ``qkv`` and ``gate_up`` (each rank: its q rows, then k, then v), plus a tied head;
every rollout element is compared with the trainer's full tensors. Same dtype on both sides:
the cast at the sender is the torch side's (``WeightSync``)."""

from __future__ import annotations

import pytest

from ..support.dist import run

pytestmark = pytest.mark.processes  # every test here starts processes


def _job(rank: int, world: int) -> int:
    import torch

    from meshgroups import Layout, Topology
    from meshgroups.transfer import Shard, Weight, plan_transfer
    from meshgroups.transfer._run.execute import execute

    h = 4
    trainer, rollout = Layout(tp=2), Layout(tp=2, rank_offset=2)
    sizes = {"q": 8, "k": 2, "v": 2, "gate": 6, "up": 6, "embed": 10}
    t_w = [Weight(n, (s, h), "float32", {"tp": Shard(0)}) for n, s in sizes.items()]
    r_w = [
        Weight("qkv", (12, h), "float32", {"tp": Shard(0)}),
        Weight("gate_up", (12, h), "float32", {"tp": Shard(0)}),
        Weight("embed", (10, h), "float32", {"tp": Shard(0)}),
        Weight("head", (10, h), "float32", {"tp": Shard(1)}),
    ]
    nm = {"qkv": ["q", "k", "v"], "gate_up": ["gate", "up"], "head": "embed"}
    plan = plan_transfer(trainer, t_w, rollout, r_w, Topology(node=2), rank=rank, name_map=nm)
    assert plan.mapping is not None
    full = {
        n: torch.arange(s * h, dtype=torch.float32).reshape(s, h) + 1000 * i
        for i, (n, s) in enumerate(sizes.items())
    }

    def cut(t: torch.Tensor, box: tuple[tuple[int, int], ...]) -> torch.Tensor:
        return t[tuple(slice(a, b) for a, b in box)]

    local = {w.name: cut(full[w.name], b).clone() for w in t_w if (b := w.box(trainer, rank))}
    buffers = {
        w.name: torch.full(plan.mapping.buffer_shape(w.name, rank), float("nan"))
        for w in r_w
        if plan.mapping.buffer_shape(w.name, rank) is not None
    }
    srcs, dsts = {}, {}
    for link in plan.mapping.links.values():
        if (box := link.src_local(rank)) is not None:
            srcs[link.name] = cut(local[link.source], box)
        if (box := link.dst_local(rank)) is not None:
            dsts[link.name] = cut(buffers[link.rollout], box)
    execute(plan, srcs, dsts, timeout=60)
    checked = 0
    if rank in rollout:
        tp = rollout.coords(rank)["tp"]

        def rows(n: str) -> torch.Tensor:
            s = sizes[n] // 2
            return full[n][tp * s : (tp + 1) * s]

        want = {
            "qkv": torch.cat([rows("q"), rows("k"), rows("v")]),
            "gate_up": torch.cat([rows("gate"), rows("up")]),
            "embed": rows("embed"),
            "head": full["embed"][:, tp * 2 : tp * 2 + 2],
        }
        for name, t in want.items():
            assert torch.equal(buffers[name], t), (rank, name, buffers[name], t)
            checked += t.numel()
    return checked


def test_mapped_plan_runs_through_execute_on_views() -> None:
    got = run(_job, 4, timeout=120)
    assert got[:2] == [0, 0] and got[2] == got[3] == (12 + 12 + 10) * 4 // 2 + 10 * 2
