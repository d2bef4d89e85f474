"""megatron-core 0.19's ``HyperCommGrid`` served by a ``meshgroups.Layout`` and a group cache.

Same constructor, methods, errors and internal names as ``megatron.core.hyper_comm_grid``
(``meshgroups.compat.megatron.install()`` makes that module this one): a grid of named dims
(``dim_names`` fastest first, as Megatron's order strings), ``register_view`` for other
factorisations of the same ranks (shared dims checked), ``create_pg`` / ``get_pg`` /
``get_rank_enum`` with ``view=``, ``destroy`` and ``is_current_rank_in_grid``::

    >>> import os; os.environ.setdefault("WORLD_SIZE", "8")
    '8'
    >>> grid = HyperCommGrid([2, 2, 2], ["tp", "cp", "dp"])
    >>> grid.get_rank_enum(["dp", "tp"])
    [[0, 1, 4, 5], [2, 3, 6, 7]]

The rank enumeration of every group is a row of ``Layout.groups``; a view is a
``Layout.with_views`` factorisation (whose shared-dim check is meshgroups'). Groups are created
with ``torch.distributed.new_subgroups_by_enumeration`` (megatron-core's call, with its
keywords), once per distinct rank partition: a second dim set, or a view's private dims, that
enumerates the same rank sets (with the same backend and options) gets the group already made
instead of a second communicator. ``destroy`` destroys each group once.
"""

from __future__ import annotations

import numbers
import os
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from meshgroups import GroupCache, Layout
from meshgroups.layout import product

__all__ = ["HyperCommGrid"]

_BASE = "base"


@dataclass
class _RankViewSpec:
    """One factorisation of the grid's ranks: its name, shape, dim names (fastest first) and
    the dims it shares with the base view."""

    name: str
    shape: list[int]
    dim_names: list[str]
    shared_dims: list[str]


def _member(pg: Any) -> bool:
    non_member = getattr(getattr(dist, "GroupMember", None), "NON_GROUP_MEMBER", None)
    return pg is not None and pg is not non_member


def _world_size() -> int:
    # the environment first, as megatron-core (its tests build grids without a process group)
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    if dist.is_initialized():
        return dist.get_world_size()
    raise RuntimeError(
        "Cannot determine world size: WORLD_SIZE environment variable not set and "
        "torch.distributed is not initialized. Please either set WORLD_SIZE or "
        "initialize torch.distributed before creating HyperCommGrid."
    )


class HyperCommGrid:
    """An n-D communication grid over ``rank_offset .. rank_offset + prod(shape) - 1``.

    Args:
        shape: the size of each dim.
        dim_names: the dims' names, fastest-varying first (megatron-core's ``order``).
        rank_offset: the first rank of the grid.
        backend: the backend of the groups (None: the default group's).

    Raises:
        ValueError: ``shape`` and ``dim_names`` differ in length; a negative offset.
        RuntimeError: the grid is larger than the world past ``rank_offset``.
    """

    def __init__(
        self, shape: list[int], dim_names: list[str], rank_offset: int = 0, backend: str | None = None
    ) -> None:
        if len(shape) != len(dim_names):
            raise ValueError(f"len(shape) {shape} != len(dim_names) {dim_names}")
        world_size = _world_size()
        self.rank_offset = rank_offset
        self.size = int(product(int(s) for s in shape))
        if rank_offset < 0:
            raise ValueError(f"rank_offset must be non-negative, got {rank_offset}")
        if self.size > world_size - rank_offset:
            raise RuntimeError(
                f"Grid shape {shape} is over sized with world size {world_size} and rank offset "
                f"{rank_offset}: {self.size} ranks from rank {rank_offset} need a world of "
                f"{self.size + rank_offset}"
            )
        self.shape = list(shape)
        self.dim_names = list(dim_names)
        self.backend = backend
        self._views: dict[str, _RankViewSpec] = {
            _BASE: _RankViewSpec(_BASE, list(shape), list(dim_names), [])
        }
        self._pgs: dict[Any, Any] = {}
        self._cache = GroupCache()  # groups by rank partition, so each is created once

    # ------------------------------------------------------------------ layouts
    def _layout(self, shape: list[int], dim_names: list[str]) -> Layout:
        """The grid as a meshgroups layout: the last name outermost, rows from ``rank_offset``."""
        return Layout(
            **{n: int(s) for n, s in zip(reversed(dim_names), reversed(shape))}, rank_offset=self.rank_offset
        )

    def _gen_rank_enum_for(self, shape: list[int], dim_names: list[str], dims: list[str]) -> list[list[int]]:
        """The groups varying ``dims`` of the grid ``shape`` / ``dim_names``: one row per group,
        the other dims enumerated outermost first, and within a row ``dims[0]`` outermost."""
        base = self._layout(shape, dim_names)
        rest = [n for n in base.names if n not in dims]
        sizes = dict(zip(base.names, base.shape))
        strides = {n: product(base.shape[i + 1 :]) for i, n in enumerate(base.names)}  # row-major
        names = [*rest, *dims]  # dims in the caller's order: the first varies slowest in a row
        permuted = Layout.from_strides(
            names, [sizes[n] for n in names], [strides[n] for n in names], self.rank_offset
        )
        return permuted.groups(*dims).tolist()

    def _gen_rank_enum(self, dims: list[str]) -> list[list[int]]:
        """The base view's groups varying ``dims`` (in the order given)."""
        return self._gen_rank_enum_for(self.shape, self.dim_names, dims)

    def _order_dims_for(self, dim_names: list[str], dims: str | list[str]) -> tuple[list[str], str]:
        """``dims`` ordered outermost first (the reverse of ``dim_names``) and their key."""
        if not isinstance(dims, list):
            ordered = [dims]
        else:
            outer_first = dim_names[::-1]
            ordered = sorted(dims, key=outer_first.index)
        return ordered, "-".join(ordered)

    def _resolve_view(self, view: str | None) -> _RankViewSpec:
        name = _BASE if view is None else view
        if name not in self._views:
            raise KeyError(f"View {name!r} is not registered. Registered views: {sorted(self._views)}")
        return self._views[name]

    def _order_dims_for_view(self, view: _RankViewSpec, dims: str | list[str]) -> tuple[list[str], str]:
        asked = dims if isinstance(dims, list) else [dims]
        missing = [d for d in asked if d not in view.dim_names]
        if missing:
            raise ValueError(f"{missing[0]!r} is not in view {view.name!r} with dim_names {view.dim_names}")
        return self._order_dims_for(view.dim_names, dims)

    def _canonical_pg_key_and_enum_view(
        self, view: _RankViewSpec, ordered_dims: list[str]
    ) -> tuple[Any, _RankViewSpec, list[str]]:
        """A group's key (base: ``"dp-cp"``; a view's own dims: ``(view, dims)``), and the view
        and dims it is enumerated in: dims all shared with the base are the base's group."""
        if view.name == _BASE:
            return "-".join(ordered_dims), view, ordered_dims
        if all(d in view.shared_dims for d in ordered_dims):
            base = self._views[_BASE]
            base_dims, key = self._order_dims_for_view(base, ordered_dims)
            return key, base, base_dims
        return (view.name, tuple(ordered_dims)), view, ordered_dims

    def _is_base_pg_key(self, key: Any) -> bool:
        return isinstance(key, str)

    # ------------------------------------------------------------------ views
    def register_view(
        self, name: str, shape: list[int], dim_names: list[str], shared_dims: list[str] | None = None
    ) -> None:
        """Register another factorisation of the grid's ranks; ``shared_dims`` must be dims of
        both that enumerate the same groups (checked by ``Layout.with_views``).

        Raises:
            ValueError: a repeated name, a bad shape, a size that differs from the grid's, a
                shared dim missing from either view or with other groups.
        """
        if name in self._views:
            raise ValueError(f"View {name!r} is already registered")
        if len(shape) != len(dim_names):
            raise ValueError(f"len(shape) {shape} != len(dim_names) {dim_names}")
        if len(set(dim_names)) != len(dim_names):
            raise ValueError(f"View {name!r} has duplicate dim_names: {dim_names}")
        if any(not isinstance(s, numbers.Integral) or isinstance(s, bool) or s <= 0 for s in shape):
            raise ValueError(f"View {name!r} shape must be positive ints, got {shape}")
        if product(int(s) for s in shape) != self.size:
            raise ValueError(
                f"View {name!r} shape {shape} has size {product(int(s) for s in shape)}, but the grid size is {self.size}"
            )
        shared = list(shared_dims or [])
        if len(set(shared)) != len(shared):
            raise ValueError(f"View {name!r} has duplicate shared_dims: {shared}")
        for dim in shared:
            if dim not in self.dim_names:
                raise ValueError(
                    f"Shared dim {dim!r} of view {name!r} is not in the base view {self.dim_names}"
                )
            if dim not in dim_names:
                raise ValueError(
                    f"Shared dim {dim!r} of view {name!r} is not in the view's dim_names {dim_names}"
                )
        for dims in [[d] for d in shared] + ([shared] if len(shared) > 1 else []):
            base_enum = self._gen_rank_enum_for(
                self.shape, self.dim_names, self._order_dims_for(self.dim_names, dims)[0]
            )
            view_enum = self._gen_rank_enum_for(shape, dim_names, self._order_dims_for(dim_names, dims)[0])
            if base_enum != view_enum:
                which = f"Shared dim {dims[0]!r} has" if len(dims) == 1 else f"Shared dims {dims!r} have"
                raise ValueError(
                    f"{which} different membership across views: base enumeration {base_enum} != "
                    f"view {name!r} enumeration {view_enum}"
                )
        self._views[name] = _RankViewSpec(name, [int(s) for s in shape], list(dim_names), shared)

    # ------------------------------------------------------------------ groups
    def create_pg(self, dims: str | list[str], *, view: str | None = None, **kwargs: Any) -> Any:
        """Create (collectively, on every rank) the groups varying ``dims`` and return this
        rank's. ``kwargs`` go to ``torch.distributed.new_subgroups_by_enumeration``
        (``timeout``, ``pg_options``, ``group_desc``).

        Raises:
            KeyError: that group was already created (megatron-core cannot tell whether the
                options match, so neither does compat), or an unknown view.
            ValueError: a dim the view does not have.
        """
        spec = self._resolve_view(view)
        ordered, _ = self._order_dims_for_view(spec, dims)
        key, enum_view, enum_dims = self._canonical_pg_key_and_enum_view(spec, ordered)
        if key in self._pgs:
            where = "" if self._is_base_pg_key(key) else f" for view {spec.name!r}"
            raise KeyError(
                f"Process group {dims}{where} has already been created. Because there is no way to check "
                "whether options to create process group matches the first, we error out instead of "
                "returning the process group that has already been created before."
            )
        rows = self._gen_rank_enum_for(enum_view.shape, enum_view.dim_names, enum_dims)
        options = {k: kwargs[k] for k in sorted(kwargs) if k != "group_desc"}
        cache_key = (tuple(r for row in rows for r in row), f"{self.backend}/{len(rows[0])}/{options!r}")
        found, pg = self._cache.get(cache_key)
        if not found:
            pg, _ = dist.new_subgroups_by_enumeration(rows, backend=self.backend, **kwargs)
            self._cache.put(cache_key, pg, created=True)
        self._pgs[key] = pg
        return pg

    def get_pg(self, dims: str | list[str], *, view: str | None = None) -> Any:
        """This rank's group varying ``dims`` (created by ``create_pg``).

        Raises:
            KeyError: not created yet, or an unknown view.
        """
        spec = self._resolve_view(view)
        ordered, _ = self._order_dims_for_view(spec, dims)
        key, _, _ = self._canonical_pg_key_and_enum_view(spec, ordered)
        if key not in self._pgs:
            if self._is_base_pg_key(key):
                raise KeyError(f"Process group for {key} hasn't been created. Call create_pg first.")
            raise KeyError(
                f"Process group {dims} for view {spec.name!r} hasn't been created. Call create_pg first."
            )
        return self._pgs[key]

    def get_rank_enum(self, dims: str | list[str], *, view: str | None = None) -> list[list[int]]:
        """The rank enumeration ``create_pg`` uses for ``dims`` (one list per group)."""
        spec = self._resolve_view(view)
        ordered, _ = self._order_dims_for_view(spec, dims)
        return self._gen_rank_enum_for(spec.shape, spec.dim_names, ordered)

    def destroy(self) -> None:
        """Destroy every group of the grid this rank is a member of, each once."""
        done: set[int] = set()
        for pg in self._pgs.values():
            if _member(pg) and id(pg) not in done:
                done.add(id(pg))
                dist.destroy_process_group(pg)
        self._pgs.clear()
        self._cache = GroupCache()

    def is_current_rank_in_grid(self) -> bool:
        """Whether this rank is one of the grid's ranks."""
        return bool(self.rank_offset <= dist.get_rank() < self.rank_offset + self.size)
