"""megatron-core running on meshgroups (optional: needs megatron-core 0.16.1 installed).

One job on 8 gloo processes: ``meshgroups.compat.megatron.install(strategy="local")`` before
``import megatron.core``; then megatron-core's own modules — ``ProcessGroupCollection``,
``tensor_parallel.mappings`` collectives, ``RowParallelLinear``, ``vocab_parallel_cross_entropy``,
megatron_fsdp's ``FSDPDistributedIndex``, ``get_forward_backward_func`` — run on compat's
groups; ``uninstall()``, import megatron-core again (its own ``parallel_state`` this time) and
compare every ``ProcessGroupCollection`` rank list with megatron-core's.
"""

from __future__ import annotations

import importlib.util
import warnings

import pytest
from meshgroups.compat._megatron_version import installed_megatron_core

from ..support.dist import run

# find_spec, not importorskip: the workers import this module, and megatron-core must not be
# imported before install().
HAVE_MCORE = (
    importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None
)
# this job is written for megatron-core 0.16.1 (its create_all_gather_group keyword, 20 fields)
HAVE_MCORE = HAVE_MCORE and installed_megatron_core()[1] == "0.16"

CONFIG = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2, "expert_model_parallel_size": 2}


def _collection_ranks(pgc_cls) -> dict:
    import torch.distributed as dist

    pgs = pgc_cls.use_mpu_process_groups()
    out = {}
    for name in sorted(vars(pgs)):
        value = getattr(pgs, name)
        if isinstance(value, list):
            out[name] = [dist.get_process_group_ranks(g) for g in value]
        else:
            out[name] = None if value is None else dist.get_process_group_ranks(value)
    return out


def _run_megatron_modules(rank: int) -> int:
    """megatron-core's modules on the installed compat state; returns the number of checks."""
    import torch
    import torch.distributed as dist
    from megatron.core import ModelParallelConfig, parallel_state, tensor_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_without_interleaving
    from megatron.core.tensor_parallel import mappings

    checks = 0
    tp_group = parallel_state.get_tensor_model_parallel_group()
    tp_ranks = dist.get_process_group_ranks(tp_group)
    x = torch.full((2, 4), float(rank + 1))
    y = mappings.reduce_from_tensor_model_parallel_region(x.clone())
    assert torch.equal(y, torch.full((2, 4), float(sum(r + 1 for r in tp_ranks))))
    # (megatron-core's gathers allocate on CUDA; its all-to-all does not) expert-parallel all-to-all
    ep_group = parallel_state.get_expert_model_parallel_group()
    ep_ranks = dist.get_process_group_ranks(ep_group)
    swapped = mappings.all_to_all(ep_group, torch.tensor([rank * 10.0, rank * 10.0 + 1]))
    assert swapped.tolist() == [r * 10.0 + ep_ranks.index(rank) for r in ep_ranks]
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    part = mappings.scatter_to_tensor_model_parallel_region(torch.arange(8.0).reshape(1, 8))
    assert part.tolist() == [[4.0 * tp_rank + i for i in range(4)]]
    checks += 3
    # RowParallelLinear: input split over tp, output all-reduced: equals the full matmul
    config = ModelParallelConfig(
        tensor_model_parallel_size=2, use_cpu_initialization=True, perform_initialization=True
    )
    torch.manual_seed(0)
    full_w = torch.randn(3, 8)
    layer = tensor_parallel.RowParallelLinear(
        8,
        3,
        config=config,
        init_method=torch.nn.init.zeros_,
        bias=False,
        input_is_parallel=True,
        skip_bias_add=True,
    )
    with torch.no_grad():
        layer.weight.copy_(full_w[:, 4 * tp_rank : 4 * tp_rank + 4])
    inp = torch.arange(16.0).reshape(2, 8)
    out, _ = layer(inp[:, 4 * tp_rank : 4 * tp_rank + 4].unsqueeze(0))
    assert torch.allclose(out.squeeze(0), inp @ full_w.T, atol=1e-5)
    checks += 1
    # vocab-parallel cross entropy: each tp rank holds half the vocabulary
    logits = torch.randn(1, 2, 6, generator=torch.Generator().manual_seed(1))
    target = torch.tensor([[1, 4]])
    loss = tensor_parallel.vocab_parallel_cross_entropy(
        logits[..., 3 * tp_rank : 3 * tp_rank + 3].clone(), target
    )
    want = torch.nn.functional.cross_entropy(logits.reshape(2, 6), target.reshape(2), reduction="none")
    assert torch.allclose(loss.reshape(2), want, atol=1e-5)
    checks += 1
    assert get_forward_backward_func() is forward_backward_pipelining_without_interleaving
    checks += 1
    return checks


def _fsdp_index(rank: int) -> int:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.distributed.fsdp.src.megatron_fsdp.utils import FSDPDistributedIndex

    mg = parallel_state.get_mesh_groups()
    mesh = mg.mesh
    mg.flatten("dp", "cp", name="dp_cp")
    index = FSDPDistributedIndex(mesh, dp_shard_dim="dp_cp", tp_dim="tp")
    dp_cp = dist.get_process_group_ranks(parallel_state.get_data_parallel_group(with_context_parallel=True))
    assert dist.get_process_group_ranks(index.fsdp_group) == dp_cp
    assert index.fsdp_group_ag is parallel_state.get_data_parallel_group(
        with_context_parallel=True, independent_all_gather=True
    )
    assert dist.get_process_group_ranks(index.fsdp_group_ag) == dp_cp
    return 3


def worker(rank: int, world: int) -> dict:
    import sys

    import meshgroups.compat.megatron as mcm
    import meshgroups.compat.parallel_state as compat_ps

    warnings.simplefilter("ignore")
    mcm.install(strategy="local")
    try:
        import megatron.core
        from megatron.core import parallel_state
        from megatron.core.process_groups_config import ProcessGroupCollection

        assert (
            megatron.core.parallel_state is compat_ps
            and parallel_state is compat_ps
            and megatron.core.mpu is compat_ps
        )
        parallel_state.initialize_model_parallel(
            2, 2, None, create_all_gather_group=True, expert_model_parallel_size=2
        )
        assert compat_ps.get_mesh_groups().strategy == "local"
        ours = _collection_ranks(ProcessGroupCollection)
        checks = _run_megatron_modules(rank) + _fsdp_index(rank)
        parallel_state.destroy_model_parallel()
    finally:
        mcm.uninstall()
    assert "megatron.core" not in sys.modules
    from megatron.core import parallel_state as theirs_ps
    from megatron.core.process_groups_config import ProcessGroupCollection as Theirs

    assert theirs_ps is not compat_ps
    theirs_ps.initialize_model_parallel(2, 2, None, expert_model_parallel_size=2)
    theirs = _collection_ranks(Theirs)
    theirs_ps.destroy_model_parallel()
    assert ours == theirs, {
        k: (ours.get(k), theirs.get(k)) for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k)
    }
    return {"checks": checks, "fields": len(ours)}


@pytest.mark.processes
@pytest.mark.skipif(
    not HAVE_MCORE, reason="optional: pip install --no-deps megatron-core==0.16.1 packaging einops"
)
def test_megatron_core_runs_on_meshgroups_world8():
    for result in run(worker, 8, timeout=400):
        assert result["checks"] >= 9 and result["fields"] == 20
