"""Packed buckets: one point-to-point message per peer, direction and step of a bucket. One gloo
job of 4 ranks: a tp=2 trainer of many small weights (fused into gate_up / qkv, a transposed
expert stack, a cast) into a tp=2 rollout, executed unpacked and packed: identical buffers bit
for bit, identical bytes, fewer messages (one per peer and step), and the packed buffers kept
across calls (the second call allocates none); overlapped buckets (the next bucket posted before
the last is unpacked) against one bucket at a time: the same bytes, and the order of posts."""

from __future__ import annotations

import pytest
import torch

from meshgroups.transfer._run.steps import PackBuffers, land, pack

from ..support.dist import run


def _job(rank: int, world: int) -> dict:
    import torch

    from meshgroups import Layout, Topology
    from meshgroups.transfer import Shard, Weight, plan_transfer
    from meshgroups.transfer._run.execute import execute
    from meshgroups.transfer._run.steps import PackBuffers

    trainer, rollout = Layout(tp=2), Layout(tp=2, rank_offset=2)
    t_w = [Weight(f"w{i}", (4 + i, 6), "float32", {"tp": Shard(1)}) for i in range(6)]
    t_w += [Weight(f"e{e}", (6, 4), "float32", {"tp": Shard(0)}) for e in range(2)]  # stored [H, I]
    r_w = [Weight(f"w{i}", (4 + i, 6), "bfloat16", {"tp": Shard(0)}) for i in range(6)]
    r_w.append(Weight("moe_w2", (2, 4, 6), "bfloat16", {"tp": Shard(1)}))
    nm = {"moe_w2": {"stack": [[{"source": f"e{e}", "transpose": True}] for e in (1, 0)]}}
    plan = plan_transfer(
        trainer, t_w, rollout, r_w, Topology(node=2), rank=rank, name_map=nm, cast="bfloat16"
    )
    assert plan.mapping is not None
    g = torch.Generator().manual_seed(1)
    full = {w.name: torch.randn(w.shape, generator=g) for w in t_w}
    local = {
        w.name: full[w.name][tuple(slice(a, b) for a, b in bx)] for w in t_w if (bx := w.box(trainer, rank))
    }
    out: dict = {}
    results = {}
    packs = PackBuffers()
    for packed in (False, True, True):
        bufs = {w.name: torch.full(s, float("nan"), dtype=torch.bfloat16) for w in r_w
                if (s := plan.mapping.buffer_shape(w.name, rank)) is not None}  # fmt: skip
        srcs, dsts = {}, {}
        for ln in plan.mapping.links.values():
            if (b := ln.src_local(rank)) is not None:
                srcs[ln.name] = ln.view_source(local[ln.source][tuple(slice(x, y) for x, y in b)])
            if (b := ln.dst_local(rank)) is not None:
                dsts[ln.name] = bufs[ln.rollout][tuple(slice(x, y) for x, y in b)]
        before = [t.data_ptr() for t in packs._bufs.values()]
        report = execute(plan, srcs, dsts, timeout=60, bucket_bytes=256, packed=packed, buffers=packs)
        if packed and before:
            assert [t.data_ptr() for t in packs._bufs.values()] == before  # kept, not reallocated
        results.setdefault(packed, []).append((bufs, report))
    # overlapped (the default) against one bucket at a time, spying on execute's own post and
    # finish (the real ones run): bucket b + 1's step 0 is posted before bucket b's step 0 is
    # waited for and unpacked; one bucket at a time, never. Same bytes in the buffers.
    import sys

    ex = sys.modules["meshgroups.transfer._run.execute"]  # the module (the package attribute is the function)

    real_post, real_finish = ex.post, ex.finish
    for overlap in (False, True):
        events: list = []

        def spy_post(step, groups, tag, buffers=None, key=None, _ev=events):
            _ev.append(("post", key))
            return real_post(step, groups, tag, buffers, key)

        def spy_finish(posted, timeout, _ev=events):
            _ev.append(("finish", posted.key))
            return real_finish(posted, timeout)

        ex.post, ex.finish = spy_post, spy_finish
        bufs = {w.name: torch.full(s, float("nan"), dtype=torch.bfloat16) for w in r_w
                if (s := plan.mapping.buffer_shape(w.name, rank)) is not None}  # fmt: skip
        dsts = {ln.name: bufs[ln.rollout][tuple(slice(x, y) for x, y in b)]
                for ln in plan.mapping.links.values() if (b := ln.dst_local(rank)) is not None}  # fmt: skip
        try:
            report = execute(plan, srcs, dsts, timeout=60, bucket_bytes=256, overlap=overlap, buffers=packs)
        finally:
            ex.post, ex.finish = real_post, real_finish
        assert report.buckets > 2, report
        for n, t in results[True][0][0].items():
            assert torch.equal(t.view(torch.int16), bufs[n].view(torch.int16)), (overlap, n)
        for b in range(report.buckets - 1):
            ahead = events.index(("post", (b + 1, 0))) < events.index(("finish", (b, 0)))
            assert ahead == overlap, (overlap, b, events)
        out[f"overlap_{overlap}"] = len(events)
    (b0, r0), (b1, r1) = results[False][0], results[True][0]
    for n in b0:
        assert torch.equal(b0[n].view(torch.int16), b1[n].view(torch.int16)), n
        assert not torch.isnan(b1[n].float()).any(), n
    assert (r0.bytes_sent, r0.bytes_received) == (r1.bytes_sent, r1.bytes_received)
    out["unpacked"], out["packed"] = r0.p2p_messages, r1.p2p_messages
    out["buckets"] = r1.buckets
    if rank in rollout:  # the stack's entry 0 is expert 1, transposed
        tp = rollout.coords(rank)["tp"]
        assert torch.equal(b1["moe_w2"][0], full["e1"].T[tp * 2 : tp * 2 + 2].to(torch.bfloat16))
    return out


@pytest.mark.processes
def test_packed_messages_same_bytes_fewer_messages() -> None:
    res = run(_job, 4, timeout=300)
    for r in res:
        assert r["packed"] <= r["unpacked"], r
    # every rank talks to its one or two peers: at most one message per peer, direction, step, bucket
    assert sum(r["packed"] for r in res) < sum(r["unpacked"] for r in res)
    assert all(r["packed"] <= 2 * 2 * 2 * r["buckets"] for r in res)


def test_pack_orders_and_unpacks() -> None:
    bufs = PackBuffers()
    # a bf16 slice first: the float32 one starts at byte 2, which float32 cannot be viewed at
    a, b = torch.arange(3, dtype=torch.float32), torch.tensor([7], dtype=torch.bfloat16)
    msgs, _ = pack([(True, b, 1), (True, a, 1)], bufs, "k")
    assert [(s, t.numel(), p) for s, t, p in msgs] == [(True, 14, 1)]  # no padding
    ra, rb = torch.empty(6)[::2], torch.empty(1, dtype=torch.bfloat16)  # a strided view too
    rmsgs, unpack = pack([(False, rb, 1), (False, ra, 1)], bufs, "k")
    rmsgs[0][1].copy_(msgs[0][1])  # what the wire does
    for piece, view in unpack:
        land(piece, view)
    assert torch.equal(ra, a) and torch.equal(rb, b)
    assert len(bufs) == 2 and bufs.nbytes() == 28
