"""Recovery plans for elastic meshes: after ranks are lost, which layout the survivors build and
what happens to every group (numpy only, no torch, no communication).

Three moves, each a pure function of the layout and the ranks named, so every survivor computes
the same plan on its own (each function's docstring shows one):

- :func:`plan_shrink` drops every replica (index of the replicate dim) holding a lost rank; the
  survivors keep their coordinates except along that dim (renumbered densely, old order kept);
  every group of the other dims is kept whole; alive ranks of dropped replicas become spares.
- :func:`plan_substitute` puts spares in the lost ranks' places (whole nodes with a topology).
- :func:`plan_grow` appends new replicas along the dim (the reverse of a shrink).

Per-rank questions (:meth:`RecoveryPlan.status`, ``new_coords``, ``role``, ...) cost
O(ndim + lost); the new layout and whole-family listings (:meth:`RecoveryPlan.change`) are
vectorised numpy over the world.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence

import numpy as np

from meshgroups._checks import formula, is_int, product, short_repr
from meshgroups.elastic._owners import Owner, grow_owner, rename_owner, shrink_owner
from meshgroups.elastic._recovery_plan import FamilyChange, RecoveryPlan, family_label
from meshgroups.errors import RecoveryError
from meshgroups.layout import WORLD, Layout, Topology

__all__ = [
    "REPLICATE_DIMS",
    "FamilyChange",
    "RecoveryError",
    "RecoveryPlan",
    "family_label",
    "plan_grow",
    "plan_shrink",
    "plan_substitute",
    "replicate_dim",
]

#: Names of replicate (pure data-parallel) dims, the default of ``dim=``: the outermost dim of
#: the main layout with one of these names is shrunk or grown. ``dp_shard``/``fsdp`` are not
#: among them: a shard replica cannot be dropped without losing the state it holds.
REPLICATE_DIMS = ("dp_replicate", "replicate", "dp", "ddp", "data")

Families = dict[Hashable, tuple[str, tuple[str, ...]]]


def replicate_dim(layout: Layout, dim: str | None = None) -> str:
    """The dim a shrink or grow acts on: ``dim`` if given (checked), else the outermost dim of
    ``layout`` named one of :data:`REPLICATE_DIMS`::

        >>> replicate_dim(Layout(pp=2, dp_replicate=2, dp_shard=2, tp=2))
        'dp_replicate'

    Raises:
        RecoveryError: ``dim`` is not a dim of the layout, or no dim has a replicate name.
    """
    _check_layout(layout)
    if dim is not None:
        if not isinstance(dim, str) or dim not in layout.names:
            raise RecoveryError(
                f"dim {short_repr(dim)} is not a dim of {layout!r}; dims are {', '.join(layout.names)}"
            )
        return dim
    for name in layout.names:
        if name in REPLICATE_DIMS:
            return name
    raise RecoveryError(
        f"{layout!r} has no replicate dim (named one of {', '.join(REPLICATE_DIMS)}); "
        "name the dim whose replicas may be dropped with dim="
    )


def plan_shrink(
    layout: Layout,
    lost: Iterable[int],
    *,
    dim: str | None = None,
    topology: Topology | None = None,
    flatten: Iterable[Sequence[str]] = (),
    subsets: Mapping[str, tuple[Layout, str | Sequence[str]]] | None = None,
) -> RecoveryPlan:
    """Drop every replica (index of ``dim``) that holds a lost rank.

    Args:
        layout: the current layout (its views are followed too).
        lost: the lost global ranks.
        dim: the replicate dim; default :func:`replicate_dim`.
        topology: if given, a lost rank takes its whole node (smallest level) with it: the
            node's other ranks are ``drained``, not spares.
        flatten, subsets: ``init_mesh``'s arguments, so the plan covers the same families.

    Returns:
        A :class:`RecoveryPlan`; ``plan.new_layout`` is ``layout.select(dim, kept)``.

    Raises:
        RecoveryError: no lost rank, a repeated one, one not in the layout, an unknown dim,
            every replica hit, a view or subset that cannot follow.

    >>> from meshgroups import Layout
    >>> from meshgroups.elastic import plan_shrink
    >>> plan = plan_shrink(Layout(pp=2, dp=4, tp=2), [5])  # rank 5 is in replica dp=2
    >>> plan.new_layout.shape, plan.index_map, plan.spares
    ((2, 3, 2), (0, 1, 3), (4, 12, 13))
    >>> plan.status(0, "tp"), plan.status(0, "dp"), plan.status(4, "tp")
    ('kept', 'created', 'gone')
    """
    dim = replicate_dim(layout, dim)
    lost_t = _ranks(lost, "lost", layout, must_be_in=True)
    lost_nodes, out = _widen(layout, lost_t, topology)
    dropped = tuple(sorted({layout.coords(r)[dim] for r in out}))
    n = layout.size(dim)
    if len(dropped) == n:
        raise RecoveryError(
            f"the lost ranks hit every replica of {dim} ({dim}={n}: indices {_few(dropped)} each hold a lost "
            f"rank{' or share its node' if topology else ''}); a shrink keeps at least one whole replica — "
            "substitute spares (plan_substitute) or restart from a checkpoint"
        )
    families, layouts = _families(layout, flatten, subsets)
    removed: np.ndarray | None = None
    owners: dict[str, Owner] = {}
    for label, owner_layout in layouts.items():
        if label == "main" or (label.startswith("view ") and dim in owner_layout.names):
            owners[label] = Owner(label, owner_layout, dim=dim, indices=dropped)  # same index by name
            continue
        if removed is None:
            removed = np.sort(layout.without_views().select(dim, list(dropped)).grid, axis=None)
        owners[label] = shrink_owner(label, owner_layout, dim, removed)
    return RecoveryPlan(
        "shrink",
        layout,
        dim=dim,
        lost=lost_t,
        topology=topology,
        families=families,
        owners=owners,
        lost_nodes=lost_nodes,
    )


def plan_substitute(
    layout: Layout,
    lost: Iterable[int],
    spares: Iterable[int],
    *,
    topology: Topology | None = None,
    flatten: Iterable[Sequence[str]] = (),
    subsets: Mapping[str, tuple[Layout, str | Sequence[str]]] | None = None,
) -> RecoveryPlan:
    """Put spares in the lost ranks' places; the layout keeps its shape.

    Without a topology the lost ranks, sorted, are replaced one for one by ``spares`` in the
    order given. With one, every node holding a lost rank is replaced by a whole spare node
    (the first complete spare nodes, in the order given), rank ``r`` by ``base + r % node``,
    so groups inside a node stay inside a node.

    Raises:
        RecoveryError: no lost rank, a repeated rank, a lost rank not in the layout, a spare in
            the layout or lost, a spare node that is not complete, too few spares.

    >>> from meshgroups import Layout
    >>> from meshgroups.elastic import plan_substitute
    >>> plan = plan_substitute(Layout(dp=2, tp=2), lost=[1], spares=[4, 5])
    >>> plan.replacements, plan.new_layout
    ({1: 4}, Layout(dp=2, tp=2, grid=[0, 4, 2, 3]))
    >>> plan.role(4), plan.role(5), plan.status(0, "tp"), plan.status(2, "tp")
    ('admitted', 'spare', 'created', 'kept')
    """
    _check_layout(layout)
    lost_t = _ranks(lost, "lost", layout, must_be_in=True)
    spares_t = _ranks(spares, "spares", layout, must_be_in=False, allow_empty=True)
    for r in spares_t:
        if r in set(lost_t):
            raise RecoveryError(f"spare {r} is also lost; a spare must be alive")
    lost_nodes, out = _widen(layout, lost_t, topology)
    if topology is None:
        if len(spares_t) < len(lost_t):
            raise RecoveryError(
                f"{len(lost_t)} lost ranks need {len(lost_t)} spares, got {len(spares_t)} ({_few(spares_t)})"
            )
        replacements = dict(zip(lost_t, spares_t))
        unused = spares_t[len(lost_t) :]
    else:
        replacements, unused = _node_swap(topology, sorted(lost_nodes), out, spares_t)
    families, layouts = _families(layout, flatten, subsets)
    owners = {label: rename_owner(label, lay, replacements) for label, lay in layouts.items()}
    return RecoveryPlan(
        "substitute",
        layout,
        dim=None,
        lost=lost_t,
        topology=topology,
        families=families,
        owners=owners,
        lost_nodes=lost_nodes,
        replacements=replacements,
        unused=unused,
    )


def plan_grow(
    layout: Layout,
    ranks: Iterable[int],
    *,
    dim: str | None = None,
    topology: Topology | None = None,
    flatten: Iterable[Sequence[str]] = (),
    subsets: Mapping[str, tuple[Layout, str | Sequence[str]]] | None = None,
) -> RecoveryPlan:
    """Append new replicas along ``dim``: the reverse of a shrink.

    ``ranks`` fill whole replicas, one after the other, each in row-major order of the other
    dims (so the sorted ranks of a replica a shrink dropped re-admit it as it was). Views with
    the dim grow with it; subsets that span every replica grow, others stay as they are.

    Raises:
        RecoveryError: no rank, a repeated one, one already in the layout, a count that is not
            a multiple of the replica size, an unknown dim, a view without the dim, or (with a
            topology) a family that would leave the level it was inside.

    >>> from meshgroups import Layout
    >>> from meshgroups.elastic import plan_grow
    >>> plan = plan_grow(Layout(dp=2, tp=2), ranks=[4, 5])  # one more dp replica
    >>> plan.new_layout, plan.index_map, plan.admitted
    (Layout(dp=3, tp=2), (0, 1, None), (4, 5))
    >>> plan.status(0, "tp"), plan.status(0, "dp")
    ('kept', 'created')
    """
    dim = replicate_dim(layout, dim)
    ranks_t = _ranks(ranks, "ranks", layout, must_be_in=False)
    axis = layout.names.index(dim)
    slab_shape = layout.shape[:axis] + layout.shape[axis + 1 :]
    slab = product(slab_shape)
    if len(ranks_t) % slab:
        others = [n for n in layout.names if n != dim]
        raise RecoveryError(
            f"{len(ranks_t)} ranks do not fill whole replicas of {dim}: a replica has "
            f"{formula(others, slab_shape) if others else 1} ranks"
        )
    slabs = np.array(ranks_t, dtype=np.int64).reshape((len(ranks_t) // slab, *slab_shape))
    families, layouts = _families(layout, flatten, subsets)
    main = layouts["main"]
    owners = {label: grow_owner(label, lay, main, dim, slabs) for label, lay in layouts.items()}
    if topology is not None:
        _check_spans(families, owners, topology)
    return RecoveryPlan(
        "grow", layout, dim=dim, lost=(), topology=topology, families=families, owners=owners, slabs=slabs
    )


# ---------------------------------------------------------------------------------- helpers
def _check_layout(layout: object) -> None:
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be a meshgroups.Layout, got {type(layout).__name__}")


def _few(values: Sequence[int], limit: int = 8) -> str:
    shown = ", ".join(str(v) for v in values[:limit])
    return shown + (f", … ({len(values)} in all)" if len(values) > limit else "")


def _ranks(
    values: Iterable[int], what: str, layout: Layout, *, must_be_in: bool, allow_empty: bool = False
) -> tuple[int, ...]:
    """Distinct int ranks, checked against ``layout``; sorted for ``lost``, else as given."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise TypeError(f"{what} must be a list of ranks, got {short_repr(values)}")
    out: list[int] = []
    seen: set[int] = set()
    for r in values:
        if not is_int(r):
            raise TypeError(f"{what} must hold int ranks, got {short_repr(r)}")
        r = int(r)
        if r < 0:
            raise RecoveryError(f"{what} holds rank {r}; ranks are >= 0")
        if r in seen:
            raise RecoveryError(f"{what} names rank {r} twice; name each rank once")
        if must_be_in and r not in layout:
            raise RecoveryError(f"{what} rank {r} is not in the layout ({layout.describe_ranks()})")
        if not must_be_in and r in layout:
            raise RecoveryError(
                f"{what} rank {r} is already in the layout (at {layout.coords(r)}); "
                "only ranks outside it can join"
            )
        seen.add(r)
        out.append(r)
    if not out and not allow_empty:
        raise RecoveryError(f"{what} is empty; name at least one rank")
    return tuple(sorted(out)) if what == "lost" else tuple(out)


def _widen(
    layout: Layout, lost: tuple[int, ...], topology: Topology | None
) -> tuple[frozenset[int], list[int]]:
    """(lost nodes, every layout rank that leaves): with a topology, whole nodes."""
    if topology is None:
        return frozenset(), list(lost)
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be a meshgroups.Topology, got {type(topology).__name__}")
    node = topology.levels[0][1]
    nodes = frozenset(r // node for r in lost)
    out = [r for n in sorted(nodes) for r in range(n * node, (n + 1) * node) if r in layout]
    return nodes, out


def _node_swap(
    topology: Topology, lost_nodes: list[int], out: list[int], spares: tuple[int, ...]
) -> tuple[dict[int, int], tuple[int, ...]]:
    node = topology.levels[0][1]
    by_node: dict[int, list[int]] = {}
    for r in spares:
        by_node.setdefault(r // node, []).append(r)
    complete = []
    for n, members in by_node.items():
        if len(members) != node:
            missing = sorted(set(range(n * node, (n + 1) * node)) - set(members))
            raise RecoveryError(
                f"spare node {n} (ranks {n * node}..{(n + 1) * node - 1}) is incomplete: ranks {_few(missing)} "
                f"are missing; with a topology spares replace whole {topology.names[0]}s"
            )
        complete.append(n)
    if len(complete) < len(lost_nodes):
        raise RecoveryError(
            f"{len(lost_nodes)} lost {topology.names[0]}s ({_few(lost_nodes)}) need as many whole spare "
            f"{topology.names[0]}s, got {len(complete)}"
        )
    swap = dict(zip(lost_nodes, complete))
    replacements = {r: swap[r // node] * node + r % node for r in out}
    placed = set(replacements.values())  # a lost node partly outside the layout leaves some idle
    return replacements, tuple(r for r in spares if r not in placed)


def _families(
    layout: Layout,
    flatten: Iterable[Sequence[str]],
    subsets: Mapping[str, tuple[Layout, str | Sequence[str]]] | None,
) -> tuple[Families, dict[str, Layout]]:
    """The families ``init_mesh`` would build (keys as ``GroupSpec.key``) and their owners."""
    layouts: dict[str, Layout] = {"main": layout.without_views()}
    families: Families = {(d,): ("main", (d,)) for d in layout.names}
    for name, view in layout.views.items():
        layouts[f"view {name}"] = view
        families.update({(d,): (f"view {name}", (d,)) for d in view.names if d not in layout.names})
    if isinstance(flatten, (str, bytes)) or not isinstance(flatten, Iterable):
        raise TypeError(f"flatten takes a list of dim sets like [('dp', 'cp')], got {short_repr(flatten)}")
    for dims in flatten:
        if isinstance(dims, str) or not isinstance(dims, Iterable) or not dims:
            raise TypeError(f"flatten takes dim sets like ('dp', 'cp'), got {short_repr(dims)}")
        owner = layout.resolve(*dims)
        label = (
            "main" if owner is layout else next(f"view {k}" for k, v in layout.views.items() if v is owner)
        )
        key = tuple(d for d in owner.names if d in dims)
        families.setdefault(key, (label, key))
    all_dims = set(layout.names).union(*(v.names for v in layout.views.values()))
    for name, value in (subsets or {}).items():
        if not isinstance(name, str) or not name.isidentifier() or name in all_dims:
            raise RecoveryError(f"subset name {name!r} must be an identifier that is not a dim name")
        if not (isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], Layout)):
            raise TypeError(
                f"subset {name!r} must be (Layout, dims), e.g. (layout.select('pp', [0, -1]), 'pp')"
            )
        sub, sub_dims = value
        dims_t = (sub_dims,) if isinstance(sub_dims, str) else tuple(sub_dims)
        sub.resolve(*dims_t)
        layouts[f"subset {name}"] = sub.without_views()
        families[name] = (f"subset {name}", tuple(d for d in sub.names if d in dims_t))
    return families, layouts


def _check_spans(families: Families, owners: Mapping[str, Owner], topology: Topology) -> None:
    """With a topology, a grow must keep every family of the main layout and its views inside
    the level it was inside (tp inside a node)."""
    levels = (*topology.names, WORLD)
    for label, dims in families.values():
        owner = owners[label]
        if label.startswith("subset") or owner._new is None:
            continue
        before, after = owner.old.span(*dims, topology=topology), owner._new.span(*dims, topology=topology)
        if levels.index(after) > levels.index(before):
            bad = next(g for g in owner._new.groups(*dims) if topology.span(g) != before)
            raise RecoveryError(
                f"the new replicas put a {'_'.join(dims)} group across {before}s ({bad.tolist()[:16]}), but "
                f"every {'_'.join(dims)} group was inside one {before} (rule: with a topology, a family stays "
                "inside the level it was inside; list the new ranks a whole node at a time)"
            )
