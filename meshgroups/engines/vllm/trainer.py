"""The trainer side: one object in the trainer's own world, one call per step.

``VLLMWeightSync`` is built on every rank of the trainer's torchrun world (its module: FSDP2 ×
TP DTensors, read as ``WeightSync`` reads them). Its rank 0 holds a *client* of the engine: the
``LLM`` itself (wrapped by :class:`LLMClient`) or any object with vLLM's four weight-sync calls
(``VLLMWeightSyncClient``: ``init_weight_transfer_engine``, ``start_weight_update``,
``update_weights``, ``finish_weight_update``), e.g. vLLM's ``HTTPVLLMWeightSyncClient`` for a
``vllm serve`` with its RL routes. It imports no vLLM itself.

Construction (collective over the trainer's world): rank 0 hosts the transfer world's store and
publishes its address to the other trainer ranks (one broadcast over the trainer's default
group) and to the engine (``init_weight_transfer_engine``, in a thread: the workers block in the
rendezvous like the trainer's ranks); then every trainer rank and worker joins the transfer world
and builds its ``WeightSync`` — one plan, one group build.

``sync()`` (collective over the trainer's world): rank 0 calls ``start_weight_update`` and
``update_weights({"version": n})`` in a thread while every trainer rank runs
``WeightSync.sync()`` in the transfer world; then rank 0 calls
``finish_weight_update(weight_version=str(n))`` (the workers commit) and tells the other ranks
the outcome through the store. Every rank returns the same version, or raises the same error::

    >>> sync = VLLMWeightSync(model, Layout(dp=2, tp=2), LLMClient(llm) if rank == 0 else None,  # doctest: +SKIP
    ...                       engine_size=2)
    >>> for step in range(steps):                                          # doctest: +SKIP
    ...     train_step(model)
    ...     version = sync.sync()                     # llm.get_weight_version() == str(version)
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from meshgroups.engines import TransferWorld
from meshgroups.engines.vllm.destination import engine_destinations
from meshgroups.errors import LayoutError, MeshConfigError, StoreConnectionError
from meshgroups.layout import Layout
from meshgroups.transfer import NameMap, Progress, Report, TransferError, WeightSync


class WeightSyncClient(Protocol):
    """vLLM's ``VLLMWeightSyncClient`` (structural): the engine's four weight-sync calls."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...

    def start_weight_update(self) -> None: ...

    def update_weights(self, update_info: dict[str, Any]) -> None: ...

    def finish_weight_update(self, weight_version: str | None = None) -> None: ...


class LLMClient:
    """An in-process ``vllm.LLM`` as a ``VLLMWeightSyncClient``: the LLM's calls take
    ``{"init_info": ...}`` / ``{"update_info": ...}`` requests, the protocol plain dicts.

    Args:
        llm: the ``vllm.LLM``.

    >>> client = LLMClient(llm)                                 # doctest: +SKIP
    >>> client.engine_size                                      # doctest: +SKIP
    2
    """

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    @property
    def engine_size(self) -> int:
        """The engine's workers (its tensor-parallel size times pipeline stages)."""
        return int(self.llm.llm_engine.vllm_config.parallel_config.world_size)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version=weight_version)

    def get_weight_version(self) -> str:
        """The engine's last committed version (vLLM's own record)."""
        return str(self.llm.get_weight_version())


class _Call:
    """A blocking client call in a thread: the engine's workers only return from it once the
    trainer's ranks have moved the bytes, which this thread's caller does meanwhile."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True, name="meshgroups-vllm-call")
        self.thread.start()

    def _run(self, fn: Callable[[], object]) -> None:
        try:
            fn()
        except BaseException as exc:  # handed to the caller by join()
            self.error = exc

    def join(self, timeout: float) -> BaseException | None:
        self.thread.join(timeout)
        if self.thread.is_alive():
            return TimeoutError(f"the engine did not answer within {timeout:g} s")
        return self.error


class VLLMWeightSync:
    """Trainer side of weight sync into a vLLM engine (see the module docstring). Collective over
    the trainer's world: every trainer rank builds it and calls ``sync()`` alike.

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
            (``meshgroups.transfer._names.families.hf_to_vllm(model.config, ...)``; needed for MoE
            experts, optional for dense models). The engine checks it against its own layers: a
            fused rule must read the trainer weights vLLM's layer fuses, a stack of experts must
            be in the order of vLLM's expert map (build it with the engine's ``ep`` and
            placement), every name must be a vLLM parameter. Given on every rank (rank 0's is used).

    Attributes:
        version: the last version the engine committed (0 before the first ``sync()``).
        sync_state: the ``WeightSync`` (its counters: ``plans``, ``group_builds``, ``syncs``).
        name_map: the name map the plan uses (vLLM's names; the family map's stacks and renames,
            the fused rules read from vLLM's layers).
        world: the transfer world.
        last_report: this rank's ``Report`` of the last ``sync()``.

    Raises:
        MeshConfigError: no client on rank 0, a client elsewhere, no engine size.
        LayoutError, MismatchError: as ``WeightSync`` (a weight nothing writes, ...), on every rank.
        StoreConnectionError: the engine did not join within ``timeout``.

    A MoE model (Qwen3-MoE; Transformers 5's packed experts)::

        >>> from meshgroups.transfer._names.families import hf_to_vllm
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
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("VLLMWeightSync needs the trainer's world (dist.init_process_group)")
        rank = dist.get_rank()
        if (client is None) == (rank == 0):
            raise MeshConfigError(
                f"client={client!r} on rank {rank}: trainer rank 0 holds the engine's client (an LLMClient or a "
                "VLLMWeightSyncClient), the other ranks pass None"
            )
        self._ranks = int(layout.grid.size)
        if self._ranks != dist.get_world_size(group) or sorted(layout.grid.ravel().tolist()) != list(
            range(self._ranks)
        ):
            raise LayoutError(
                f"layout {layout!r} must hold the trainer's ranks 0..{dist.get_world_size(group) - 1} (its world), "
                f"each once; it holds {self._ranks} ranks"
            )
        self.model, self.layout, self.client = model, layout, client
        self.timeout = float(timeout)
        self.version = 0
        self.last_report: Report | None = None
        self._broken: str | None = None
        if rank == 0:
            size = engine_size if engine_size is not None else getattr(client, "engine_size", None)
            if size is None:
                raise MeshConfigError(
                    "engine_size is needed: the client does not say how many workers the engine has"
                )
            store = TransferWorld.serve(host=host, timeout=self.timeout)
            box: list[Any] = [f"{store.host}:{store.port}", int(size)]
        else:
            box = [None, None]
        dist.broadcast_object_list(box, src=0, group=group)
        address, self.engine_size = box
        total = self._ranks + self.engine_size
        call = None
        if rank == 0:
            if client is None:  # an invariant of this module, not a check of user input
                raise RuntimeError("meshgroups internal error: no engine client on trainer rank 0")
            info = {"address": address, "trainer_size": self._ranks, "timeout": self.timeout}
            call = _Call(lambda: client.init_weight_transfer_engine(info))
            try:
                self.world = TransferWorld(store, 0, total, timeout=self.timeout)
            except StoreConnectionError as exc:  # the engine's own error says why, when it has one
                error = call.join(1.0)
                if error is None or isinstance(error, TimeoutError):
                    raise
                raise StoreConnectionError(
                    f"{exc}; the engine failed: {type(error).__name__}: {error}"
                ) from error
        else:
            self.world = TransferWorld.join(address, rank, total, timeout=self.timeout)
        settings = {"cast": cast, "allow_unused": allow_unused, "bucket_bytes": bucket_bytes}
        family = None if name_map is None else NameMap.of(name_map).dumps()
        failed = True
        try:
            with self.world.active():
                gathered: list[Any] = [None] * total
                dist.all_gather_object(gathered, ("trainer", layout, settings, family) if rank == 0 else None)
                family = gathered[0][3]
                weights, self.name_map = engine_destinations(
                    [g[1] for g in gathered[self._ranks :]],
                    self.engine_size,
                    None if family is None else NameMap.loads(family),
                )
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
            failed = False
        finally:
            if failed:
                self.world.close()
            if call is not None:
                error = call.join(self.timeout)
                if error is not None and not failed:  # a failure of ours is the same error, said here
                    raise error
        self._key = f"meshgroups/trainer/{address}"

    # ------------------------------------------------------------------ one step
    def sync(self, *, progress: Callable[[Progress], object] | None = None) -> int:
        """Move the trainer's current weights into the engine and commit them there (collective
        over the trainer's world). Returns the version the engine now serves.

        Args:
            progress: as for ``WeightSync.sync`` (called on this rank after each bucket).

        Returns:
            The new version (1, 2, ...); the engine reports it as ``str(version)``
            (``llm.get_weight_version()``).

        Raises:
            TransferError: on every trainer rank alike: the transfer failed (an engine worker or
                a trainer rank gone, a timeout: stage ``"transfer"`` / ``"check"``) or the engine
                refused or did not commit (stage ``"commit"``). The engine then serves its last
                committed version or nothing (a dead engine); this object is closed — build a
                new one to go on.
        """
        if self._broken:
            raise RuntimeError(f"this VLLMWeightSync cannot sync any more: {self._broken}; build a new one")
        version = self.version + 1
        rank = dist.get_rank()
        client = self.client
        call = None
        if rank == 0:
            if client is None:  # an invariant of this module, not a check of user input
                raise RuntimeError("meshgroups internal error: no engine client on trainer rank 0")

            def start_and_update() -> None:
                client.start_weight_update()
                client.update_weights({"version": version})

            call = _Call(start_and_update)
        try:
            with self.world.active():
                report = self.sync_state.sync(progress=progress)
        except TransferError as exc:
            if call is not None:
                call.join(self.timeout)  # the engine's side of the same failure
            self._close(f"version {version} failed: {exc}")
            raise
        outcome = "ok"
        if call is not None:
            if client is None:  # an invariant of this module, not a check of user input
                raise RuntimeError("meshgroups internal error: no engine client on trainer rank 0")
            error = call.join(self.timeout)
            if error is None:
                try:
                    client.finish_weight_update(weight_version=str(version))
                except Exception as exc:
                    error = exc
            if error is not None:
                outcome = f"{type(error).__name__}: {error}"
            self.world.store.set(f"{self._key}/outcome/{version}", outcome)
        else:
            outcome = self._wait_outcome(version)
        if outcome != "ok":
            self._close(f"version {version} was not committed: {outcome}")
            raise TransferError(
                f"weight sync into vLLM: version {version} was not committed by the engine ({outcome}); the engine "
                f"serves version {self.version} or nothing",
                (),
                -1,
                "commit",
                (),
            )
        self.version, self.last_report = version, report
        return version

    def _wait_outcome(self, version: int) -> str:
        key = f"{self._key}/outcome/{version}"
        deadline = time.monotonic() + 2 * self.timeout  # rank 0 waits up to timeout for the engine, twice
        while True:
            try:
                self.world.store.wait([key], timedelta(seconds=max(deadline - time.monotonic(), 0.1)))
                return self.world.store.get(key).decode()
            except (RuntimeError, dist.DistError) as exc:
                if time.monotonic() >= deadline:
                    return f"no word from trainer rank 0 within {2 * self.timeout:g} s ({type(exc).__name__})"

    def engine_reports(self) -> dict[int, dict[str, float]]:
        """What each engine worker reported at its last commit: ``{tp rank: {"version",
        "bytes_received", "buckets", "shard_bytes", "checksum"}}`` (read from the store; any
        trainer rank). ``checksum``: the float64 sum of every element the worker committed.

        Returns:
            The reports of the workers that committed at least once.
        """
        out: dict[int, dict[str, float]] = {}
        for r in range(self.engine_size):
            key = f"meshgroups/engine/{r}/report"
            if self.world.store.check([key]):
                out[r] = json.loads(self.world.store.get(key))
        return out

    def engine_pids(self) -> dict[int, int]:
        """Each engine worker's process id, as it reported it at init (for tests and tools).

        Returns:
            ``{tp rank: pid}``.
        """
        return {r: int(self.world.store.get(f"meshgroups/engine/{r}/pid")) for r in range(self.engine_size)}

    # ------------------------------------------------------------------ lifetime
    def _close(self, why: str) -> None:
        self._broken = why
        try:
            with self.world.active():
                self.sync_state.close()
        finally:
            self.world.close()

    def close(self) -> None:
        """Leave the transfer world (local, idempotent). The engine keeps its last version."""
        if not self._broken:
            self._close("closed")

    def __enter__(self) -> VLLMWeightSync:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"VLLMWeightSync(version={self.version}, engine_size={self.engine_size}, trainer={self.layout!r})"
        )


__all__ = ["LLMClient", "VLLMWeightSync", "WeightSyncClient"]
