"""Helpers of the weight-transfer tests on real processes: full tensors known on every rank,
their shards and NaN-filled buffers, the element-for-element check, the groups-talk check and
one checked ``execute`` call."""

from __future__ import annotations


def _full(weights, seed=0):
    import torch

    out = {}
    for i, w in enumerate(weights):
        n = 1
        for s in w.shape:
            n *= s
        out[w.name] = (torch.arange(n, dtype=torch.float32) + 1000.0 * (i + 1) + seed).reshape(w.shape)
    return out


def _cut(t, box):
    return t[tuple(slice(a, b) for a, b in box)].clone()


def _shards(layout, weights, full, rank):
    return {w.name: _cut(full[w.name], w.box(layout, rank)) for w in weights if w.box(layout, rank)}


def _buffers(layout, weights, rank):
    import torch

    out = {}
    for w in weights:
        box = w.box(layout, rank)
        if box:
            out[w.name] = torch.full([b - a for a, b in box], float("nan"), dtype=getattr(torch, w.dtype))
    return out


def _check(layout, weights, buffers, full, rank, what):
    """Every element of every buffer equals the full tensor's slice; returns elements checked."""
    import torch

    checked = 0
    for w in weights:
        box = w.box(layout, rank)
        if box is None:
            assert w.name not in buffers
            continue
        want = _cut(full[w.name], box)
        assert torch.equal(buffers[w.name], want), (what, rank, w.name, box, buffers[w.name], want)
        checked += want.numel()
    return checked


def _talk_only(plan, groups, rank):
    """Every transfer group is one sender and receivers that all get one same slice from it,
    and this rank's routes (derived locally on receivers) are every fan-out it takes part in:
    checked against the whole plan's messages (``plan`` must be whole)."""
    fanout = {}
    for m in plan.messages:
        if m.src != m.dst:
            fanout.setdefault((m.weight, m.src, m.box, m.step), set()).add(m.dst)
    every = {k: (k[1], *sorted(d)) for k, d in fanout.items() if len(d) > 1}
    assert set(groups.sets) == set(every.values()), (groups.sets, every)
    assert groups.routes == {k: r for k, r in every.items() if rank in r}, (rank, groups.routes)
    return sum(1 for r in groups.routes.values() if r[0] != rank)  # fan-outs received


def _run(plan, srcs, dsts, groups, bucket_bytes, rank):
    from meshgroups.transfer._run.execute import execute

    seen = []
    report = execute(
        plan, srcs, dsts, bucket_bytes=bucket_bytes, progress=seen.append, groups=groups, timeout=60
    )
    assert [p.bucket for p in seen] == list(range(1, report.buckets + 1)), seen
    assert report.buckets >= 3, report.buckets  # small buckets: several of them
    names = [n for p in seen for n in p.weights_done]
    assert sorted(names) == sorted(d.name for _, d in plan.weights), names  # each once
    done = [p.bytes_done for p in seen]
    assert done == sorted(done) and (not seen or done[-1] == seen[-1].bytes_total), done
    return report


def _sends_only(real, dropped):
    """A stand-in for ``dist.batch_isend_irecv`` (``real``): at the first batch holding
    receives it posts only that batch's sends, puts ``real`` back, records the receives it
    dropped in ``dropped`` and raises (a rank failing mid-transfer, its peers' sends pending)."""
    import torch.distributed as dist

    def sends_only(ops):
        receives = [op for op in ops if op.op is dist.irecv]
        if not receives:
            return real(ops)
        dist.batch_isend_irecv = real
        dropped.extend(receives)
        sends = [op for op in ops if op.op is not dist.irecv]
        if sends:
            real(sends)
        raise RuntimeError("injected: receives never posted")

    return sends_only
