"""A training job that loses ranks and keeps going: ``Elastic`` holds the mesh, the live ranks,
the spares and the verdicts (its docstring says how).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta

import numpy as np
import torch.distributed as dist

from meshgroups import _deprecated
from meshgroups._lifecycle import Closeable
from meshgroups.elastic._join import Newcomers, publish_job
from meshgroups.elastic._plans import RecoveryPlan, plan_grow, plan_shrink, plan_substitute, replicate_dim
from meshgroups.elastic._recover import rebuild
from meshgroups.elastic._unblock import StepWatcher, publish_state, severed_pairs, wake_watchers
from meshgroups.elastic._verdict import (
    Verdict,
    agree_lost,
    commit,
    failed_step,
    publish_failure,
    wake_commits,
)
from meshgroups.errors import MeshConfigError, RanksLostError, StepFailedError
from meshgroups.layout import Layout, Topology
from meshgroups.mesh import (
    Cohort,
    GroupCache,
    MeshGroups,
    MeshOptions,
    as_timedelta,
    collective_call,
    default_store,
    default_timeout,
    init_mesh,
    merge_options,
    set_cohort,
    start_heartbeat,
)


class Elastic(Newcomers, Closeable):
    """A training job that loses ranks and keeps going: the mesh, the live ranks, the spares
    and the verdicts.

    - ``Elastic(...)`` is collective over the layout's ranks and the spares (every one calls it):
      it starts the process's heartbeat (the liveness every meshgroups wait uses) and builds
      the layout with ``strategy="local"``.
    - ``step()`` guards one training step: an exception inside (a collective that lost its peer:
      gloo's ``Connection closed by peer``, or a timeout) is published, the ranks agree who is
      lost (``agree_lost``), and every survivor raises ``RanksLostError`` naming the same ranks
      (or ``StepFailedError`` when every rank is alive); a rank that was too late raises
      ``ExcludedError``. Failures are counted by step: a rank still finishing step k when a peer
      fails in step k + 1 gets through step k and fails in step k + 1 as the others did.
    - ``shrink()`` drops the replicas that hold lost ranks and rebuilds over the survivors
      (``meshgroups.elastic.rebuild``: unchanged groups are the same objects); ``grow(ranks)``
      admits spares as new replicas; spares wait in ``standby()``.
    - ``live_group``: a process group over the live members — what needs a world-wide group
      (the default group holds the dead ranks forever).

    The store must outlive every worker (torchrun's agent store, or a store process): the
    default ``tcp://`` rendezvous hosts it in rank 0, and losing rank 0 then loses the store.
    On a one-process world (in a job, every rank of the layout and every spare calls it)::

        >>> import torch.distributed as dist
        >>> from meshgroups import Elastic, Layout
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> with Elastic(Layout(dp=1, tp=1)) as el:
        ...     with el.step():  # one guarded training step, on el.mg
        ...         pass
        ...     el.mg.ranks("dp"), el.members, el.dim
        ([0], (0,), 'dp')
        >>> dist.destroy_process_group()

    A job's loop, where ranks die (several processes; the whole program: ``docs/elastic.md``)::

        while training:
            try:
                with el.step():
                    train_step(el.mg)
            except RanksLostError:        # every survivor, the same lost ranks
                model.reset_iter_state()  # FSDP2: the failed step's unsharded params out
                mg = el.shrink()          # None on a rank that became a spare
                ...                       # rebuild the model on el.mg, from the state kept

    Args:
        layout: the starting layout (over part or all of the default group's world).
        spares: idle ranks outside the layout that may be admitted later (they call
            ``standby()`` after the constructor).
        flatten: ``init_mesh``'s flattened dims.
        dim: the replicate dim that shrinks and grows (default: the outermost dim named
            ``dp_replicate``, ``replicate``, ``dp``, ``ddp`` or ``data``).
        timeout: bound on each group's collectives and creation (default: the default group's).
        verdict_timeout: how long the survivors wait for a rank that is alive (heartbeat
            beating) but has not reported (default: twice ``timeout`` plus 5 s: a rank blocked
            in a collective with a failed peer reports when that collective times out).
        heartbeat: seconds between heartbeats; stale_after: a rank whose heartbeat did not
            change for this long stopped responding and is lost — dead, or stopped
            (SIGSTOP); a rank that exited is lost at once (default ``max(5 * heartbeat, 5)``,
            ``MeshOptions.lease``'s default). Every wait of the meshes built here uses them.
        device_type, backend: as for ``init_mesh``.
        options: a ``MeshOptions`` instead of ``timeout``, ``device_type`` and ``backend``
            (its strategy ``"auto"`` or ``"local"``: every mesh is built with ``"local"``;
            its ``heartbeat`` and ``lease`` are replaced by ``heartbeat`` and ``stale_after``).

    Raises:
        TypeError: ``options`` together with one of the keywords it replaces.
        MeshConfigError: spares inside the layout, no replicate dim, an ``options.strategy``
            other than ``"auto"``/``"local"``; what ``init_mesh`` raises.
    """

    def __init__(
        self,
        layout: Layout,
        *,
        spares: Iterable[int] = (),
        flatten: Iterable[Sequence[str]] = (),
        dim: str | None = None,
        timeout: timedelta | float | None = None,
        verdict_timeout: float | None = None,
        heartbeat: float = 1.0,
        stale_after: float | None = None,
        device_type: str = "cpu",
        backend: str | None = None,
        options: MeshOptions | None = None,
    ) -> None:
        self.rank = dist.get_rank()
        keywords = MeshOptions(device_type=device_type, backend=backend, timeout=timeout)
        given, refusal = merge_options(options, keywords)
        if refusal is not None:
            raise TypeError(refusal)
        if given.strategy not in ("auto", "local"):
            raise MeshConfigError(
                f"Elastic builds every mesh with strategy='local' (after a loss the ranks hold different "
                f"groups), got options.strategy={given.strategy!r}"
            )
        self._settle(layout, spares, flatten, dim, given, verdict_timeout, heartbeat, stale_after)
        if self.rank == min({*self.members, *self.spares}):  # what a newcomer needs (Elastic.join)
            publish_job(self.store, self._job())
        self.cohort = self._cohort(tuple(sorted({*self.members, *self.spares})), 0)
        set_cohort(self.cohort)
        self.mg: MeshGroups | None = init_mesh(
            layout, cache=self.cache, flatten=self.flatten, options=self.options
        )
        self._world: MeshGroups | None = self._world_mesh(self.members)
        if self.is_spare:  # spares hold no group; they wait in standby()
            self._drop_meshes()
        self.cohort = self._cohort(self.members, 0, self.live_group)
        set_cohort(self.cohort)

    def _settle(
        self,
        layout: Layout,
        spares: Iterable[int],
        flatten: Iterable[Sequence[str]],
        dim: str | None,
        given: MeshOptions,
        verdict_timeout: float | None,
        heartbeat: float,
        stale_after: float | None,
    ) -> None:
        """Every field but the meshes (no collective): the constructor's and ``join``'s part."""
        self.layout = layout
        self.spares: tuple[int, ...] = tuple(sorted(int(r) for r in spares))
        inside = [r for r in self.spares if r in layout]
        if inside:
            raise MeshConfigError(f"spares {inside} are inside the layout; spares are idle ranks outside it")
        self.dim = dim if dim is not None else replicate_dim(layout)
        wait = as_timedelta(given.timeout, default_timeout())
        self.verdict_timeout = _seconds("verdict_timeout", verdict_timeout, 2 * wait.total_seconds() + 5)
        beat = _seconds("heartbeat", heartbeat, 1.0)
        self.stale_after = _seconds("stale_after", stale_after, max(5 * beat, MeshOptions().lease))
        # One value for every mesh this object builds (the main mesh, the members' group, each
        # rebuild): local synchronisation, because after a loss the ranks hold different groups;
        # layouts over part of the ranks (spares, dropped replicas) by design; the liveness of
        # every wait is this object's heartbeat and lease.
        self.options = given.replace(
            timeout=wait,
            strategy="local",
            partial=True,
            heartbeat=beat,
            lease=max(self.stale_after, 2 * beat),
        )
        self.flatten: tuple[tuple[str, ...], ...] = tuple(tuple(f) for f in flatten)
        self.store = default_store()
        self._enter_epoch(0)
        self.members: tuple[int, ...] = tuple(sorted(layout.grid.ravel().tolist()))
        self.verdicts: list[Verdict] = []
        self.plan: RecoveryPlan | None = None  # the last shrink / substitute / grow plan
        # the replica indices whose state must be filled after the last grow() / substitute()
        self.grown: tuple[int, ...] = ()
        self.liveness = start_heartbeat(self.store, beat)  # this process's observer of the world
        self.cache = GroupCache()
        # Wakes this rank when blocked in a collective with a peer that left a failed step; the
        # pairs it severs break groups the next rebuild replaces (elastic/_unblock.py).
        self._watcher = StepWatcher.over(
            self.store,
            self.rank,
            self.cache,
            poll=min(0.05, beat),
            lease=self.stale_after,
        )
        self._broken: set[tuple[int, int]] = set()

    # ------------------------------------------------------------------ live ranks
    def _cohort(self, members: Sequence[int], epoch: int, group: dist.ProcessGroup | None = None) -> Cohort:
        """The cohort of ``members``, whose collective calls stop waiting for a rank that is gone
        (a rank dying during a recovery is seen at once, or in ``stale_after`` seconds if it
        stopped responding, not after the whole meeting timeout)."""
        liveness, lease = self.liveness, self.stale_after
        return Cohort(tuple(members), epoch, group, watch=lambda: lambda ranks: liveness.gone(ranks, lease))

    @property
    def live_group(self) -> dist.ProcessGroup | None:
        """A process group over the live members (on a spare torch's ``NON_GROUP_MEMBER``, as
        ``MeshGroups.group`` gives a non-member; ``None`` once closed)."""
        return None if self._world is None else self._world.group("member")

    # live_group's name before 0.4.1 (MeshGroups.group is a method looking a group up by dims)
    group = _deprecated.renamed_property("Elastic.group")

    @property
    def is_spare(self) -> bool:
        return self.rank not in self.members

    def _world_mesh(self, members: Sequence[int]) -> MeshGroups | None:
        """A 1-D mesh over ``members`` (its group: ``self.live_group``), through the shared cache."""
        grid = np.asarray([list(members)], dtype=np.int64)
        return init_mesh(
            Layout.from_grid(grid, ("world", "member")),
            cache=self.cache,
            only=[("member",)],
            options=self.options,
        )

    # ------------------------------------------------------------------ failures
    @contextmanager
    def step(self) -> Iterator[None]:
        """Guard one step (see ``Elastic``). Raises ``RanksLostError`` / ``StepFailedError`` on
        every live member alike, ``ExcludedError`` on a rank declared lost."""
        self._check_open("step()")
        if self.is_spare:
            raise MeshConfigError(f"rank {self.rank} is a spare: call standby(), not step()")
        self._steps += 1
        self._watcher.arm(self.epoch, self.members)
        try:
            yield
        except Exception as exc:
            raise self._fail(exc) from exc
        finally:
            self._watcher.disarm()
        # A peer failed in this step (or before) while this rank got through. A failure in a
        # later step (this rank was still finishing this one) is not this step's: the next step
        # meets it as every rank did (its collectives fail, commit() aborts).
        failed = failed_step(self.store, self.epoch)
        if failed is not None and failed <= self._steps:
            raise self._fail(None)

    def _enter_epoch(self, epoch: int) -> None:
        current: int | None = getattr(self, "epoch", None)
        if getattr(self, "_watcher", None) is not None and current is not None and epoch != current:
            self._watcher.release(current)
        self.epoch: int = epoch
        self._commits = self._steps = 0

    def commit(self) -> None:
        """Inside ``step()``, between ``backward()`` and ``optimizer.step()``: returns once every
        live member got this far, so no rank applies a step that failed elsewhere (a replica
        whose collectives all succeeded would otherwise step while its peers did not). Raises
        (turned into the verdict by ``step()``) as soon as a failure is published or a member's
        heartbeat stops. One store ``add`` and a wait per rank."""
        self._check_open("commit()")
        number, self._commits = self._commits, self._commits + 1
        commit(
            self.store,
            self.epoch,
            number,
            self.members,
            self.rank,
            timeout=self.verdict_timeout,
            stale_after=self.stale_after,
            observer=self.liveness,
        )

    def _fail(self, exc: BaseException | None) -> StepFailedError:
        self._watcher.disarm()  # nothing severed after this rank's check-in
        publish_state(
            self.store, self.epoch, self.rank, self.cache
        )  # before the failure: a reader finds both
        publish_failure(self.store, self.epoch, self.rank, exc, step=self._steps)
        wake_commits(self.store, self.epoch, self._commits)  # peers waiting in commit() see it now
        wake_watchers(self.store, self.epoch, self.members)  # peers blocked in a collective, too
        verdict = agree_lost(
            self.store,
            self.epoch,
            self.members,
            self.rank,
            timeout=self.verdict_timeout,
            stale_after=self.stale_after,
            observer=self.liveness,
        )
        self.verdicts.append(verdict)
        self._broken |= severed_pairs(self.store, verdict.epoch)  # complete: read after the close
        self._enter_epoch(self.epoch + 1)
        self.members = verdict.survivors
        self.cohort = self._cohort(self.members, self.epoch)
        set_cohort(self.cohort)
        lost = ", ".join(map(str, verdict.lost))
        if verdict.lost:
            return RanksLostError(
                f"rank {self.rank}: rank{'s' if len(verdict.lost) > 1 else ''} {lost} lost in epoch {verdict.epoch} "
                f"({verdict.why}); survivors {list(verdict.survivors)}; first failure: {verdict.cause}",
                verdict.lost,
                verdict.epoch,
                verdict.survivors,
                verdict.cause,
            )
        return StepFailedError(
            f"rank {self.rank}: the step failed in epoch {verdict.epoch} with every rank alive; first failure: "
            f"{verdict.cause}. Rebuild (el.rebuild()) before the next step: groups may be out of step",
            (),
            verdict.epoch,
            verdict.survivors,
            verdict.cause,
        )

    # ------------------------------------------------------------------ new layouts
    def rebuild(self, layout: Layout | None = None, site: str | None = None) -> MeshGroups | None:
        """Build ``layout`` (default: the current one, e.g. after ``StepFailedError``) over the live
        members that it holds; members outside it become spares. Collective over the new
        layout's ranks (the others only close their mesh). Returns the mesh, ``None`` on a
        rank that became a spare."""
        self._check_open("rebuild()")
        layout = layout if layout is not None else self.layout
        ranks = tuple(sorted(layout.grid.ravel().tolist()))
        dropped = [r for r in self.members if r not in ranks]
        self.spares = tuple(sorted({*self.spares, *dropped} - set(ranks)))
        self.layout, self.members = layout, ranks
        if self.rank not in ranks:
            self._drop_meshes()
            return None
        self.cohort = self._cohort(ranks, self.epoch)
        set_cohort(self.cohort)
        old_world = self._world
        try:
            with collective_call("Elastic.rebuild") as call:  # one call: the mesh and the world group
                if site is not None:
                    call.site_key = call.site = site
                mg = rebuild(
                    self.mg,
                    layout,
                    options=self.options,
                    flatten=self.flatten,
                    cache=self.cache,
                    broken=self._broken,
                )
                self.mg = mg
                self._world = self._world_mesh(ranks)
        except Exception as exc:
            # A rank failed (or died) during the recovery itself: a verdict over this attempt's
            # ranks, then the same RanksLostError everywhere; the old mesh is still open, so a
            # retry (shrink() again) starts from it.
            raise self._fail(exc) from exc
        self._broken = set()
        if old_world is not None:
            old_world.close()
        self.cohort.group = self.live_group
        return self.mg

    def shrink(self, lost: Iterable[int] | None = None) -> MeshGroups | None:
        """Drop every replica (index of ``dim``) holding a lost rank (default: the last
        verdict's) and rebuild over the rest; the dropped replicas' live ranks become spares.
        Returns the mesh, ``None`` on a rank that became a spare."""
        self._check_open("shrink()")
        self.plan = plan_shrink(self.layout, self._lost(lost), dim=self.dim, flatten=self.flatten)
        return self.rebuild(self.plan.new_layout)

    def substitute(self, lost: Iterable[int] | None = None, node: int | None = None) -> MeshGroups | None:
        """Put spares in the places of the lost ranks (default: the last verdict's), keeping the
        layout's shape; with ``node`` (ranks per node) a whole spare node replaces each node that
        lost a rank, and that node's live ranks leave (they become spares), so node-local dims
        stay node-local. Collective over the new layout's ranks, the admitted spares joining
        through ``standby()``; returns the mesh (``None`` on a rank that left)."""
        self._check_open("substitute()")
        topology = Topology(node=node) if node is not None else None
        self.plan = plan_substitute(
            self.layout, self._lost(lost), self.spares, topology=topology, flatten=self.flatten
        )
        layout, admitted = self.plan.new_layout, self.plan.admitted
        self.grown = tuple(sorted({layout.coords(r)[self.dim] for r in admitted}))
        return self._admit_spares(layout, admitted)

    def _lost(self, lost: Iterable[int] | None) -> tuple[int, ...]:
        """``lost``, or the last verdict's lost ranks."""
        if lost is not None:
            return tuple(sorted({int(r) for r in lost}))
        return self.verdicts[-1].lost if self.verdicts else ()

    def grow(self, ranks: Sequence[int]) -> MeshGroups:
        """Admit ``ranks`` (spares in ``standby()``) as new replicas along ``dim`` (each replica's
        ranks fill it in row-major order) and rebuild over everyone; collective over the
        current members, the admitted ranks join through ``standby()``."""
        self._check_open("grow()")
        admitted = [int(r) for r in ranks]
        missing = [r for r in admitted if r not in self.spares]
        if missing:
            raise MeshConfigError(f"ranks {missing} are not spares of this job (spares: {list(self.spares)})")
        self.plan = plan_grow(self.layout, admitted, dim=self.dim, flatten=self.flatten)
        layout = self.plan.new_layout
        self.grown = tuple(i for i, old in enumerate(self.plan.index_map) if old is None)
        mg = self._admit_spares(layout, admitted)
        if mg is None:  # every current member is in the grown layout; this is a broken invariant
            raise MeshConfigError(f"rank {self.rank} is not in the grown layout {layout!r}")
        return mg

    def _drop_meshes(self) -> int:
        destroyed = sum(m.close() for m in (self.mg, self._world) if m is not None)
        self.mg = self._world = None
        return destroyed

    def _release(self) -> int:
        # close(): close the meshes, leave the cohort (the heartbeat is the process's: it beats
        # until the process exits, for every meshgroups wait)
        destroyed = self._drop_meshes()
        self._watcher.close(self.epoch)
        set_cohort(None)
        return destroyed

    def __enter__(self) -> Elastic:
        return self


def _seconds(name: str, value: float | None, default: float) -> float:
    """A positive number of seconds, ``default`` for ``None`` (0 is refused, not defaulted)."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {value!r}")
    if not 0 < value < float("inf"):
        raise MeshConfigError(f"{name}={value!r} must be a positive, finite number of seconds")
    return float(value)


__all__ = ["Elastic"]
