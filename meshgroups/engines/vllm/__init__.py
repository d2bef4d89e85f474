"""The vLLM backend of weight sync: ``weight_transfer_config={"backend": "meshgroups"}``.

What a user holds is on the trainer: ``VLLMWeightSync`` (one call per step), over a client of
the engine — ``HTTPClient`` for a ``vllm serve`` process, ``LLMClient`` for an in-process
``vllm.LLM``. The workers' side (``MeshgroupsWeightTransferEngine``) is loaded by vLLM itself,
through ``register()``, the ``vllm.general_plugins`` entry point. The private modules:
``_trainer`` (``VLLMWeightSync``), ``_clients``, ``_protocol`` (the three exchanges between
trainer ranks and workers: init offers, the version preflight, commit reports), ``_destination``
(a worker's parameters as global weights, checked against a family map; vLLM-free), ``_read`` (a
worker's model read as data), ``_worker`` (the worker side), ``_api`` (the one adapter over
vLLM's weight-transfer API, release by release), ``_trainer_engine`` (the trainer side as vLLM's
``TrainerWeightTransferEngine``), ``_lora`` (LoRA adapters into vLLM's LoRA slots; LoRA merged
into the base at the sender), ``_plugin``.

Importing this package imports no vLLM (and no torch); each name loads on first use::

    >>> import meshgroups.engines.vllm
    >>> meshgroups.engines.vllm.BACKEND
    'meshgroups'
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from meshgroups.engines.vllm._plugin import BACKEND, register

if TYPE_CHECKING:
    from meshgroups.engines.vllm._clients import HTTPClient, LLMClient, WeightSyncClient
    from meshgroups.engines.vllm._destination import Param, destinations, engine_destinations
    from meshgroups.engines.vllm._lora import LoRA, lora_config, lora_weights, merged_weights
    from meshgroups.engines.vllm._trainer import VLLMWeightSync
    from meshgroups.engines.vllm._trainer_engine import MeshgroupsTrainerEngine, MeshgroupsTrainerInitInfo

_WHERE = {
    "HTTPClient": "_clients",
    "LLMClient": "_clients",
    "WeightSyncClient": "_clients",
    "Param": "_destination",
    "destinations": "_destination",
    "engine_destinations": "_destination",
    "VLLMWeightSync": "_trainer",
    "LoRA": "_lora",
    "lora_config": "_lora",
    "lora_weights": "_lora",
    "merged_weights": "_lora",
    "MeshgroupsTrainerEngine": "_trainer_engine",
    "MeshgroupsTrainerInitInfo": "_trainer_engine",
}

__all__ = [
    "BACKEND",
    "HTTPClient",
    "LLMClient",
    "LoRA",
    "MeshgroupsTrainerEngine",
    "MeshgroupsTrainerInitInfo",
    "Param",
    "VLLMWeightSync",
    "WeightSyncClient",
    "destinations",
    "engine_destinations",
    "lora_config",
    "lora_weights",
    "merged_weights",
    "register",
]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(import_module(f"meshgroups.engines.vllm.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'meshgroups.engines.vllm' has no attribute {name!r}")
