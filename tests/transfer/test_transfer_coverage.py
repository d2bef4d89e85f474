"""Coverage beyond parameters (issue 47): a module's persistent buffers (a router's correction
bias) and an MTP / draft module are destinations like its weights. On 4 real gloo processes
(trainer ranks 0-1, rollout ranks 2-3), one spawned job:

- a rollout whose MTP module (or persistent buffer) the trainer lacks is refused on every rank
  with a ``LayoutError`` naming the tensor, before any byte moves (the rollout unchanged);
- with both, every rollout tensor — parameters, the persistent buffer, the MTP module — equals
  the trainer's bit for bit after a sync, and again after the trainer changed them in place; the
  non-persistent buffer (a rotary cache, derived) is no destination and stays as it was.
"""

from __future__ import annotations

import pytest

from ..support.dist import run

pytestmark = pytest.mark.processes  # every test here starts processes


def _model(mtp: bool, buffer: bool, seed: int):
    import torch

    torch.manual_seed(seed)
    m = torch.nn.Module()
    m.body = torch.nn.Linear(8, 8)
    m.router = torch.nn.Module()
    if buffer:
        m.router.register_buffer("e_score_correction_bias", torch.randn(4))  # persistent: state
    m.router.register_buffer("cache", torch.randn(3), persistent=False)  # derived: no destination
    if mtp:
        m.mtp = torch.nn.Linear(8, 8)
    return m


def _worker(rank: int, world: int) -> dict:
    import torch

    from meshgroups import Layout, LayoutError
    from meshgroups.transfer import WeightSync
    from meshgroups.transfer._run.torch_io import module_tensors

    trainer, rollout = Layout(tp=2), Layout(tp=2, rank_offset=2)
    out: dict = {}
    mine = rank >= 2
    dst = _model(mtp=True, buffer=True, seed=1) if mine else None
    before = {n: t.clone() for n, t in module_tensors(dst)} if dst is not None else {}
    for case, src_kind in (("no_mtp", (False, True)), ("no_buffer", (True, False))):
        src = None if mine else _model(*src_kind, seed=0)
        try:
            WeightSync(src, trainer, dst, rollout)
            out[case] = "no error"
        except LayoutError as exc:
            out[case] = str(exc)
    if dst is not None:  # refused before any byte moved
        out["unchanged"] = all(torch.equal(t, before[n]) for n, t in module_tensors(dst))
    src = None if mine else _model(True, True, seed=0)
    with WeightSync(src, trainer, dst, rollout) as sync:
        sync.sync()
        full = _model(True, True, seed=0)  # the trainer's values, known on every rank
        if dst is not None:
            out["first"] = all(torch.equal(t, dict(module_tensors(full))[n]) for n, t in module_tensors(dst))
        with torch.no_grad():  # the trainer changes its buffer and MTP head in place
            for m in [full] + ([src] if src is not None else []):
                m.router.e_score_correction_bias += 1.0
                m.mtp.weight.mul_(2.0)
        sync.sync()
        if dst is not None:
            out["second"] = all(torch.equal(t, dict(module_tensors(full))[n]) for n, t in module_tensors(dst))
            out["cache_kept"] = torch.equal(dst.router.cache, _model(True, True, 1).router.cache)
            out["names"] = [n for n, _ in module_tensors(dst)]
    return out


def test_persistent_buffers_and_an_mtp_module_are_destinations() -> None:
    results = run(_worker, 4, timeout=180)
    no_mtp = {r["no_mtp"] for r in results}
    no_buffer = {r["no_buffer"] for r in results}
    assert (
        len(no_mtp) == 1
        and "'mtp.weight'" in next(iter(no_mtp))
        and "nothing would write it" in next(iter(no_mtp))
    )
    assert len(no_buffer) == 1 and "'router.e_score_correction_bias'" in next(iter(no_buffer)), no_buffer
    for r in results[2:]:
        assert r["unchanged"] and r["first"] and r["second"] and r["cache_kept"], r
        assert r["names"] == [
            "body.weight", "body.bias", "mtp.weight", "mtp.bias", "router.e_score_correction_bias",
        ], r["names"]  # fmt: skip
