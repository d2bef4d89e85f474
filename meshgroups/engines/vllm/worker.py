"""The worker side: a vLLM ``WeightTransferEngine`` that joins the trainer's transfer world.

vLLM constructs one per worker (``weight_transfer_config={"backend": "meshgroups"}``; the name
is registered by ``meshgroups.engines.vllm.plugin.register``, vLLM's ``vllm.general_plugins``
entry point) with the worker's own model. Its life, driven by the trainer
(``meshgroups.engines.vllm.trainer.VLLMWeightSync``) through vLLM's front-end calls:

- ``init_weight_transfer_engine({"address": ..., "trainer_size": ..., ...})``: read the
  destination from the model (:func:`read_params`: names, local shards, tp sharding, fused
  parts, kv replicas), allocate one receive buffer per parameter (its local shard, in the layout
  the checkpoint loads), join the transfer world at ``address`` as rank ``trainer_size + tp
  rank``, exchange the destination with the trainer, and build the ``WeightSync`` (one plan, one
  group build) — the same object and checks as in one world.
- ``start_weight_update()`` / ``update_weights({"version": n})``: one ``WeightSync.sync()`` into
  the receive buffers: this worker receives its shard's bytes, nothing else.
- ``finish_weight_update()``: only after a complete sync, the buffers are committed into vLLM's
  parameters (copied in place; a layer whose post-load processing repacked its weight — vLLM's
  CPU linear layers keep only a packed copy — gets its weight back from the buffer and the
  processing again), and the version becomes ``n``. A failed or partial update commits nothing:
  the model keeps serving the last complete version.

    >>> # vLLM does this in each worker:                                # doctest: +SKIP
    >>> engine = MeshgroupsWeightTransferEngine(config, vllm_config, device, model)
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from meshgroups.engines import TransferWorld
from meshgroups.engines.vllm.destination import engine_destinations
from meshgroups.engines.vllm.read import read_params, reprocess
from meshgroups.errors import LayoutError
from meshgroups.layout import Layout
from meshgroups.transfer import NameMap, TransferError, WeightSync

logger = logging.getLogger(__name__)


@dataclass
class MeshgroupsInitInfo(WeightTransferInitInfo):
    """``init_weight_transfer_engine``'s ``init_info`` for the ``meshgroups`` backend.

    Attributes:
        address: ``host:port`` of the transfer world's store (trainer rank 0 hosts it).
        trainer_size: the trainer's ranks in the transfer world (ranks ``[0, trainer_size)``).
        timeout: seconds; bounds the rendezvous and every wait of a sync.

    The trainer's layout and ``WeightSync`` settings (``cast``, ``allow_unused``,
    ``bucket_bytes``) travel over the transfer world itself, once it is up.
    """

    address: str
    trainer_size: int
    timeout: float = 300.0


@dataclass
class MeshgroupsUpdateInfo(WeightTransferUpdateInfo):
    """``update_weights``'s ``update_info``: the version this update makes (an int, from the trainer)."""

    version: int


class MeshgroupsWeightTransferEngine(WeightTransferEngine[MeshgroupsInitInfo, MeshgroupsUpdateInfo]):
    """vLLM worker side of the ``meshgroups`` backend (see the module docstring).

    Attributes:
        version: the last committed version (0: the weights vLLM loaded).
        sync: the ``WeightSync`` (``None`` before init and after a failure).
        last_report: the last complete sync's ``Report`` (``bytes_received``: this worker's shard).
        refused: why the last init was refused (a family map that disagrees with vLLM's layers:
            every rank computes the same ``LayoutError``, the trainer's ranks raise it, the engine
            stays up), else ``None``.
    """

    init_info_cls = MeshgroupsInitInfo
    update_info_cls = MeshgroupsUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.version = 0
        self.world: TransferWorld | None = None
        self.sync: WeightSync | None = None
        self.buffers: dict[str, torch.Tensor] = {}
        self.last_report: Any = None
        self._pending: tuple[int, Any] | None = None
        self._rank = self._tp_rank = 0
        self.refused: str | None = None

    # ------------------------------------------------------------------ init
    def init_transfer_engine(self, init_info: MeshgroupsInitInfo) -> None:
        """Join the transfer world and plan (collective with every trainer rank and worker).

        Raises:
            LayoutError: the model has a layer this backend cannot describe (also raised on the
                trainer's ranks, by the plan, for what does not match). A family map that
                disagrees with vLLM's layers is not raised here (see ``refused``).
            StoreConnectionError: no rendezvous within the timeout.
        """
        self.shutdown()
        self.refused = None
        params, tp_rank, tp = read_params(self.model)
        if self.parallel_config.pipeline_parallel_size != 1 or self.parallel_config.data_parallel_size != 1:
            raise LayoutError(
                "the meshgroups backend runs engines with pipeline_parallel_size=1 and data_parallel_size=1 "
                f"(got pp={self.parallel_config.pipeline_parallel_size}, dp={self.parallel_config.data_parallel_size})"
            )
        device = next(iter(self.model.parameters())).device
        self.buffers = {
            p.name: torch.empty(p.local_shape, dtype=getattr(torch, p.dtype), device=device) for p in params
        }
        trainer_size = int(init_info.trainer_size)
        self._rank, self._tp_rank = trainer_size + tp_rank, tp_rank
        size = trainer_size + tp
        world = TransferWorld.join(init_info.address, self._rank, size, timeout=init_info.timeout)
        self.world = world
        world.store.set(f"meshgroups/engine/{tp_rank}/pid", str(os.getpid()))
        try:
            with world.active():
                # One exchange over the transfer world: the trainer has no vLLM, so the workers
                # tell it what they hold (their Params); the trainer's rank 0 tells the workers its
                # layout, WeightSync settings and family map. Every rank then derives the same
                # destination (engine_destinations) — or raises the same LayoutError.
                gathered: list[Any] = [None] * size
                dist.all_gather_object(gathered, ("engine", params))
                trainer = gathered[0]
                if not (isinstance(trainer, tuple) and trainer[0] == "trainer"):
                    raise LayoutError(
                        f"transfer rank 0 is not the trainer's rank 0 (it sent {type(trainer).__name__})"
                    )
                _, trainer_layout, settings, family = trainer
                try:
                    weights, name_map = engine_destinations(
                        [g[1] for g in gathered[trainer_size:]],
                        tp,
                        None if family is None else NameMap.loads(family),
                    )
                except LayoutError as exc:
                    # Every rank computed this refusal from the same data: the trainer's ranks
                    # raise it. Raised here too it would shut the engine down (vLLM treats a
                    # worker's failed RPC as fatal): the engine stays up, uninitialised, serving
                    # its last version, and a later init with a right map works.
                    logger.warning("meshgroups: init refused (the trainer raises it): %s", exc)
                    self.refused = str(exc)
                    self._broken()
                    return
                self.sync = WeightSync(
                    None,
                    trainer_layout,
                    self.buffers,
                    Layout(tp=tp, rank_offset=trainer_size),
                    rollout_weights=weights,
                    name_map=name_map,
                    timeout=init_info.timeout,
                    **settings,
                )
        except BaseException:
            self._broken()
            raise

    # ------------------------------------------------------------------ updates
    def start_weight_update(self) -> None:
        """Nothing to prepare: the receive buffers were allocated at init."""
        if self.sync is None:
            raise RuntimeError(
                "the meshgroups weight-transfer engine is not initialised (or its last update failed): "
                "the trainer calls init_weight_transfer_engine first"
            )
        self._pending = None

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """vLLM's entry: parse, receive (no device synchronisation on CPU)."""
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type != "cpu" and torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: MeshgroupsUpdateInfo) -> None:
        """One ``WeightSync.sync()`` into the receive buffers (collective with the trainer).

        Raises:
            TransferError: the sync failed (a trainer rank gone, a timeout); nothing is
                committed, the model keeps its weights, and this engine needs a new init.
        """
        if self.sync is None or self.world is None:
            raise RuntimeError("the meshgroups weight-transfer engine is not initialised")
        try:
            with self.world.active():
                report = self.sync.sync()
        except TransferError:
            self._broken()
            raise
        self._pending = (int(update_info.version), report)

    def finish_weight_update(self) -> None:
        """Commit a complete update into vLLM's parameters (local), then record its version.

        Raises:
            RuntimeError: no complete update since ``start_weight_update`` (nothing committed).
        """
        if self._pending is None:
            raise RuntimeError(
                "finish_weight_update: no complete update was received since start_weight_update; the model "
                f"keeps version {self.version}"
            )
        version, report = self._pending
        self._commit()  # local: every worker's sync completed (execute's last agreement)
        self.version, self.last_report, self._pending = version, report, None
        if self.world is not None:
            self.world.store.set(
                f"meshgroups/engine/{self._tp_rank}/report",
                json.dumps(
                    {
                        "version": version,
                        "bytes_received": report.bytes_received,
                        "buckets": report.buckets,
                        "shard_bytes": sum(b.numel() * b.element_size() for b in self.buffers.values()),
                        # what was committed, for a check without gathering (a float64 sum per worker)
                        "checksum": float(sum(b.double().sum().item() for b in self.buffers.values())),
                    }
                ),
            )

    @torch.no_grad()
    def _commit(self) -> None:
        """Buffers -> the model. A parameter still in its loaded layout is copied in place; one
        that post-load processing replaced (an empty CPU linear weight, its packed copy held by
        the layer) gets a fresh copy of the buffer, and every layer touched — also a layer
        sharing a written parameter (a tied head) — runs its processing again."""
        modules = dict(self.model.named_modules())
        written: set[int] = set()
        for name, buf in self.buffers.items():
            owner, _, leaf = name.rpartition(".")
            module = modules[owner]
            param = getattr(module, leaf)
            if tuple(param.shape) == tuple(buf.shape):
                param.data.copy_(buf)
            else:
                module.register_parameter(leaf, torch.nn.Parameter(buf.clone(), requires_grad=False))
                param = getattr(module, leaf)
            written.add(id(param))
        reprocess(self.model, written, self.vllm_config.model_config.dtype)

    def _broken(self) -> None:
        if self.sync is not None:
            self.sync.close()
        if self.world is not None:
            self.world.close()
        self.sync, self.world, self._pending = None, None, None

    def shutdown(self) -> None:
        """Leave the transfer world (local); the model keeps its weights."""
        if self.sync is not None and self.world is not None:
            with self.world.active():
                self.sync.close()
        self._broken()


__all__ = ["MeshgroupsInitInfo", "MeshgroupsUpdateInfo", "MeshgroupsWeightTransferEngine", "read_params"]
