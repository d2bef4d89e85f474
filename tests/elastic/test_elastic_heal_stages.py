"""Healing a replica on layouts with pipeline stages (and other dims the weights' meshes do not
cover): each new replica's rank receives exactly the state of the survivors at its own
coordinates on every dim but the replica dim — never another stage's — and what cannot be
placed by that rule is refused on every rank. Real gloo processes, many layouts per job."""

from __future__ import annotations

import random

import pytest

from ..support.dist import run

pytestmark = pytest.mark.processes  # every test here starts processes

WORLD = 8


def _value(lay, rank, dim, salt):
    """A survivor's value, unique to its coordinates on every dim but ``dim``."""
    c = lay.coords(rank)
    return float(
        salt + sum((i + 1) * 10 ** (k + 1) for k, (d, i) in enumerate(sorted(c.items())) if d != dim)
    )


def _cases():
    rng = random.Random(34)
    sizes_pool = [{"pp": 2, "tp": 2}, {"pp": 2, "cp": 2}, {"pp": 2, "cp": 1, "tp": 2}, {"pp": 4}]
    cases = []
    for i in range(6):
        sizes = dict(sizes_pool[i % len(sizes_pool)], dp=2)
        names = list(sizes)
        rng.shuffle(names)
        permuted = i % 3 == 2  # a grid whose ranks do not increase along the dims
        cases.append(([(n, sizes[n]) for n in names], permuted, rng.randrange(1 << 30)))
    return cases


def _layout(dims, permuted, seed):
    import numpy as np

    from meshgroups import Layout

    lay = Layout(**dict(dims))
    if permuted:
        grid = np.random.default_rng(seed).permutation(WORLD).reshape(lay.shape)
        lay = Layout.from_grid(grid, lay.names)
    return lay


def _state(lay, mg, rank, healthy, salt, drop=None):
    import torch
    from torch.distributed.tensor import DTensor, Shard

    c = lay.coords(rank)

    def val(s):
        return _value(lay, rank, "dp", salt + s) if healthy else 0.0

    state = {}
    if "tp" in lay.names:  # covers tp: the values differ along pp (and cp), nothing says so
        state["w"] = DTensor.from_local(torch.full((2, 3), val(1)), mg.mesh["tp"], [Shard(0)])
        state["w.exp_avg"] = DTensor.from_local(torch.full((2, 3), val(2)), mg.mesh["tp"], [Shard(0)])
    state["norm"] = torch.full((4,), val(3))  # a plain tensor shared by name across stages
    state[f"layers.{c['pp']}.b"] = torch.full((5,), val(4 + c["pp"]))  # stage-specific names
    state[f"layers.{c['pp']}.b.step"] = torch.full((1,), val(9))
    if drop is not None and drop in state:
        del state[drop]
    return state


def _expected(lay, rank, salt, name):
    c = lay.coords(rank)
    s = {"w": 1, "w.exp_avg": 2, "norm": 3, f"layers.{c['pp']}.b": 4 + c["pp"], f"layers.{c['pp']}.b.step": 9}
    return _value(lay, rank, "dp", salt + s[name])


def _worker(rank, world, cases):
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    from meshgroups import Layout, init_mesh
    from meshgroups.elastic._heal import fill_replicas

    out = {"cases": 0}
    # The reproduction of the issue, as a user wrote it.
    lay = Layout(pp=2, dp=2, tp=2)
    c = lay.coords(rank)
    with init_mesh(lay) as mg:
        value = float(10 + c["pp"]) if c["dp"] == 0 else 0.0
        w = DTensor.from_local(torch.full((2,), value), mg.mesh["tp"], [Shard(0)])
        fill_replicas(lay, "dp", [1], {"w": w})
        assert w.to_local().tolist() == [10.0 + c["pp"]] * 2, (rank, c, w.to_local().tolist())
    for dims, permuted, seed in cases:
        lay = _layout(dims, permuted, seed)
        healthy = lay.coords(rank)["dp"] == 0
        with init_mesh(lay) as mg:
            state = _state(lay, mg, rank, healthy, seed % 1000)
            report = fill_replicas(lay, "dp", [1], state)
            for name, t in state.items():
                local = t.to_local() if isinstance(t, DTensor) else t
                want = _expected(lay, rank, seed % 1000, name)
                assert bool((local == want).all()), (
                    rank,
                    dims,
                    permuted,
                    name,
                    local.flatten()[:2].tolist(),
                    want,
                )
            if not healthy:
                assert sorted(report.weights) == sorted(state), (report.weights, sorted(state))
                assert report.bytes_received == sum(
                    (t.to_local() if isinstance(t, DTensor) else t).nbytes for t in state.values()
                )
            # Refused on every rank: a new replica's stage-0 rank lacks a weight its stage has.
            c = lay.coords(rank)
            drop = "layers.0.b" if c["dp"] == 1 and c["pp"] == 0 else None
            try:
                fill_replicas(lay, "dp", [1], _state(lay, mg, rank, healthy, 0, drop=drop))
            except ValueError as e:
                assert "'layers.0.b'" in str(e) and "must hold it" in str(e), str(e)
            else:
                raise AssertionError("a weight missing on the new replica's stage-0 ranks was not refused")
            # Refused on every rank: one weight a DTensor on some ranks, a plain tensor on others.
            if "tp" in lay.names:
                odd = _state(lay, mg, rank, healthy, 0)
                if c["pp"] == 1:
                    odd["w"] = odd["w"].to_local()
                with pytest.raises(ValueError, match=r"'w' is placed over mesh dims"):
                    fill_replicas(lay, "dp", [1], odd)
        out["cases"] += 1
    dist.barrier()
    return out


def test_a_new_replica_gets_the_state_of_its_own_stage_on_every_layout():
    cases = _cases()
    results = run(_worker, WORLD, cases, timeout=600)
    assert all(r["cases"] == len(cases) for r in results), results
