"""``WeightSync``: the object an RL loop holds — plan once, build the groups once, move every step.

Built once per job from the trainer's module (or state dict) and layout and the rollout's module
(or state dict, or local buffers with ``rollout_weights=``) and layout; the rollout's own
parameters are the destination buffers, written in place. ``sync()`` moves the trainer's
current weights (one collective call: progress, timeout and failures as ``execute``);
``WeightSync``'s docstring shows it.

It composes what exists and adds no arithmetic of its own: placements from the DTensors
(``torch_io.local_weights``), the mapped plan (``plan_transfer(name_map=, cast=,
allow_unused=)``, each rank its own part), ``TransferGroups`` and ``execute``. Each plan weight
is a *link* (one segment of one rollout weight); its source is a view into the trainer's local
shard and its destination a view into the rollout's local tensor (for a fused weight, the
segment's rows inside it), so ``execute`` writes the parameter in place.

**Re-planning.** Each ``sync()`` reads the parameters again (cheap: names, shapes, dtypes,
placements and meshes of the local tensors) and compares them, and the layouts' fingerprints,
with what it planned for; one small all-reduce tells every rank whether any rank saw a change,
and then every rank plans and builds groups again, together. A parameter replaced by another
tensor of the same description needs no new plan: views are taken afresh at each call.

**Failures.** A ``TransferError`` is raised on every rank alike, as from ``execute``. After one
in stage ``"transfer"`` the transfer groups are broken (a timed-out send takes its communicator
down): ``sync()`` closes them at once, and the next ``sync()`` (or this one, with
``retries=``) builds new ones — the plan is kept — and moves everything again. Other stages
keep the groups: ``"check"`` is a bad input, ``"progress"`` the callback's exception.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from meshgroups._lifecycle import Closeable
from meshgroups.errors import MeshConfigError, TransferError
from meshgroups.layout import Layout, Topology
from meshgroups.mesh import (
    GroupCache,
    MeshOptions,
    as_timedelta,
    collective_call,
    default_timeout,
    merge_options,
)
from meshgroups.transfer._names.expand import Cast
from meshgroups.transfer._names.mapped import view_source
from meshgroups.transfer._names.names import NameMap
from meshgroups.transfer._names.quant import BlockFP8
from meshgroups.transfer._plan.plan import TransferPlan, plan_transfer
from meshgroups.transfer._run.delta_codec import DeltaPolicy, Shadows
from meshgroups.transfer._run.execute import DEFAULT_BUCKET_BYTES, Progress, Report, execute
from meshgroups.transfer._run.fanout_groups import TransferGroups
from meshgroups.transfer._run.fp8 import quantize_blocks
from meshgroups.transfer._run.jobs import Job, digest_text
from meshgroups.transfer._run.status import Status, no_status
from meshgroups.transfer._run.steps import PackBuffers
from meshgroups.transfer._run.sync_delta import move
from meshgroups.transfer._run.torch_io import Tensors, check_buffers, local_weights, merge, read, slices
from meshgroups.transfer._spec import Weight


class WeightSync(Closeable):
    """Move a trainer's weights into a rollout's, every step (collective: every rank of the
    world builds it and calls ``sync()`` alike). Plans once and builds the transfer groups
    once; each ``sync()`` moves the trainer's current weights into the rollout's own tensors,
    in place, and plans again (every rank together) only when a rank's weights or a layout
    changed. In a job (trainer and rollout ranks; ``job`` from ``init_job``)::

        sync = WeightSync(model, trainer, rollout_model, rollout,
                          name_map=vllm_names, cast="bfloat16", job=job)
        for step in range(steps):
            train_step(model)
            sync.sync()  # every rank; the rollout's parameters now hold the new weights

    Colocated on a one-process world (the transfer is a local copy)::

        >>> import torch
        >>> import torch.distributed as dist
        >>> from meshgroups import Layout
        >>> from meshgroups.transfer import WeightSync
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> trainer, rollout = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
        >>> with WeightSync(trainer, Layout(dp=1), rollout, Layout(dp=1)) as sync:
        ...     sync.sync().weights, sync.plans, sync.group_builds
        (('bias', 'weight'), 1, 1)
        >>> torch.equal(rollout.weight, trainer.weight)
        True
        >>> dist.destroy_process_group()

    Args:
        trainer: this rank's trainer ``nn.Module`` or ``{name: tensor}`` (DTensors: placements
            read from them; plain tensors: whole on every rank of the layout, or of their
            pipeline stage); ``None`` on ranks outside ``trainer_layout``.
        trainer_layout: the layout the trainer's meshes were built from.
        rollout: this rank's rollout module or ``{name: tensor}``, whose tensors are written in
            place (for a DTensor, its local shard); ``None`` outside ``rollout_layout``.
        rollout_layout: the rollout's layout.
        name_map: rollout name -> trainer weights (renames, fusions, ties, splits; see
            ``meshgroups.transfer.NameMap``); names it lacks mean the same-named trainer weight.
        cast: allow a dtype change (``"bfloat16"``, ``True``, or per rollout weight); the sender
            casts, before bytes cross a link.
        allow_unused: ``True`` or names/patterns of trainer weights nothing reads (else an
            error naming them); listed on :attr:`unused`.
        quantize: ``BlockFP8()``: every ``float8_e4m3fn`` rollout tensor is block-quantized at
            the sender and its ``<name>_scale_inv`` written beside it
            (``meshgroups.transfer.BlockFP8``; the quantizer: ``meshgroups.transfer.quantize_blocks``).
        rollout_weights: the rollout's global weights (``Weight`` with placements), when its
            tensors are plain local shards (vLLM) rather than DTensors; ``rollout`` then holds
            the local tensors by these names. The same list on every rank.
        topology, bucket_bytes, timeout, progress: as for ``plan_transfer`` / ``execute``.
        job: the ``Job`` whose options build the transfer groups (closed with it too);
            without, ``options`` (or ``device_type``, ``backend`` and ``timeout``) do.
        dims: mesh dim name -> layout dim name, for both sides (``{"dp_shard": "dp"}``).
        stage_dim: the layout dim of pipeline stages (see ``local_weights``).
        options: a ``MeshOptions`` for the transfer groups and the waits, instead of
            ``device_type``, ``backend`` and ``timeout`` (giving both is a ``TypeError``).
        delta: ``True`` or a ``DeltaPolicy``: each ``sync()`` after the first sends only what
            changed since the version each receiver holds (checked by version and digest; a
            receiver that does not hold it gets dense), ``Report.delta`` its figures; each
            sender keeps a shadow of what it sent (``shadow_bytes``). See ``sync_delta``.

    Attributes:
        plan: this rank's part of the current plan (``plan.mapping``: the links).
        groups: the current ``TransferGroups`` (``None`` after a failure until rebuilt).
        plans, group_builds, syncs: how many plans and group builds were made, and syncs done.
        last_report: the last successful ``sync()``'s ``Report``.
        version: the version this rank's tensors hold (its rollout tensors, its shadow), as
            the last ``sync()`` made it; ``None``: unknown (before the first, after a failure).
            Set it where the tensors were restored to a known version.

    Raises (on every rank alike, from the constructor and from a re-plan in ``sync()``):
        LayoutError: a rollout weight nothing writes, a trainer weight nothing reads, a dtype
            change ``cast`` does not allow, a rollout tensor of the wrong local shape, a mesh
            that is not the layout's — each naming the weights. TypeError: bad arguments.
        MismatchError: ranks passed different settings.
    """

    def __init__(
        self,
        trainer: Tensors,
        trainer_layout: Layout,
        rollout: Tensors,
        rollout_layout: Layout,
        *,
        name_map: NameMap | Mapping[str, object] | None = None,
        cast: Cast = None,
        allow_unused: bool | Sequence[str] = False,
        quantize: BlockFP8 | None = None,
        rollout_weights: Sequence[Weight] | None = None,
        topology: Topology | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout: timedelta | float | None = None,
        progress: Callable[[Progress], object] | None = None,
        job: Job | None = None,
        device_type: str = "cpu",
        backend: str | None = None,
        dims: Mapping[str, str] | None = None,
        stage_dim: str | None = "pp",
        options: MeshOptions | None = None,
        delta: bool | DeltaPolicy = False,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "WeightSync needs an initialised default process group (dist.init_process_group)"
            )
        self.trainer, self.trainer_layout = trainer, trainer_layout
        self.rollout, self.rollout_layout = rollout, rollout_layout
        self.name_map = NameMap.of(name_map)
        self.cast, self.allow_unused, self.quantize = cast, allow_unused, quantize
        self.rollout_weights = None if rollout_weights is None else list(rollout_weights)
        self.topology, self.bucket_bytes = topology, bucket_bytes
        # one options value (or the loose keywords; both: a TypeError inside the first call)
        keywords = MeshOptions(device_type=device_type, backend=backend, timeout=timeout)
        self.options, self._refusal = merge_options(options, keywords)
        self.timeout, self.progress = self.options.timeout, progress
        self.job, self.device_type, self.backend = job, self.options.device_type, self.options.backend
        self.dims, self.stage_dim = dims, stage_dim
        self.plan: TransferPlan | None = None
        self.groups: TransferGroups | None = None
        self.plans = self.group_builds = self.syncs = 0
        self.last_report: Report | None = None
        self._planned: tuple[object, ...] | None = None
        self._slices: list[tuple[str, str, tuple[slice, ...] | None, str, tuple[slice, ...] | None, Any]] = []
        self._quant: dict[str, tuple[tuple[int, int], str]] = {}  # value link -> (block, scale link)
        self._packs = PackBuffers()  # packed messages' buffers, kept across sync() calls
        self.delta = DeltaPolicy.of(delta)
        self.version: int | None = None
        self.shadows = Shadows()  # delta: what this rank last sent (see delta_codec)
        self._build()

    # ------------------------------------------------------------------ state
    @property
    def unused(self) -> tuple[str, ...]:
        """Trainer weights (or ranges of one) no rollout weight reads, allowed by ``allow_unused``."""
        return () if self.plan is None or self.plan.mapping is None else self.plan.mapping.unused

    def _read(self) -> tuple[tuple[object, ...], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """What this rank's plan depends on (local; see ``torch_io.describe``), and its local
        trainer and rollout tensors, in one pass."""
        trainer, t_local = read(self.trainer)
        rollout, r_local = read(self.rollout)
        weights = None if self.rollout_weights is None else tuple(self.rollout_weights)
        layouts = (self.trainer_layout.fingerprint(), self.rollout_layout.fingerprint())
        return (layouts, trainer, rollout, weights), t_local, r_local

    def _wait(self) -> timedelta:
        return as_timedelta(self.timeout, default_timeout())

    # ------------------------------------------------------------------ planning
    def _build(self) -> None:
        """TransferPlan (this rank's part) and build the groups: one collective call, so a failure on
        any rank (a forgotten weight, a bad buffer) is raised on every rank before anything moves."""
        if self.groups is not None:
            self.groups.close()
        self.plan, self.groups, self._planned = None, None, None
        self.shadows.clear()  # its boxes are the old plan's: the next delta sync is dense
        me = dist.get_rank()
        with collective_call("WeightSync") as call:
            if self._refusal is not None:
                raise TypeError(self._refusal)
            state, _, rollout_local = self._read()
            call.compare(
                layouts=state[0],
                name_map=digest_text(self.name_map.dumps()),
                settings=(
                    repr(self.cast),
                    repr(self.allow_unused),
                    self.bucket_bytes,
                    repr(self.topology),
                    repr(self.quantize),
                    repr(self.delta),
                ),
            )
            tw, _ = local_weights(self.trainer, self.trainer_layout, dims=self.dims, stage_dim=self.stage_dim)
            if self.rollout_weights is None:
                rw, _ = local_weights(
                    self.rollout, self.rollout_layout, dims=self.dims, stage_dim=self.stage_dim
                )
            else:
                rw = []
            call.agree({}, {}, timeout=self._wait())  # settings compared; a failure above is every rank's
            # This meeting is over: a failure below is published at the next one (the groups').
            call.open = None
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, (tw, rw))
            trainer_w = merge([g[0] for g in gathered], "trainer")
            rollout_w = self.rollout_weights or merge([g[1] for g in gathered], "rollout")
            plan = plan_transfer(
                self.trainer_layout,
                trainer_w,
                self.rollout_layout,
                rollout_w,
                self.topology,
                rank=me,
                name_map=self.name_map,
                cast=self.cast,
                allow_unused=self.allow_unused,
                quantize=self.quantize,
            )
            check_buffers(plan, me, rollout_local)
            self._keep_slices(plan, me)
            self.plans += 1
            self.plan = plan
            self._build_groups()  # joins this call: a failure above reaches every rank there
            self._planned = state

    def _keep_slices(self, plan: TransferPlan, me: int) -> None:
        """The slices of this rank's local tensors each link reads and writes, kept for every
        ``sync()`` (they depend on the plan only)."""
        if plan.mapping is None:  # an invariant of this module, not a check of user input
            raise RuntimeError("meshgroups internal error: plan.mapping is None")
        self._slices = [
            (
                link.name,
                link.source,
                None if (a := link.src_local(me)) is None else slices(a),
                link.rollout,
                None if (b := link.dst_local(me)) is None else slices(b),
                link.src_axes,
            )
            for link in plan.mapping.links.values()
        ]
        self._quant = {
            link.scale[1]: (link.scale[0], link.name)
            for link in plan.mapping.links.values()
            if link.scale is not None and link.scale[1] is not None
        }

    def _build_groups(self) -> None:
        if self.plan is None:  # an invariant of this module, not a check of user input
            raise RuntimeError("meshgroups internal error: self.plan is None")
        if self.job is not None:  # the job's options; closed with the job too
            self.groups = self.job.transfer_groups(self.plan)
        else:
            self.groups = TransferGroups(
                self.plan,
                cache=GroupCache(),
                device_type=self.device_type,
                backend=self.backend,
                timeout=self.timeout,
                strategy=self.options.strategy,  # type: ignore[arg-type]
            )
        self.group_builds += 1

    def _changed(self, mine: bool, timeout: timedelta | float | None) -> bool:
        """Whether any rank's weights or layouts changed since the plan (``mine``: this
        rank's verdict; one small all-reduce, bounded by ``timeout``)."""
        try:
            wait = as_timedelta(timeout, self._wait())
        except (TypeError, ValueError):  # execute refuses it next, on every rank alike
            wait = self._wait()
        status = Status(dist.group.WORLD, wait)  # type: ignore[arg-type]
        try:
            changed, _, _ = status.exchange(mine)
        except Exception as exc:
            raise no_status(status, exc, "asking whether the weights changed", -1, "check", ()) from exc
        return bool(changed)

    # ------------------------------------------------------------------ moving
    def _views(
        self, trainer: Mapping[str, torch.Tensor], rollout: Mapping[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Per link, the slice of this rank's trainer shard it reads and of its rollout tensor
        it writes (views: same storage), from the slices kept with the plan."""
        src: dict[str, torch.Tensor] = {}
        dst: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name, source, src_at, target, dst_at, axes in self._slices:
                if src_at is not None and source in trainer:
                    src[name] = view_source(trainer[source][src_at], axes)
                if dst_at is not None and target in rollout:
                    dst[name] = rollout[target][dst_at]
            for name, (block, scale) in self._quant.items():
                if name in src:  # the sender quantizes its whole blocks, values and scales
                    src[name], src[scale] = quantize_blocks(src[name], block)
        return src, dst

    def sync(
        self,
        *,
        progress: Callable[[Progress], object] | None = None,
        timeout: timedelta | float | None = None,
        retries: int = 0,
        version: int | None = None,
    ) -> Report:
        """Move the trainer's current weights into the rollout's tensors (collective).

        Re-plans first if any rank's weights or layouts changed (one small all-reduce says so).
        ``progress`` / ``timeout`` override the constructor's for this call. ``retries``: after
        a ``TransferError`` in stage ``"transfer"``, build new groups and move everything
        again, up to this many times. ``version``: the version this sync makes (every rank
        the same, newer than what any rank holds; default: the next one); ``self.version``.

        Returns: this rank's ``Report``.

        Raises:
            TransferError: on every rank alike (see ``execute``); after one in stage
                ``"transfer"`` the broken groups are closed and the next call rebuilds them.
            LayoutError, MismatchError: a re-plan refused (every rank alike).
            ClosedError: the sync was closed (a ``RuntimeError``).
        """
        self._check_open("sync()")
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise MeshConfigError(f"retries={retries!r} must be an int >= 0")
        try:
            state, trainer, rollout = self._read()
            mine = self.plan is None or state != self._planned
        except Exception:  # a broken module: re-plan, where the error is raised on every rank
            mine, trainer, rollout = True, {}, {}
        if self._changed(mine, timeout):
            self._build()
            _, trainer, rollout = self._read()
        for attempt in range(retries + 1):
            if self.groups is None:  # the last transfer broke them
                with collective_call("WeightSync"):
                    self._build_groups()
            src, dst = self._views(trainer, rollout)
            try:
                if self.delta is not None:
                    report = move(self, src, dst, version=version, progress=progress, timeout=timeout,
                                  wait=self._wait(), packs=self._packs)  # fmt: skip
                    self.syncs += 1
                    self.last_report = report
                    return report
                report = execute(
                    self.plan,  # type: ignore[arg-type]
                    src,
                    dst,
                    bucket_bytes=self.bucket_bytes,
                    progress=progress if progress is not None else self.progress,
                    timeout=timeout if timeout is not None else self.timeout,
                    groups=self.groups,
                    buffers=self._packs,
                )
            except TransferError as exc:
                if self.groups is not None and self.groups.broken:  # alike on every rank
                    self.groups.close()
                    self.groups = None
                if exc.stage != "transfer" or attempt == retries:
                    raise
                continue
            self.syncs += 1
            self.last_report = report
            self.version = version if version is not None else (self.version or 0) + 1
            return report
        raise RuntimeError("meshgroups internal error: the retry loop ended without a report or an error")

    def forget(self) -> None:
        """This rank's tensors are of unknown version and its shadow is gone (local): the next
        ``sync()`` sends it, and sends from it, dense."""
        self.shadows.clear()
        self.version = None

    @property
    def shadow_bytes(self) -> int:
        """Bytes of this rank's delta shadow (what it sends in a dense sync, each box once)."""
        return self.shadows.nbytes()

    # ------------------------------------------------------------------ lifetime
    def _release(self) -> int:
        # close(): the transfer groups
        destroyed = self.groups.close() if self.groups is not None else 0
        self.groups = None
        return destroyed

    def __enter__(self) -> WeightSync:
        return self

    def __repr__(self) -> str:
        links = 0 if self.plan is None or self.plan.mapping is None else len(self.plan.mapping.links)
        return f"WeightSync({links} links, plans={self.plans}, group_builds={self.group_builds}, syncs={self.syncs})"


__all__ = ["WeightSync"]
