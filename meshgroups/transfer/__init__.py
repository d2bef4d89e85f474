"""Weight transfer for RL: where each weight lives on a layout, a plan to move it, and the
objects an RL loop holds to move it.

The pipeline, one private folder per stage (numpy until the last): ``_spec`` (where a weight
lives: ``Weight``, ``Shard``, ``Replicate``, ``Box``) → ``_names/`` (name maps, model families,
stacked experts, block fp8: a rollout weight as links to trainer weights) → ``_plan/`` (who
sends which slice to whom: ``plan_transfer``) → ``_run/`` (torch: the groups, buckets, steps,
``execute``, ``WeightSync``). Everything a user calls is imported from here. The plan side loads
with the package; the torch side loads on first use, so ``import meshgroups.transfer`` imports
no torch::

    >>> from meshgroups import Layout
    >>> from meshgroups.transfer import Shard, Weight, plan_transfer
    >>> w = Weight("w", (4, 4), placements={"tp": Shard(0)})
    >>> plan_transfer(Layout(tp=2), [w], Layout(tp=4, rank_offset=2), [w]).n_messages
    4
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from meshgroups import _deprecated
from meshgroups.errors import PlanError, TransferError
from meshgroups.transfer._names.conventions import (
    CONVENTIONS,
    PRESET_MAPS,
    ModelConfig,
    hf_to_megatron,
    layer_names,
    megatron_to_hf,
    preset_map,
    vllm_map,
)
from meshgroups.transfer._names.expand import map_weights
from meshgroups.transfer._names.families import hf_to_vllm, moe_layers
from meshgroups.transfer._names.families_megatron import hf_to_megatron_family, megatron_to_hf_family
from meshgroups.transfer._names.names import NameMap, Rule, Segment
from meshgroups.transfer._names.presets import ALIASES, FSDP_DIMS, HEADS, MODELS, model_config, model_weights
from meshgroups.transfer._names.quant import BlockFP8
from meshgroups.transfer._names.stacking import Stack, expert_order, stack_experts
from meshgroups.transfer._plan.plan import Message, TransferPlan, plan_transfer
from meshgroups.transfer._spec import Box, Placement, Replicate, Shard, Weight

if TYPE_CHECKING:
    from meshgroups.transfer._run.delta_codec import DeltaPolicy, DeltaStats
    from meshgroups.transfer._run.execute import DEFAULT_BUCKET_BYTES, Progress, Report, execute
    from meshgroups.transfer._run.fanout_groups import TransferGroups
    from meshgroups.transfer._run.fp8 import quantize_blocks
    from meshgroups.transfer._run.jobs import Job, init_job
    from meshgroups.transfer._run.sync import WeightSync
    from meshgroups.transfer._run.sync_delta import adopt
    from meshgroups.transfer._run.torch_io import local_weights, module_weights

# The torch side: name -> its private module, imported on first use.
_TORCH_SIDE = {
    "DeltaPolicy": "_run.delta_codec",
    "DeltaStats": "_run.delta_codec",
    "DEFAULT_BUCKET_BYTES": "_run.execute",
    "Progress": "_run.execute",
    "Report": "_run.execute",
    "execute": "_run.execute",
    "TransferGroups": "_run.fanout_groups",
    "quantize_blocks": "_run.fp8",
    "Job": "_run.jobs",
    "init_job": "_run.jobs",
    "WeightSync": "_run.sync",
    "adopt": "_run.sync_delta",
    "local_weights": "_run.torch_io",
    "module_weights": "_run.torch_io",
}

__all__ = [
    "CONVENTIONS",
    "PRESET_MAPS",
    "BlockFP8",
    "Box",
    "DeltaPolicy",
    "DeltaStats",
    "Job",
    "Message",
    "ModelConfig",
    "NameMap",
    "Placement",
    "PlanError",
    "Replicate",
    "Report",
    "Rule",
    "Segment",
    "Shard",
    "Stack",
    "TransferError",
    "TransferGroups",
    "TransferPlan",
    "Weight",
    "WeightSync",
    "adopt",
    "execute",
    "expert_order",
    "hf_to_megatron",
    "hf_to_megatron_family",
    "hf_to_vllm",
    "init_job",
    "layer_names",
    "local_weights",
    "map_weights",
    "megatron_to_hf",
    "megatron_to_hf_family",
    "model_config",
    "model_weights",
    "module_weights",
    "moe_layers",
    "plan_transfer",
    "preset_map",
    "quantize_blocks",
    "stack_experts",
    "vllm_map",
]

# Not in __all__: for meshgroups' own packages above this one (the CLI's preset tables, the
# bucket size healing uses, the progress record the vLLM trainer reports).


def __getattr__(name: str) -> Any:
    if name in _TORCH_SIDE:
        return getattr(import_module(f"meshgroups.transfer.{_TORCH_SIDE[name]}"), name)
    return _deprecated.old_name(__name__, name)
