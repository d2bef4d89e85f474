"""Several layouts in one job: a trainer and a rollout side in one world, and the groups between.

``init_job`` builds every layout of a job in one collective call — each its own root mesh
through ``meshgroups.init_mesh`` (checked across ranks, each distinct group created once via one
shared ``GroupCache``) — after refusing layouts that overlap when they were declared disjoint
(``init_job``'s docstring shows one).

Layouts may sit anywhere in the world (any offset, ``Layout.from_grid`` with permuted ranks);
``sharing="colocated"`` requires both to cover the same ranks, ``"any"`` checks nothing.
``TransferGroups`` (``fanout_groups``) are the only extra groups a transfer needs: one per
fan-out rank set (one slice from one rank to several receivers), over exactly those ranks, and
one over the ranks that talk for the point-to-point messages (never the default group).

``init_job`` is one collective call: the layouts, ``sharing`` and ``flatten`` are checked
inside it and compared across ranks, so a rank passing other arguments (or overlapping layouts
declared disjoint) is an error on every rank, and the same call can be retried at once.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch.distributed as dist

from meshgroups._lifecycle import Closeable
from meshgroups.errors import LayoutError, MeshConfigError
from meshgroups.layout import Layout
from meshgroups.mesh import (
    GroupCache,
    MeshGroups,
    MeshOptions,
    Strategy,
    collective_call,
    init_mesh,
    merge_options,
)
from meshgroups.transfer._run.fanout_groups import RouteKey, TransferGroups, fanouts

if TYPE_CHECKING:
    from meshgroups.transfer._plan.plan import TransferPlan

Sharing = Literal["disjoint", "colocated", "any"]
SHARINGS = ("disjoint", "colocated", "any")


def check_sharing(layouts: Mapping[str, Layout], sharing: str) -> None:
    """Raise ``LayoutError`` naming a rank when the layouts break ``sharing``; torch-free.

    >>> check_sharing({"a": Layout(tp=4), "b": Layout(tp=4, rank_offset=3)}, "disjoint")
    Traceback (most recent call last):
    ...
    meshgroups.errors.LayoutError: layouts 'a' and 'b' were declared disjoint but share rank 3 ...
    """
    if sharing not in SHARINGS:
        raise MeshConfigError(f"sharing={sharing!r} must be one of {', '.join(map(repr, SHARINGS))}")
    names = list(layouts)
    ranks = {name: np.unique(layouts[name].grid) for name in names}
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            if sharing == "disjoint":
                shared = np.intersect1d(ranks[a], ranks[b], assume_unique=True)
                if shared.size:
                    raise LayoutError(
                        f"layouts {a!r} and {b!r} were declared disjoint but share rank {int(shared[0])} "
                        f"({shared.size} shared ranks); move one (rank_offset, from_grid) or pass "
                        "sharing='colocated' or 'any'"
                    )
            elif sharing == "colocated":
                only = np.setxor1d(ranks[a], ranks[b], assume_unique=True)
                if only.size:
                    r = int(only[0])
                    inside, outside = (a, b) if r in layouts[a] else (b, a)
                    raise LayoutError(
                        f"layouts {a!r} and {b!r} were declared colocated (the same ranks) but rank {r} is in "
                        f"{inside!r} and not in {outside!r}; pass sharing='any' for a partial overlap"
                    )


class Job(Closeable):
    """Every layout of a job built on this rank: ``job[name]`` is that layout's ``MeshGroups``
    (a mesh whose ``get_coordinate()`` is ``None``, and ``None`` groups, on ranks outside it).
    All share ``cache``, so a group two layouts both need (colocated ``tp`` groups of equal
    ranks) exists once. ``close()`` (or
    leaving ``with job:``) releases the meshes and every ``TransferGroups`` made from the job.

    Made by ``init_job``: ``meshes`` and ``cache`` as above, ``sharing`` as passed to it,
    ``options`` the ``MeshOptions`` every layout was built with (transfer groups use them).
    On rank 5 of 8 (torch's single-process ``"fake"`` backend stands in for the 8 ranks)::

        >>> import torch.distributed as dist
        >>> from torch.testing._internal.distributed.fake_pg import FakeStore
        >>> from meshgroups import Layout
        >>> from meshgroups.transfer import init_job
        >>> dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=8)
        >>> with init_job({"trainer": Layout(dp=2, tp=2), "rollout": Layout(tp=4, rank_offset=4)}) as job:
        ...     job.roles(5), job["rollout"].ranks("tp"), job["trainer"].group("tp") is dist.GroupMember.NON_GROUP_MEMBER
        (('rollout',), [4, 5, 6, 7], True)
        >>> dist.destroy_process_group()
    """

    def __init__(
        self, meshes: Mapping[str, MeshGroups], cache: GroupCache, sharing: str, options: MeshOptions
    ) -> None:
        self.meshes = dict(meshes)
        self.cache = cache
        self.sharing = sharing
        self.options = options
        self._transfer: list[TransferGroups] = []

    @property
    def layouts(self) -> dict[str, Layout]:
        return {name: mg.layout for name, mg in self.meshes.items()}

    def __getitem__(self, name: str) -> MeshGroups:
        if name not in self.meshes:
            raise KeyError(f"no layout {name!r} in this job; layouts are {', '.join(self.meshes)}")
        return self.meshes[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.meshes)

    def roles(self, rank: int | None = None) -> tuple[str, ...]:
        """The names of the layouts holding ``rank`` (default: this rank), in job order."""
        r = dist.get_rank() if rank is None else rank
        return tuple(name for name, mg in self.meshes.items() if r in mg.layout)

    def transfer_groups(self, plan: TransferPlan) -> TransferGroups:
        """Collective: the fan-out groups of ``plan`` (see ``TransferGroups``), built with this
        job's options and closed with the job. One collective call: a job closed on one rank is
        an error on every rank. They get a cache of their own, never sharing a process group
        with the job's meshes: a transfer that fails inside a broadcast leaves that group's
        collectives out of step, and the training groups must not be that group."""
        with collective_call("TransferGroups"):  # TransferGroups joins this call
            self._check_open("transfer_groups()")
            o = self.options
            groups = TransferGroups(
                plan,
                cache=GroupCache(),
                device_type=o.device_type,
                backend=o.backend,
                timeout=o.timeout,
                strategy=o.strategy,  # type: ignore[arg-type]
                check=o.check,
            )
        self._transfer.append(groups)
        return groups

    def _release(self) -> int:
        # close(): what this job created, transfer groups first, then each mesh's groups
        destroyed = sum(t.close() for t in self._transfer)
        return destroyed + sum(mg.close() for mg in self.meshes.values())

    def __enter__(self) -> Job:
        return self

    def __repr__(self) -> str:
        parts = ", ".join(f"{name}={mg.layout!r}" for name, mg in self.meshes.items())
        return f"Job({parts}, sharing={self.sharing!r})"


def init_job(
    layouts: Mapping[str, Layout],
    *,
    sharing: Sharing = "disjoint",
    device_type: str = "cpu",
    flatten: Mapping[str, Iterable[Sequence[str]]] | None = None,
    backend: str | None = None,
    timeout: timedelta | float | None = None,
    strategy: Strategy = "auto",
    check: bool | None = None,
    options: MeshOptions | None = None,
) -> Job:
    """Build every layout of a job (collective: every rank of the world calls it alike).

    One collective call (``collective_call("init_job")``, see ``meshgroups.mesh.collective_call``): its
    number is taken before anything is checked, every check below runs inside it (so an error
    on one rank is raised on every rank, the same class, naming that rank), the ranks compare
    ``sharing``, the layouts (names and fingerprints) and ``flatten`` at their first meeting,
    and each layout's ``init_mesh`` joins the call rather than making one of its own.

    Args:
        layouts: ``{"trainer": Layout(...), "rollout": Layout(...)}``, built in this order, each
            its own root mesh; ranks outside a layout get its mesh with coordinate ``None``
            and torch's ``GroupMember.NON_GROUP_MEMBER`` as groups.
        sharing: ``"disjoint"`` (no rank in two layouts), ``"colocated"`` (every layout over the
            same ranks) or ``"any"``; checked before anything is built.
        flatten: per layout name, the flattened dim sets to build (``{"trainer": [("dp", "cp")]}``).
        device_type: as for ``init_mesh``, for every layout.
        backend: as for ``init_mesh``, for every layout.
        timeout: as for ``init_mesh``, for every layout.
        strategy: as for ``init_mesh``, for every layout.
        check: as for ``init_mesh``, for every layout.
        options: a ``MeshOptions`` for every layout, instead of the option keywords above
            (giving both is a ``TypeError`` on every rank).

    Returns:
        The ``Job``: ``job[name]`` is that layout's ``MeshGroups``; ``close()`` releases them all.

    Raises:
        TypeError: bad argument types (also ``MeshConfigError`` for bad values).
        LayoutError: the layouts break ``sharing`` (naming a rank).
        MismatchError: ranks passed a different ``sharing``, ``layouts`` or ``flatten``
            (``argument`` names which, ``ranks`` the odd ones).
        Exception: everything ``init_mesh`` raises; a failure in a later layout closes the
            earlier ones before it propagates. Each on every rank alike; the identical call
            can be retried at once.

    A trainer on ranks 0-3 and a rollout on ranks 4-7, here on rank 5 (torch's single-process
    ``"fake"`` backend stands in for the 8 ranks; in a job: ``init_process_group("nccl")``)::

        >>> import torch.distributed as dist
        >>> from torch.testing._internal.distributed.fake_pg import FakeStore
        >>> from meshgroups import Layout
        >>> from meshgroups.transfer import init_job
        >>> dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=8)
        >>> job = init_job({"trainer": Layout(dp=2, tp=2), "rollout": Layout(tp=4, rank_offset=4)})
        >>> job.roles(5), job["trainer"].mesh.get_coordinate() is None
        (('rollout',), True)
        >>> job.close()  # or leave a ``with job:`` block
        1
        >>> dist.destroy_process_group()
    """
    keywords = MeshOptions(
        device_type=device_type, backend=backend, timeout=timeout, strategy=strategy, check=check
    )
    merged, refusal = merge_options(options, keywords)
    with collective_call("init_job") as call:  # numbered before anything is checked
        if refusal is not None:
            raise TypeError(refusal)
        flat = _check_job(layouts, sharing, flatten)
        call.compare(
            sharing=sharing,
            layouts=digest_text(", ".join(f"{n}={layouts[n].fingerprint()}" for n in layouts)),
            flatten=digest_text(repr(sorted((n, [tuple(d) for d in f]) for n, f in flat.items()))),
        )
        cache = GroupCache()
        # each layout of a job covers part of the world (trainer and rollout ranks): partial
        per_layout = merged.replace(partial=True)
        meshes: dict[str, MeshGroups] = {}
        try:
            for name, layout in layouts.items():  # each joins this call (one number, one protocol)
                meshes[name] = init_mesh(layout, flatten=flat.get(name, ()), cache=cache, options=per_layout)
        except BaseException:
            for mg in meshes.values():
                mg.close()
            raise
        return Job(meshes, cache, sharing, per_layout)


def _check_job(
    layouts: object, sharing: object, flatten: Mapping[str, Iterable[Sequence[str]]] | None
) -> dict[str, list[Sequence[str]]]:
    """``init_job``'s local checks (run inside its collective call); returns ``flatten`` as a
    dict of lists."""
    if not isinstance(layouts, Mapping) or not layouts:
        raise TypeError(f"layouts must be a non-empty mapping name -> Layout, got {layouts!r}")
    for name, layout in layouts.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"layout names must be non-empty strings, got {name!r}")
        if not isinstance(layout, Layout):
            raise TypeError(f"layout {name!r} must be a meshgroups.Layout, got {type(layout).__name__}")
    if flatten is not None and not isinstance(flatten, Mapping):
        raise TypeError(
            f"flatten must map layout names to dim sets, e.g. {{'trainer': [('dp', 'cp')]}}; got {flatten!r}"
        )
    flat = {name: list(sets) for name, sets in (flatten or {}).items()}
    unknown = sorted(set(flat) - set(layouts), key=str)
    if unknown:
        raise MeshConfigError(f"flatten names layout {unknown[0]!r}; layouts are {', '.join(layouts)}")
    if not isinstance(sharing, str):
        raise TypeError(f"sharing must be a str ({', '.join(map(repr, SHARINGS))}), got {sharing!r}")
    check_sharing(layouts, sharing)
    return flat


def digest_text(text: str, limit: int = 120) -> str:
    """``text`` itself when short, else its start and a hash of all of it: the compared value
    of a collective call is shown in a mismatch and must differ whenever ``text`` does."""
    if len(text) <= limit:
        return text
    return f"{text[: limit - 30]}… #{hashlib.sha256(text.encode()).hexdigest()[:16]}"


__all__ = ["Job", "RouteKey", "Sharing", "TransferGroups", "check_sharing", "fanouts", "init_job"]
