"""The trainer side: one object in the trainer's own world, one call per step.

``VLLMWeightSync`` is built on every rank of the trainer's torchrun world (its module: FSDP2 ×
TP DTensors and persistent buffers, read as ``WeightSync`` reads them). Its rank 0 holds a
*client* of the engine (:mod:`~meshgroups.engines.vllm._clients`): the ``LLM`` itself
(:class:`LLMClient`), a ``vllm serve`` process (:class:`HTTPClient`), or any object with vLLM's
four weight-sync calls (``VLLMWeightSyncClient``). It imports no vLLM itself.

Construction (collective over the trainer's world): the arguments are checked on every rank and
agreed; rank 0 hosts the transfer world's store and publishes its address to the other trainer
ranks (one broadcast over the trainer's group) and to the engine (``init_weight_transfer_engine``,
in a thread: the workers block in the rendezvous like the trainer's ranks); then every trainer
rank and worker joins the transfer world, exchanges offers (the protocol:
:mod:`~meshgroups.engines.vllm._protocol`) and builds its ``WeightSync`` — one plan, one group
build. The object's ``version`` starts at the version the engine serves.

``sync()`` (collective over the trainer's world): rank 0 calls ``start_weight_update`` and
``update_weights({"version": ...})`` in a thread while every trainer rank runs the preflight
(the version agreed with the workers, or refused before any byte moves) and
``WeightSync.sync()`` in the transfer world; then rank 0 calls
``finish_weight_update(weight_version=str(n))`` (the workers commit), checks every worker's
commit report, and tells the other ranks the outcome through the store. Every rank returns the
same version, or raises the same error — a refusal on either side included.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from meshgroups._lifecycle import Closeable
from meshgroups.engines import TransferWorld
from meshgroups.engines.vllm._clients import (
    Call,
    HTTPClient,
    LLMClient,
    WeightSyncClient,
    check_trainer_args,
    front_version,
)
from meshgroups.engines.vllm._lora import LoRA, lora_weights, offered_destination
from meshgroups.engines.vllm._protocol import (
    TrainerOffer,
    VersionError,
    WorkerOffer,
    agree,
    describe,
    first_refusal,
    gather,
    pid_key,
    preflight,
    rebuild,
    report_key,
)
from meshgroups.errors import ClosedError, LayoutError, MeshConfigError
from meshgroups.layout import Layout
from meshgroups.transfer import NameMap, Progress, Report, TransferError, WeightSync, adopt


class VLLMWeightSync(Closeable):
    """Trainer side of weight sync into a vLLM engine: one object in the trainer's own world, one
    ``sync()`` per step, returning the version the engine then serves (the same on every rank,
    or the same error). Collective over the trainer's world: every trainer rank builds it and
    calls ``sync()`` alike; rank 0 holds the engine's client. With an engine (vLLM, and its
    workers' processes: not run here)::

        >>> sync = VLLMWeightSync(model, Layout(dp=2, tp=2), LLMClient(llm) if rank == 0 else None,  # doctest: +SKIP
        ...                       engine_size=2)
        >>> for step in range(steps):  # doctest: +SKIP
        ...     train_step(model)
        ...     version = sync.sync()  # llm.get_weight_version() == str(version)

    Args:
        model: this rank's trainer module (or ``{name: tensor}``), Hugging Face names.
        layout: the trainer's layout (ranks ``[0, self._ranks)`` of the trainer's world, as its
            DTensors' meshes say).
        client: on rank 0, the engine's client (:class:`LLMClient` or any
            ``VLLMWeightSyncClient``); ``None`` on the other ranks.
        engine_size: the engine's workers (default: ``client.engine_size`` when it has one).
        cast: as for ``WeightSync`` (``"bfloat16"`` or ``True`` for a bf16 engine).
        allow_unused: as for ``WeightSync``.
        bucket_bytes: as for ``WeightSync``.
        timeout: seconds; bounds the rendezvous, every wait of a sync and the engine's answers.
        host: the address the engine's workers reach trainer rank 0 at.
        group: the trainer's group for the one address broadcast (default: its default group).
        name_map: a family map, Hugging Face names → vLLM's
            (``meshgroups.transfer.hf_to_vllm(model.config, ...)``; needed for MoE
            experts, optional for dense models). The engine checks it against its own layers: a
            fused rule must read the trainer weights vLLM's layer fuses, a stack of experts must
            be in the order of vLLM's expert map (build it with the engine's ``ep`` and
            placement), every name must be a vLLM parameter. Given on every rank (rank 0's is used).
        delta: ``True`` or a ``DeltaPolicy`` (``meshgroups.transfer``): after the first sync, only
            what changed since the version each worker's receive buffers hold (checked by
            version and digest; a worker that does not hold it gets dense). ``resume``: a closed
            ``VLLMWeightSync`` of the same plan whose shadows this one starts from.
        lora: a ``LoRA``: sync the model's LoRA A/B (a PEFT model, or ``lora_weights(model)``)
            into vLLM's LoRA slots as that adapter (``lora_request()`` names it), not the base
            (see ``meshgroups.engines.vllm.LoRA``).

    Attributes:
        version: the version the engine serves, as this object last saw it: at construction
            the engine's (``0``: the weights vLLM loaded), then each ``sync()``'s.
        sync_state: the ``WeightSync`` (its counters: ``plans``, ``group_builds``, ``syncs``).
        name_map: the name map the plan uses (vLLM's names; the family map's stacks and renames,
            the fused rules read from vLLM's layers).
        world: the transfer world.
        last_report: this rank's ``Report`` of the last ``sync()``.

    Raises (on every trainer rank alike, before any rank returns; the engine keeps serving and
    the next ``VLLMWeightSync`` on it works):
        MeshConfigError: no client on rank 0, a client elsewhere, no engine size.
        LayoutError, MismatchError: as ``WeightSync`` (a vLLM tensor nothing writes, a trainer
            weight nothing reads, a dtype change without ``cast``, ...) or an engine worker's
            refusal (a layer this backend cannot describe), naming the tensor and the rule.
        StoreConnectionError: the engine did not join within ``timeout`` (with the engine's
            own error when it has one).

    A MoE model (Qwen3-MoE; Transformers 5's packed experts)::

        >>> from meshgroups.transfer import hf_to_vllm
        >>> sync = VLLMWeightSync(model, Layout(dp=2, tp=2), client,       # doctest: +SKIP
        ...                       name_map=hf_to_vllm(model.config, experts="packed"))
    """

    def __init__(
        self,
        model: torch.nn.Module | Mapping[str, Any],
        layout: Layout,
        client: WeightSyncClient | None,
        *,
        engine_size: int | None = None,
        cast: Any = None,
        allow_unused: bool | Sequence[str] = False,
        bucket_bytes: int = 64 << 20,
        timeout: float = 300.0,
        host: str = "127.0.0.1",
        group: dist.ProcessGroup | None = None,
        name_map: Mapping[str, Any] | None = None,
        delta: Any = False,
        resume: VLLMWeightSync | None = None,
        lora: LoRA | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("VLLMWeightSync needs the trainer's world (dist.init_process_group)")
        rank = dist.get_rank()
        if lora is not None and isinstance(model, torch.nn.Module):
            model = lora_weights(model)  # the adapter's tensors, by checkpoint name
        self.model, self.layout, self.client, self.group, self.lora = model, layout, client, group, lora
        self.timeout = float(timeout)
        self.version = 0
        self.last_report: Report | None = None
        self._broken: str | None = None
        self._round = 0
        self.world: TransferWorld | None = None
        self._ranks = int(layout.grid.size)
        error: BaseException | None = None
        size: int | None = None
        try:  # local checks, agreed below: a rank never waits for a rank that refused alone
            size = check_trainer_args(rank, client, layout, group, engine_size)
        except Exception as exc:
            error = exc
        agree(error, group)
        front = front_version(client) if rank == 0 else -1  # before the init call: one call at a time
        if rank == 0:
            store = TransferWorld.serve(host=host, timeout=self.timeout)
            box: list[Any] = [f"{store.host}:{store.port}", int(size or 0)]
        else:
            box = [None, None]
        dist.broadcast_object_list(box, src=0, group=group)
        address, self.engine_size = box
        self._key = f"meshgroups/trainer/{address}"
        try:
            self._connect(rank, address, store if rank == 0 else None, front, model, layout, cast, allow_unused,
                          bucket_bytes, name_map, delta)  # fmt: skip
            if resume is not None and getattr(resume, "sync_state", None) is not None:
                adopt(self.sync_state, resume.sync_state)  # its shadows: the base of the next delta
            error = None
        except Exception as exc:
            error = exc
        try:
            agree(error, group)
        except BaseException:
            if error is None:  # refused on another rank: this rank's world goes too
                self._close("construction failed on another trainer rank")
            raise

    def _connect(self, rank: int, address: str, store: Any, front: int, model: Any, layout: Layout, cast: Any,
                 allow_unused: Any, bucket_bytes: int, name_map: Any, delta: Any) -> None:  # fmt: skip
        """Join the transfer world, exchange offers, plan; the engine's init call runs in a
        thread on rank 0. Closes the world on every failure path."""
        total = self._ranks + self.engine_size
        call = None
        if rank == 0:
            client = self.client
            info = {"address": address, "trainer_size": self._ranks, "timeout": self.timeout}
            call = Call(lambda: client.init_weight_transfer_engine(info))  # type: ignore[union-attr]
        try:
            try:
                if rank == 0:
                    self.world = TransferWorld(store, 0, total, timeout=self.timeout)
                else:
                    self.world = TransferWorld.join(address, rank, total, timeout=self.timeout)
            except Exception as exc:  # the engine's own error says why, when it has one
                engine = call.join(1.0) if call is not None else None
                if engine is None or isinstance(engine, TimeoutError):
                    raise
                raise type(exc)(f"{exc}; the engine failed: {type(engine).__name__}: {engine}") from engine
            settings = {
                "cast": cast,
                "allow_unused": allow_unused,
                "bucket_bytes": bucket_bytes,
                "delta": delta,
            }
            family = None if name_map is None else NameMap.of(name_map).dumps()
            spec = (
                None if self.lora is None else self.lora.spec({n: tuple(t.shape) for n, t in model.items()})
            )
            with self.world.active():
                offer = TrainerOffer(layout, settings, family, front, spec) if rank == 0 else None
                gathered = gather(offer, total)
                trainer, offers = gathered[0], gathered[self._ranks :]
                if not all(isinstance(o, WorkerOffer) for o in offers):
                    raise LayoutError(
                        f"transfer ranks {self._ranks}.. are not all engine workers: {offers!r}"
                    )
                first = first_refusal(offers)
                if first is not None:
                    raise rebuild(first[1][0], f"engine worker {first[0]}: {first[1][1]}")
                self.version = max([trainer.front_version, *(o.version for o in offers)])
                weights, self.name_map = offered_destination(trainer, offers, self.engine_size)
                self.sync_state = WeightSync(
                    model,
                    layout,
                    None,
                    Layout(tp=self.engine_size, rank_offset=self._ranks),
                    rollout_weights=weights,
                    name_map=self.name_map,
                    timeout=self.timeout,
                    **settings,
                )
        except BaseException:
            if self.world is not None:
                self.world.close()
            self._broken = "construction failed"
            if call is not None:
                call.join(self.timeout)  # the engine's side of the same refusal (it returns normally)
            raise
        if call is not None:
            engine = call.join(self.timeout)
            if engine is not None:
                self._close(f"the engine's init failed: {engine}")
                raise engine

    # ------------------------------------------------------------------ one step
    def sync(
        self, *, version: int | None = None, progress: Callable[[Progress], object] | None = None
    ) -> int:
        """Move the trainer's current weights into the engine and commit them there (collective
        over the trainer's world). Returns the version the engine now serves.

        Args:
            version: the version to make (every rank the same; an int newer than what the engine
                serves), or ``None``: one more than the newest the engine or this object knows.
            progress: as for ``WeightSync.sync`` (called on this rank after each bucket).

        Returns:
            The new version; the engine reports it as ``str(version)``
            (``llm.get_weight_version()``, each output's ``weight_versions``).

        Raises (on every trainer rank alike, before any rank returns):
            VersionError: ``version`` is not newer than what the engine serves, or ranks passed
                different ones — before any byte moves; the engine keeps its version and this
                object stays usable.
            LayoutError, MismatchError: a re-plan refused (the trainer's weights changed); this
                object stays usable once they are right again.
            TransferError: the transfer failed (an engine worker or a trainer rank gone, a
                timeout: stage ``"transfer"`` / ``"check"``; this object is then closed — build a
                new one) or the engine did not commit (stage ``"commit"``). The engine serves its
                last complete version, or nothing (a dead engine).
        """
        if self._broken:
            raise ClosedError(f"this VLLMWeightSync was closed ({self._broken}): build a new one")
        if self.world is None:
            raise RuntimeError("meshgroups internal error: no transfer world")
        self._round += 1
        rank = dist.get_rank()
        client = self.client
        call = None
        if rank == 0:

            def start_and_update() -> None:
                client.start_weight_update()  # type: ignore[union-attr]
                client.update_weights({"version": version})  # type: ignore[union-attr]

            call = Call(start_and_update)
        error: BaseException | None = None
        agreed = -1
        report = None
        try:
            with self.world.active():
                agreed = preflight(rank, self.world.size, self._ranks, version, self.version)
                report = self.sync_state.sync(progress=progress, version=agreed)
        except Exception as exc:
            error = exc
        if call is not None:
            outcome = self._finish(call, error, agreed)
            self.world.store.set(f"{self._key}/outcome/{self._round}", json.dumps(outcome))
        else:
            outcome = self._wait_outcome()
        if "error" in outcome:
            kind, message, stage = outcome["error"]
            raised = (
                error
                if error is not None and describe(error) == (kind, message)
                else rebuild(kind, message, stage)
            )
            if kind == "TransferError" and stage in ("transfer", "check"):
                self._close(f"version {agreed} failed: {message}")
            raise raised
        self.version, self.last_report = int(outcome["version"]), report
        return self.version

    def _finish(self, call: Call, error: BaseException | None, version: int) -> dict[str, Any]:
        """Rank 0: the engine's side of the update, its commit and its reports -> the outcome."""
        client = self.client
        # One bound for the engine's two answers; after a failed transfer a short one (the
        # workers return at once after a refusal; a dead engine's front end may never answer).
        deadline = time.monotonic() + (self.timeout if error is None else min(self.timeout, 5.0))
        engine = call.join(self.timeout if error is None else max(deadline - time.monotonic(), 0.0))
        if error is not None and call.thread.is_alive():
            return {"error": [*describe(error), str(getattr(error, "stage", "commit"))]}
        if error is None and engine is not None:
            error = TransferError(
                f"weight sync into vLLM: the engine's update call failed ({type(engine).__name__}: {engine}); "
                f"the engine serves version {self.version} or nothing",
                (),
                -1,
                "commit",
                (),
            )
        # Always closes vLLM's update session; names the version only once the bytes are all in.
        # In a thread, bounded: a dead engine's front end may never answer.
        named = None if error is not None else str(version)
        finish = Call(lambda: client.finish_weight_update(weight_version=named))  # type: ignore[union-attr]
        exc = finish.join(self.timeout if error is None else max(deadline - time.monotonic(), 1.0))
        if exc is not None:
            if error is None:
                error = TransferError(
                    f"weight sync into vLLM: version {version} was not committed by the engine "
                    f"({type(exc).__name__}: {exc}); the engine serves version {self.version} or nothing",
                    (),
                    -1,
                    "commit",
                    (),
                )
        if error is None:
            reports = self.engine_reports()
            missing = [r for r in range(self.engine_size) if reports.get(r, {}).get("version") != version]
            if missing:
                error = TransferError(
                    f"weight sync into vLLM: workers {missing} did not commit version {version} (their reports: "
                    f"{[reports.get(r) for r in missing]})",
                    (),
                    -1,
                    "commit",
                    (),
                )
        if error is not None:
            return {"error": [*describe(error), str(getattr(error, "stage", "commit"))]}
        return {"version": version}

    def _wait_outcome(self) -> dict[str, Any]:
        key = f"{self._key}/outcome/{self._round}"
        deadline = time.monotonic() + 3 * self.timeout  # rank 0 waits up to timeout for the engine, thrice
        store = self.world.store  # type: ignore[union-attr]
        while True:
            try:
                store.wait([key], timedelta(seconds=max(deadline - time.monotonic(), 0.1)))
                return dict(json.loads(store.get(key)))
            except (RuntimeError, dist.DistError) as exc:
                if time.monotonic() >= deadline:
                    message = (
                        f"weight sync into vLLM: no word from trainer rank 0 within {3 * self.timeout:g} s "
                        f"({type(exc).__name__}); it is gone or stuck"
                    )
                    return {"error": ["TransferError", message, "check"]}

    def lora_request(self, version: int | None = None) -> Any:
        """vLLM's ``LoRARequest`` of the adapter at ``version`` (default: the last synced), for
        ``generate(..., lora_request=...)`` (imports vLLM; an adapter sync only)."""
        if self.lora is None:
            raise MeshConfigError("lora_request(): this VLLMWeightSync syncs the base model (no lora=)")
        return self.lora.request(self.version if version is None else version)

    def engine_reports(self) -> dict[int, dict[str, float]]:
        """What each engine worker reported at its last commit: ``{tp rank: {"version",
        "bytes_received", "buckets", "shard_bytes", "checksum"}}`` (read from the store; any
        trainer rank). ``checksum``: the float64 sum of every element the worker committed.

        Returns:
            The reports of the workers that committed at least once through this object.
        """
        out: dict[int, dict[str, float]] = {}
        store = self.world.store  # type: ignore[union-attr]
        for r in range(self.engine_size):
            if store.check([report_key(r)]):
                out[r] = json.loads(store.get(report_key(r)))
        return out

    def engine_pids(self) -> dict[int, int]:
        """Each engine worker's process id, as it reported it at init (for tests and tools).

        Returns:
            ``{tp rank: pid}``.
        """
        store = self.world.store  # type: ignore[union-attr]
        return {r: int(store.get(pid_key(r))) for r in range(self.engine_size)}

    # ------------------------------------------------------------------ lifetime
    def _close(self, why: str) -> int:
        self._broken, self._closed = why, True
        world, sync_state = self.world, getattr(self, "sync_state", None)
        if world is None or world.group is None:
            return 0
        try:
            if sync_state is not None:
                with world.active():
                    sync_state.close()
        finally:
            destroyed = world.close()
        return destroyed

    def _release(self) -> int:
        # leaves the transfer world (local); the engine keeps its last version
        return self._close("closed")

    def __repr__(self) -> str:
        return (
            f"VLLMWeightSync(version={self.version}, engine_size={self.engine_size}, trainer={self.layout!r})"
        )


__all__ = ["HTTPClient", "LLMClient", "VLLMWeightSync", "VersionError", "WeightSyncClient"]
