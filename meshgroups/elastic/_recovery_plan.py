"""``RecoveryPlan``: the value ``plan_shrink``, ``plan_substitute`` and ``plan_grow`` return.

Per-rank queries cost O(ndim + lost): a rank's coordinates in the old layout and the plan's few
facts (the dropped indices, the renamed ranks, the admitted ranks) decide everything. Lists over
the world (``new_layout``, ``spares`` of a shrink, ``change``) are vectorised and cached.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal

import numpy as np

from meshgroups._checks import is_int
from meshgroups.elastic._owners import Changed, Owner
from meshgroups.errors import RecoveryError
from meshgroups.layout import Layout, Topology

Kind = Literal["shrink", "substitute", "grow"]
Role = Literal["survivor", "admitted", "spare", "drained", "lost", "outside"]
FamilyStatus = Literal["kept", "created", "gone"]


@dataclass(frozen=True)
class FamilyChange:
    """What happens to one family of groups.

    Attributes:
        key: the family key (``("tp",)``, ``("dp", "cp")``, a subset name).
        label: its name as torch shows it (``"dp_cp"``, ``"embd"``).
        owner: ``"main"``, ``"view <name>"`` or ``"subset <name>"``.
        dims: the dims the groups vary, in the owner's order.
        old, new: the owner layout before and after (``new`` None: a subset that lost every rank).
        kept: groups present before and after (same ranks, same order): reuse their groups.
        created: groups after that did not exist before.
        gone: groups before that no longer exist.

    >>> from meshgroups import Layout
    >>> from meshgroups.elastic import plan_shrink
    >>> change = plan_shrink(Layout(pp=2, dp=4, tp=2), [5]).change("tp")  # a FamilyChange
    >>> change.label, change.counts(), change.gone.tolist()
    ('tp', {'kept': 6, 'created': 0, 'gone': 2}, [[4, 5], [12, 13]])
    """

    key: Hashable
    label: str
    owner: str
    dims: tuple[str, ...]
    old: Layout
    new: Layout | None
    kept: np.ndarray
    created: np.ndarray
    gone: np.ndarray

    def counts(self) -> dict[str, int]:
        """``{"kept": n, "created": n, "gone": n}``."""
        return {k: int(getattr(self, k).shape[0]) for k in ("kept", "created", "gone")}


class RecoveryPlan:
    """Old layout + lost ranks → new layout and the fate of every group, the same on every
    survivor (numpy only). Built by ``plan_shrink`` / ``plan_substitute`` / ``plan_grow``::

        >>> from meshgroups import Layout
        >>> from meshgroups.elastic import plan_shrink
        >>> plan = plan_shrink(Layout(pp=2, dp=4, tp=2), lost=[5])
        >>> plan
        RecoveryPlan(shrink, Layout(pp=2, dp=4, tp=2) -> {'pp': 2, 'dp': 3, 'tp': 2}, lost=[5], spares=3, admitted=0)
        >>> plan.role(5), plan.role(4), plan.role(6), plan.new_coords(6)
        ('lost', 'spare', 'survivor', {'pp': 0, 'dp': 2, 'tp': 0})

    Attributes:
        kind: ``"shrink"``, ``"substitute"`` or ``"grow"``.
        layout: the layout before.
        dim: the replicate dim (None for substitute).
        lost: the lost ranks, sorted.
        topology: as given (None without).
        dropped: old indices of ``dim`` dropped (shrink).
        index_map: for each new index of ``dim``, the old index it came from (None: new replica).
        replacements: ``{old rank: new rank}`` (substitute).
        drained: alive ranks that left because their node was lost (with a topology).
        admitted: ranks new in the layout, sorted.
        families: every family key (``GroupSpec.key`` of ``init_mesh``: dims or a subset name).
    """

    def __init__(
        self,
        kind: Kind,
        layout: Layout,
        *,
        dim: str | None,
        lost: tuple[int, ...],
        topology: Topology | None,
        families: Mapping[Hashable, tuple[str, tuple[str, ...]]],
        owners: Mapping[str, Owner],
        lost_nodes: frozenset[int] = frozenset(),
        replacements: Mapping[int, int] | None = None,
        unused: tuple[int, ...] = (),
        slabs: np.ndarray | None = None,
    ) -> None:
        self.kind: Kind = kind
        self.layout = layout
        self.dim = dim
        self.lost = lost
        self.topology = topology
        self._families = dict(families)
        self._owners = dict(owners)
        self._lost_set = frozenset(lost)
        self._lost_nodes = lost_nodes
        self._node = topology.levels[0][1] if topology is not None else 0
        self.replacements: Mapping[int, int] = dict(replacements or {})
        self._inverse = {new: old for old, new in self.replacements.items()}
        self._unused = unused
        self._unused_set = frozenset(unused)
        self._slabs = slabs
        main = self._owners["main"]
        self.dropped: tuple[int, ...] = main.indices if kind == "shrink" else ()
        n = layout.size(dim) if dim is not None else 0
        self._dropped = dropped = frozenset(self.dropped)
        if kind == "shrink":
            self.index_map: tuple[int | None, ...] = tuple(i for i in range(n) if i not in dropped)
        elif kind == "grow":
            self.index_map = tuple(range(n)) + (None,) * main.grown
        else:
            self.index_map = ()
        self._new_index = {old: new for new, old in enumerate(self.index_map) if old is not None}
        self._admitted: dict[int, tuple[int, int]] = {}
        if slabs is not None:
            flat = slabs.reshape(slabs.shape[0], -1)
            self._admitted = {int(r): (j, i) for j, row in enumerate(flat) for i, r in enumerate(row)}
        self.admitted: tuple[int, ...] = tuple(sorted(self._inverse or self._admitted))
        self.drained: tuple[int, ...] = tuple(
            sorted(
                r
                for node in lost_nodes
                for r in range(node * self._node, (node + 1) * self._node)
                if r not in self._lost_set and r in layout
            )
        )
        self._drained_set = frozenset(self.drained)
        replaced = np.array(sorted(self.replacements), dtype=np.int64)
        by = np.array([self.replacements[int(r)] for r in replaced], dtype=np.int64)
        self._changed = {label: Changed(o, replaced, by) for label, o in owners.items()}

    # ------------------------------------------------------------------ whole-world answers
    @property
    def families(self) -> tuple[Hashable, ...]:
        """Every family key, in ``init_mesh``'s order: dims, view dims, flattened sets, subsets."""
        return tuple(self._families)

    @cached_property
    def new_layout(self) -> Layout:
        """The survivors' layout, with the views carried over (O(W) numpy unless affine)."""
        main = self._changed["main"].new
        if main is None:  # an invariant of this module, not a check of user input
            raise RuntimeError("meshgroups internal error: main is None")
        views = {label[5:]: self._changed[label].new for label in self._owners if label.startswith("view ")}
        return main.with_views(**views) if views else main  # type: ignore[arg-type]

    @cached_property
    def removed(self) -> tuple[int, ...]:
        """Old-layout ranks not in the new layout, sorted."""
        if self.kind == "substitute":
            return tuple(sorted(self.replacements))
        if self.kind == "grow":
            return ()
        if self.dim is None:  # an invariant of this module, not a check of user input
            raise RuntimeError("meshgroups internal error: self.dim is None")
        gone = self.layout.without_views().select(self.dim, list(self.dropped)).grid.ravel()
        return tuple(int(r) for r in np.sort(gone))

    @cached_property
    def spares(self) -> tuple[int, ...]:
        """Alive ranks left idle, sorted: a shrink's alive ranks of dropped replicas (not
        drained), a substitute's unused spares."""
        if self.kind == "substitute":
            return tuple(sorted(self._unused))
        out = set(self._lost_set) | self._drained_set
        return tuple(r for r in self.removed if r not in out)

    def new_shape(self) -> tuple[int, ...]:
        """Shape of the new layout (O(ndim), without building it)."""
        shape = list(self.layout.shape)
        if self.dim is not None:
            shape[self.layout.names.index(self.dim)] = len(self.index_map)
        return tuple(shape)

    # ------------------------------------------------------------------ per rank, O(ndim + lost)
    def _gone(self, rank: int) -> bool:
        """``rank`` is in the old layout and not in the new one."""
        if rank not in self.layout:
            return False
        if self.kind == "shrink":
            return self.layout.coords(rank)[self.dim] in self._dropped  # type: ignore[index]
        return rank in self.replacements

    def role(self, rank: int) -> Role:
        """``"survivor"`` (in both layouts), ``"admitted"`` (new in the layout), ``"spare"``
        (alive and idle), ``"drained"`` (alive, on a lost node), ``"lost"`` or ``"outside"``."""
        rank = _rank(rank)
        if rank in self._lost_set:
            return "lost"
        if rank in self._inverse or rank in self._admitted:
            return "admitted"
        if rank in self._drained_set:
            return "drained"
        if rank in self.layout:
            return "spare" if self._gone(rank) else "survivor"
        return "spare" if rank in self._unused_set else "outside"

    def old_coords(self, rank: int) -> dict[str, int] | None:
        """``rank``'s coordinates in the old layout, or None."""
        rank = _rank(rank)
        return self.layout.coords(rank) if rank in self.layout else None

    def new_coords(self, rank: int) -> dict[str, int] | None:
        """``rank``'s coordinates in the new layout, or None if it is not in it."""
        rank = _rank(rank)
        if rank in self._admitted:
            j, i = self._admitted[rank]
            if self.dim is None:  # an invariant of this module, not a check of user input
                raise RuntimeError(
                    "meshgroups internal error: self.dim is None (only a grow admits ranks this way)"
                )
            names = [n for n in self.layout.names if n != self.dim]
            shape = [s for n, s in zip(self.layout.names, self.layout.shape) if n != self.dim]
            out = dict(zip(names, (int(c) for c in np.unravel_index(i, shape))))
            out[self.dim] = self.layout.size(self.dim) + j
            return {n: out[n] for n in self.layout.names}
        old = self._inverse.get(rank, rank)
        if old not in self.layout or (old == rank and self._gone(old)):
            return None  # absent, or in the old layout only
        coords = self.layout.coords(old)
        if self.kind == "shrink":
            coords[self.dim] = self._new_index[coords[self.dim]]  # type: ignore[index]
        return coords

    def successor(self, old_rank: int) -> int | None:
        """The rank at ``old_rank``'s coordinates in the new layout (itself, its replacement,
        or None if its replica was dropped)."""
        old_rank = _rank(old_rank)
        if old_rank not in self.layout:
            return None
        if old_rank in self.replacements:
            return self.replacements[old_rank]
        return None if self._gone(old_rank) else old_rank

    def predecessor(self, new_rank: int) -> int | None:
        """The old rank whose coordinates ``new_rank`` holds (None: a new replica or absent)."""
        new_rank = _rank(new_rank)
        if new_rank in self._inverse:
            return self._inverse[new_rank]
        return new_rank if new_rank in self.layout and not self._gone(new_rank) else None

    def _family(self, family: Hashable) -> tuple[str, tuple[str, ...]]:
        asked = family
        if isinstance(family, str) and family not in self._families:
            family = (family,)
        if isinstance(family, list):
            family = tuple(family)
        if family in self._families:
            return self._families[family]
        if isinstance(family, tuple) and all(isinstance(d, str) for d in family):
            for key, (label, dims) in self._families.items():
                if isinstance(key, tuple) and set(key) == set(family) and len(key) == len(family):
                    return label, dims
        known = ", ".join(family_label(k) for k in self._families)
        raise RecoveryError(f"no group family {asked!r} in this plan; families are {known}")

    def status(self, rank: int, family: Hashable) -> FamilyStatus | None:
        """``"kept"`` / ``"created"`` for ``rank``'s group of ``family`` in the new layout
        (kept: same ranks in the same order as before), ``"gone"`` if ``rank`` was in the
        family's old layout only, None if in neither. O(ndim + lost)."""
        rank = _rank(rank)
        label, dims = self._family(family)
        owner = self._owners[label]
        old = owner.old
        if rank in self._admitted:
            return "created" if owner.grown and self._admitted_in(rank, owner) else None
        if rank in self._inverse:  # a substitute: its old place decides
            source = self._inverse[rank]
            return None if source not in old else self._renamed_status(source, owner, dims)
        if rank not in old:
            return None
        if not owner.changed:
            return "kept"
        if self._gone(rank):
            return "gone"
        if self.kind == "substitute":
            return self._renamed_status(rank, owner, dims)
        return "created" if owner.dim in dims else "kept"

    def _renamed_status(self, rank: int, owner: Owner, dims: tuple[str, ...]) -> FamilyStatus:
        mine = owner.old.coords(rank)
        fixed = [d for d in owner.old.names if d not in dims]
        for x in self.replacements:
            if x in owner.old:
                theirs = owner.old.coords(x)
                if all(theirs[d] == mine[d] for d in fixed):
                    return "created"
        return "kept"

    def _admitted_in(self, rank: int, owner: Owner) -> bool:
        if owner.label == "main" or owner.label.startswith("view "):
            return True
        coords = self.new_coords(rank)
        if coords is None or self.dim is None:  # an invariant of this module, not a check of user input
            raise RuntimeError("meshgroups internal error: no coordinates or no dim")
        template = self.layout.rank_at(**{**coords, self.dim: 0})
        return template in owner.old

    def is_kept(self, rank: int, family: Hashable) -> bool:
        """``status(rank, family) == "kept"``: this rank's group of the family can be reused."""
        return self.status(rank, family) == "kept"

    def old_group(self, rank: int, family: Hashable) -> np.ndarray | None:
        """``rank``'s group of ``family`` before (mesh order), or None."""
        label, dims = self._family(family)
        old = self._owners[label].old
        rank = _rank(rank)
        return old.group_of(rank, *dims) if rank in old else None

    def new_group(self, rank: int, family: Hashable) -> np.ndarray | None:
        """``rank``'s group of ``family`` after (mesh order), or None. Builds the family's new
        owner layout (O(W) once when it is not affine)."""
        label, dims = self._family(family)
        new = self._changed[label].new
        rank = _rank(rank)
        return new.group_of(rank, *dims) if new is not None and rank in new else None

    def data_index(self, rank: int, *dims: str) -> tuple[int | None, int | None]:
        """``(old, new)`` index of ``rank`` along ``dims`` flattened in layout order (default:
        the plan's dim): which data shard it read before and reads now."""
        dims = dims or ((self.dim,) if self.dim is not None else ())
        if not dims:
            raise RecoveryError("data_index needs dims for a substitute plan, e.g. data_index(r, 'dp')")
        names = [d for d in self.layout.names if d in dims]
        if len(names) != len(dims):
            raise RecoveryError(f"data_index dims {dims} are not all dims of {self.layout!r}")
        shape = dict(zip(self.layout.names, self.new_shape()))

        def flat(coords: dict[str, int] | None, sizes: Mapping[str, int]) -> int | None:
            if coords is None:
                return None
            out = 0
            for d in names:
                out = out * sizes[d] + coords[d]
            return out

        old_sizes = dict(zip(self.layout.names, self.layout.shape))
        return flat(self.old_coords(rank), old_sizes), flat(self.new_coords(rank), shape)

    # ------------------------------------------------------------------ listings
    def change(self, family: Hashable) -> FamilyChange:
        """Every kept / created / gone group of ``family`` (vectorised, O(W))."""
        label, dims = self._family(family)
        key = next(k for k, v in self._families.items() if v == (label, dims))
        changed = self._changed[label]
        kept, created, gone = changed.listing(dims)
        return FamilyChange(
            key, family_label(key), label, dims, changed.owner.old, changed.new, kept, created, gone
        )

    def changes(self) -> dict[Hashable, FamilyChange]:
        """``{family key: FamilyChange}`` for every family."""
        return {key: self.change(key) for key in self._families}

    def summary(self, limit: int = 8) -> dict[str, Any]:
        """A JSON-ready description (what ``python -m meshgroups shrink --json`` prints); lists
        are cut to ``limit`` items (``limit=0``: everything), with their full counts."""

        def cut(items: Any) -> list[Any]:
            items = [x.tolist() if isinstance(x, np.ndarray) else x for x in items]
            return items if not limit else items[:limit]

        families = {}
        for ch in self.changes().values():
            families[ch.label] = {
                "owner": ch.owner,
                "dims": list(ch.dims),
                **{f"n_{k}": v for k, v in ch.counts().items()},
                **{k: cut(getattr(ch, k)) for k in ("kept", "created", "gone")},
            }
        return {
            "kind": self.kind,
            "dim": self.dim,
            "old_layout": self.layout.to_dict(),
            "new_layout": self.new_layout.to_dict(),
            "old_shape": dict(zip(self.layout.names, self.layout.shape)),
            "new_shape": dict(zip(self.layout.names, self.new_shape())),
            "lost": list(self.lost),
            "drained": list(self.drained),
            "spares": list(self.spares),
            "admitted": list(self.admitted),
            "replacements": {str(k): v for k, v in sorted(self.replacements.items())},
            "index_map": list(self.index_map),
            "families": families,
        }

    def __repr__(self) -> str:
        return (
            f"RecoveryPlan({self.kind}, {self.layout!r} -> {dict(zip(self.layout.names, self.new_shape()))}, "
            f"lost={list(self.lost)}, spares={len(self.spares)}, admitted={len(self.admitted)})"
        )


def family_label(key: Hashable) -> str:
    """A family key as torch names it: ``("dp", "cp")`` → ``"dp_cp"``, a subset's name as is::

    >>> family_label(("dp", "cp")), family_label("embd")
    ('dp_cp', 'embd')
    """
    return key if isinstance(key, str) else "_".join(key)  # type: ignore[arg-type]


def _rank(rank: object) -> int:
    if not is_int(rank):
        raise TypeError(f"a rank is an int, got {rank!r}")
    return int(rank)  # type: ignore[call-overload]
