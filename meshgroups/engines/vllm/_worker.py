"""The worker side: a vLLM ``WeightTransferEngine`` that joins the trainer's transfer world.

vLLM constructs one per worker (``weight_transfer_config={"backend": "meshgroups"}``; the name
is registered by ``meshgroups.engines.vllm.register``, vLLM's ``vllm.general_plugins``
entry point) with the worker's own model, once per worker life: the version it serves survives
every trainer that connects to it. Its life, driven by the trainer
(``meshgroups.engines.vllm.VLLMWeightSync``) through vLLM's front-end calls, follows
the backend's protocol (:mod:`~meshgroups.engines.vllm._protocol`):

- ``init_weight_transfer_engine({"address": ..., "trainer_size": ..., ...})``: read the
  destination from the model (:func:`read_params`: parameters and persistent buffers, local
  shards, tp sharding, fused parts, kv replicas), allocate one receive buffer per tensor (its
  local shard, in the layout the checkpoint loads), join the transfer world at ``address`` as
  rank ``trainer_size + tp rank``, exchange offers with the trainer (the version it serves, or
  its refusal), and build the ``WeightSync`` (one plan, one group build).
- ``start_weight_update()`` / ``update_weights({"version": n})``: the preflight (the version
  agreed on every rank, or refused before any byte moves), then one ``WeightSync.sync()`` into
  the receive buffers: this worker receives its shard's bytes, nothing else.
- ``finish_weight_update()``: only after a complete sync, the buffers are committed into vLLM's
  parameters (copied in place; a layer whose post-load processing repacked its weight — vLLM's
  CPU linear layers keep only a packed copy — gets its weight back from the buffer and the
  processing again), the version becomes ``n`` and the commit report goes to the store. A
  failed, refused or partial update commits nothing: the model keeps serving the last complete
  version.

The receive buffers are kept across ``init_weight_transfer_engine`` calls while the model's
parameters are the same, with the version they hold (``buffer_version``): a delta sync
(``delta=True`` in the trainer's settings) is checked against them. An adapter sync (the
trainer's ``lora=``) receives the whole adapter into buffers of its own and, at the commit,
keeps it where vLLM's LoRA loader reads it (``_lora.install``); the base model and its buffers
are untouched.

None of these calls raises for a refusal or a failed transfer: it logs one line, records it
(``refused``) and returns, so vLLM's RPC channel is left clean and the next init or update on
the same engine works; the trainer's ranks raise it (they see it in the protocol's exchanges).

    >>> engine = MeshgroupsWeightTransferEngine(config, vllm_config, device, model)  # doctest: +SKIP
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from meshgroups.engines import TransferWorld
from meshgroups.engines.vllm._api import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from meshgroups.engines.vllm._lora import install, offered_destination
from meshgroups.engines.vllm._protocol import (
    TrainerOffer,
    VersionError,
    WorkerOffer,
    describe,
    first_refusal,
    gather,
    pid_key,
    preflight,
    rebuild,
    report_key,
)
from meshgroups.engines.vllm._read import read_params, reprocess
from meshgroups.errors import LayoutError, MeshConfigError, MismatchError, StoreConnectionError
from meshgroups.layout import Layout
from meshgroups.transfer import TransferError, WeightSync

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
    """``update_weights``'s ``update_info``: the version the trainer asked for (``None``: the
    next one). The version the update makes is agreed by every rank in the preflight
    (:mod:`~meshgroups.engines.vllm._protocol`)."""

    version: int | None = None


class MeshgroupsWeightTransferEngine(WeightTransferEngine[MeshgroupsInitInfo, MeshgroupsUpdateInfo]):
    """vLLM worker side of the ``meshgroups`` backend (see the module docstring).

    Attributes:
        version: the last committed version (0: the weights vLLM loaded); kept for the worker's
            life, whichever trainer connects.
        sync: the ``WeightSync`` (``None`` before init and after a failed transfer).
        last_report: the last complete sync's ``Report`` (``bytes_received``: this worker's shard).
        refused: ``"Class: message"`` of the last refused or failed call, else ``None``; the
            trainer's ranks raise the same error.
    """

    init_info_cls = MeshgroupsInitInfo
    update_info_cls = MeshgroupsUpdateInfo
    # vLLM's draft-model sessions (start_draft_weight_update) retarget the engine at another
    # model, which needs a plan of its own: not supported (the draft is no destination yet).
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.version = 0
        self.world: TransferWorld | None = None
        self.sync: WeightSync | None = None
        self.buffers: dict[str, torch.Tensor] = {}
        self.buffer_version: int | None = None  # what the buffers hold (None: unknown)
        self.target: dict[str, Any] | None = None  # an adapter sync's LoRA spec (None: the base model)
        self.lora_buffers: dict[str, torch.Tensor] = {}
        self._spec: list[tuple[str, tuple[int, ...], str]] | None = None
        self.last_report: Any = None
        self._pending: tuple[int, Any] | None = None
        self._rank = self._tp_rank = self._trainer_size = 0
        self.refused: str | None = None

    # ------------------------------------------------------------------ the guard
    def _guarded(self, call: str, fn: Callable[[], None], keep: bool = True) -> None:
        """Run one of vLLM's calls; a refusal or failure is logged in one line and recorded,
        never raised (see the module docstring). An error that is no refusal of meshgroups (a
        bug) keeps its traceback in the log. ``keep``: a refused update (a version, a re-plan)
        keeps the transfer world and the plan for the next one; a failed init never does."""
        try:
            fn()
        except Exception as exc:
            self.refused = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, HANDLED):
                logger.warning(
                    "meshgroups: %s refused, the engine keeps serving version %d (the trainer raises it): %s: %s",
                    call,
                    self.version,
                    type(exc).__name__,
                    exc,
                )
            else:
                logger.exception(
                    "meshgroups: %s failed; the engine keeps serving version %d", call, self.version
                )
            if not keep or not isinstance(exc, KEEPS_WORLD) or _transfer_broken(exc):
                self._broken()  # the transfer world is closed on every failure path but a refused update

    # ------------------------------------------------------------------ init
    def init_transfer_engine(self, init_info: MeshgroupsInitInfo) -> None:
        """Join the transfer world and plan (collective with every trainer rank and worker).
        Never raises for a refusal: the trainer's ranks raise it (see ``refused``)."""
        self.shutdown()
        self.refused = None
        self._guarded("init_weight_transfer_engine", lambda: self._init(init_info), keep=False)

    def _init(self, init_info: MeshgroupsInitInfo) -> None:
        refusal: tuple[str, str] | None = None
        params: Any = None
        tp = int(self.parallel_config.tensor_parallel_size)
        tp_rank = 0
        try:
            params, tp_rank, tp = read_params(self.model)
            if (
                self.parallel_config.pipeline_parallel_size != 1
                or self.parallel_config.data_parallel_size != 1
            ):
                raise LayoutError(
                    "the meshgroups backend runs engines with pipeline_parallel_size=1 and data_parallel_size=1 "
                    f"(got pp={self.parallel_config.pipeline_parallel_size}, "
                    f"dp={self.parallel_config.data_parallel_size})"
                )
        except LayoutError as exc:  # told to every rank in the exchange, not raised alone
            refusal, params = describe(exc), None
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            tp_rank = get_tensor_model_parallel_rank()
        device = self.device if params is None else next(iter(self.model.parameters())).device
        spec = None if params is None else [(p.name, tuple(p.local_shape), p.dtype) for p in params]
        if spec is None or spec != self._spec:  # kept across inits: their version is a delta's base
            self.buffers = {
                n: torch.empty(shape, dtype=getattr(torch, dtype), device=device)
                for n, shape, dtype in spec or ()
            }
            self._spec, self.buffer_version = spec, None
        trainer_size = int(init_info.trainer_size)
        self._rank, self._tp_rank, self._trainer_size = trainer_size + tp_rank, tp_rank, trainer_size
        size = trainer_size + tp
        world = TransferWorld.join(init_info.address, self._rank, size, timeout=init_info.timeout)
        self.world = world
        world.store.set(pid_key(tp_rank), str(os.getpid()))
        with world.active():
            # One exchange: the trainer has no vLLM, so the workers tell it what they hold, the
            # version they serve, or why they refuse; trainer rank 0 tells the workers its
            # layout, WeightSync settings and family map. Every rank then derives the same
            # destination (offered_destination) — or the same refusal.
            gathered = gather(WorkerOffer(params, self.version, refusal, self._lora_slots()), size)
            trainer = gathered[0]
            if not isinstance(trainer, TrainerOffer):
                raise LayoutError(
                    f"transfer rank 0 is not the trainer's rank 0 (it sent {type(trainer).__name__})"
                )
            offers = gathered[trainer_size:]
            first = first_refusal(offers)
            if first is not None:
                raise rebuild(first[1][0], f"engine worker {first[0]}: {first[1][1]}")
            self.target = trainer.lora
            weights, name_map = offered_destination(trainer, offers, tp)
            if trainer.lora is not None:  # an adapter: whole on every worker, the base untouched
                self.lora_buffers = {
                    w.name: torch.empty(w.shape, dtype=getattr(torch, w.dtype), device=device)
                    for w in weights
                }
            self.sync = WeightSync(
                None,
                trainer.layout,
                self.lora_buffers if self.target is not None else self.buffers,
                Layout(tp=tp, rank_offset=trainer_size),
                rollout_weights=weights,
                name_map=name_map,
                timeout=init_info.timeout,
                **trainer.settings,
            )
            if self.target is None:
                self.sync.version = self.buffer_version  # a delta sync checks it (and their digests)

    # ------------------------------------------------------------------ updates
    def start_weight_update(self) -> None:
        """Nothing to prepare (the receive buffers were allocated at init); forgets a pending
        update that was never finished."""
        self._pending = None

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """vLLM's entry: parse, preflight, receive (no device synchronisation on CPU)."""

        def run() -> None:
            self.receive_weights(self.parse_update_info(update_info))
            if self.device.type != "cpu" and torch.accelerator.is_available():
                torch.accelerator.synchronize()

        self.refused = None
        self._guarded("update_weights", run)

    def receive_weights(self, update_info: MeshgroupsUpdateInfo) -> None:
        """The preflight (the version, agreed on every rank of the transfer world, or refused
        there before any byte moves), then one ``WeightSync.sync()`` into the receive buffers.

        Raises:
            RuntimeError: not initialised (the trainer's preflight then times out).
            VersionError: the version agreed is refused (see the protocol).
            TransferError: the sync failed (a trainer rank gone, a timeout): nothing is
                committed, the model keeps its weights, and this engine needs a new init.
        """
        if self.sync is None or self.world is None:
            raise RuntimeError(
                "the meshgroups weight-transfer engine is not initialised (or its last transfer failed): the "
                "trainer calls init_weight_transfer_engine (a new VLLMWeightSync) first"
            )
        with self.world.active():
            version = preflight(self._rank, self.world.size, self._trainer_size, None, self.version)
            if self.target is None:
                self.buffer_version = None  # partly written until the sync is complete
            report = self.sync.sync(version=version)
        if self.target is None:
            self.buffer_version = self.sync.version
        self._pending = (version, report)

    def finish_weight_update(self) -> None:
        """Commit a complete update into vLLM's parameters (local), record its version and
        write the commit report; without a complete update, nothing (the trainer knows why)."""
        self._guarded("finish_weight_update", self._finish)

    def _finish(self) -> None:
        if self._pending is None:
            return  # a refused or failed update: nothing to commit, the trainer raises why
        version, report = self._pending
        self._pending = None
        adapter = None
        if self.target is not None:  # the adapter into vLLM's LoRA manager; the base untouched
            adapter = install(self.lora_buffers, self.target, version, self.vllm_config)
        else:
            self._commit()  # local: every worker's sync completed (execute's last agreement)
        self.version, self.last_report = version, report
        held = self.lora_buffers if self.target is not None else self.buffers
        if self.world is not None:
            self.world.store.set(
                report_key(self._tp_rank),
                json.dumps(
                    {
                        "version": version,
                        "bytes_received": report.bytes_received,
                        "buckets": report.buckets,
                        "shard_bytes": sum(b.numel() * b.element_size() for b in held.values()),
                        # what was committed, for a check without gathering (a float64 sum per worker)
                        "checksum": float(sum(b.double().sum().item() for b in held.values())),
                        "adapter": adapter,
                        "delta": None
                        if report.delta is None
                        else [report.delta.total_dense, report.delta.total_sent],
                    }
                ),
            )

    @torch.no_grad()
    def _commit(self) -> None:
        """Buffers -> the model. A tensor still in its loaded layout is copied in place; a
        parameter that post-load processing replaced (an empty CPU linear weight, its packed
        copy held by the layer) gets a fresh copy of the buffer, and every layer touched — also
        a layer sharing a written parameter (a tied head) — runs its processing again."""
        modules = dict(self.model.named_modules())
        written: set[int] = set()
        for name, buf in self.buffers.items():
            owner, _, leaf = name.rpartition(".")
            module = modules[owner]
            if (
                leaf not in module._parameters
                and leaf not in module._buffers
                and "base_layer" in module._modules
            ):
                module = module.base_layer  # an engine with LoRA slots: the layer its wrapper holds
            param = getattr(module, leaf)
            if tuple(param.shape) == tuple(buf.shape):
                param.data.copy_(buf)
            elif leaf in module._parameters:
                module.register_parameter(leaf, torch.nn.Parameter(buf.clone(), requires_grad=False))
                param = getattr(module, leaf)
            else:  # a buffer of another shape than it loaded in: replaced like the parameter
                module.register_buffer(leaf, buf.clone(), persistent=True)
                param = getattr(module, leaf)
            written.add(id(param))
        reprocess(self.model, written, self.vllm_config.model_config.dtype)

    def _lora_slots(self) -> dict[str, Any] | None:
        """This engine's LoRA slots, as the init exchange offers them (``None``: LoRA is off)."""
        config = getattr(self.vllm_config, "lora_config", None)
        if config is None:
            return None
        dtype = (
            config.lora_dtype
            if isinstance(config.lora_dtype, torch.dtype)
            else self.vllm_config.model_config.dtype
        )
        return {"max_rank": int(config.max_lora_rank), "dtype": str(dtype).rsplit(".", 1)[-1]}

    def drain_pending(self) -> None:
        """Nothing is deferred: ``finish_weight_update`` commits before it returns."""

    def _broken(self) -> None:
        if self.sync is not None:
            self.sync.close()
        if self.world is not None:
            self.world.close()
        self.sync, self.world, self._pending = None, None, None

    def shutdown(self) -> None:
        """Leave the transfer world (local); the model keeps its weights and its version."""
        try:
            if self.sync is not None and self.world is not None:
                with self.world.active():
                    self.sync.close()
        finally:
            self._broken()


#: Errors a worker reports in one log line (refusals and failed transfers, meshgroups' own);
#: anything else is logged with its traceback (a bug), and recorded all the same.
HANDLED: tuple[type[BaseException], ...] = (
    LayoutError,
    MeshConfigError,
    MismatchError,
    StoreConnectionError,
    TransferError,
    VersionError,
    TypeError,
    ValueError,
    RuntimeError,
)
#: Errors after which the transfer world and the plan are kept (the next update uses them).
KEEPS_WORLD: tuple[type[BaseException], ...] = (VersionError, MismatchError, LayoutError, TransferError)


def _transfer_broken(exc: BaseException) -> bool:
    """A transfer that broke its groups or lost a peer: the world is no use any more."""
    return isinstance(exc, TransferError) and exc.stage in ("transfer", "check")


__all__ = ["MeshgroupsInitInfo", "MeshgroupsUpdateInfo", "MeshgroupsWeightTransferEngine", "read_params"]
