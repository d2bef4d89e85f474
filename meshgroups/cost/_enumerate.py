"""Every layout of a world that a model admits, with its memory and traffic.

:func:`enumerate_layouts` factors the world into role sizes (every ordered factorisation into
the roles asked for), keeps those the model admits (:func:`meshgroups.cost._rules.problems`:
heads and kv heads over tp, layers over the pipeline's chunks, experts over ep, the sequence over
cp), lays each out in the canonical order (``pp`` outermost, then ``dp_replicate``,
``dp_shard``, ``ep``, ``cp``, ``tp`` innermost: the fast dims on consecutive ranks) and gives
each its peak memory per rank, whether it fits a budget, and its traffic per topology level.
Each also carries its pipeline bubble (the share of a step a stage idles). They come ordered by
the bytes over the slowest level crossed (then the next level, then memory) — an order of bytes
on slow links, **not** a predicted step time; :func:`meshgroups.cost.sort_candidates` orders
them otherwise (``"bubble"``: the least idle first, then the bytes)::

    >>> from meshgroups.cost._model import preset
    >>> best = enumerate_layouts(preset("tiny"), 8, Topology(node=8))[0]
    >>> best.slowest_level, best.label()
    ('node', 'pp=4 tp=2')
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from meshgroups.cost._model import Model
from meshgroups.cost._peak import RankMemory, fit, peak_memory
from meshgroups.cost._roles import ROLES, Parallelism, bubble_fraction
from meshgroups.cost._rules import problems
from meshgroups.cost._traffic import Traffic, traffic
from meshgroups.errors import LayoutError
from meshgroups.layout import Layout, Topology

__all__ = ["CANONICAL", "Candidate", "default_roles", "enumerate_layouts", "factorizations"]

#: The order enumerated layouts put their dims in, outermost first.
CANONICAL = ROLES
#: Largest world enumerated (the factorisations grow quickly; each costs a traffic count).
MAX_WORLD = 1 << 16


@dataclass(frozen=True)
class Candidate:
    """One enumerated layout.

    Args:
        layout: the layout (every role asked for, size-1 dims included).
        memory: its peak per-rank memory (:func:`meshgroups.cost._memory.peak_memory`).
        traffic: its traffic (:func:`meshgroups.cost._traffic.traffic`).
        budget: the per-rank budget in bytes it was checked against (``None``: none).
        allocator_overhead: the factor the peak (allocated bytes) is multiplied by before the
            comparison (:func:`meshgroups.cost._peak.fit`; 1.0: allocated as it is).
        bubble: the share of a step a pipeline stage idles
            (:func:`meshgroups.cost.bubble_fraction`; 0.0 without pipeline stages).

    >>> c = enumerate_layouts(preset("tiny"), 2)[0]
    >>> c.fits, c.sizes["dp_shard"] * c.sizes["tp"] * c.sizes["pp"]
    (True, 2)
    """

    layout: Layout
    memory: RankMemory
    traffic: Traffic
    budget: float | None = None
    allocator_overhead: float = 1.0
    bubble: float = 0.0

    @property
    def sizes(self) -> dict[str, int]:
        """``{role: size}`` (the layout's dims are named after their roles)."""
        return {d: self.layout.size(d) for d in self.layout.names}

    @property
    def fits(self) -> bool:
        """Whether the peak memory (× the allocator overhead) is within the budget (``True``
        without one)."""
        return self.budget is None or fit(self.memory, self.budget, self.allocator_overhead).fits

    @property
    def slowest_level(self) -> str | None:
        """The largest topology level its links use (``None``: no traffic)."""
        return self.traffic.slowest_level

    @property
    def slow_bytes(self) -> float:
        """Bytes on the slowest level crossed (0.0 without traffic)."""
        level = self.slowest_level
        return 0.0 if level is None else self.traffic.by_level[level]

    def label(self) -> str:
        """The sizes above 1, e.g. ``"pp=2 dp_shard=4 tp=8"`` (``"(1 rank)"`` for a world of 1).

        Returns:
            the label.
        """
        return " ".join(f"{d}={s}" for d, s in self.sizes.items() if s > 1) or "(1 rank)"

    def to_dict(self) -> dict[str, object]:
        """Sizes, memory, fit and traffic as a dict (for JSON).

        Returns:
            the dict.
        """
        return {
            "sizes": self.sizes,
            "memory": self.memory.to_dict(),
            "fits": self.fits,
            "fit_basis": fit(self.memory, 0.0, self.allocator_overhead).basis,
            "bubble_fraction": self.bubble,
            "slowest_level": self.slowest_level,
            "slow_bytes": self.slow_bytes,
            "by_level": self.traffic.by_level,
        }


def factorizations(world: int, n: int) -> Iterator[tuple[int, ...]]:
    """Every ordered ``n``-tuple of positive ints whose product is ``world``.

    Args:
        world: the product. n: the tuple length.

    Returns:
        an iterator of the tuples, in lexicographic order.

    >>> list(factorizations(4, 2))
    [(1, 4), (2, 2), (4, 1)]
    """
    if n == 1:
        yield (world,)
        return
    for d in range(1, world + 1):
        if world % d == 0:
            for rest in factorizations(world // d, n - 1):
                yield (d, *rest)


def default_roles(model: Model) -> tuple[str, ...]:
    """The roles enumerated by default: all but ``ep`` for a dense model, all for an MoE one.

    Args:
        model: the model.

    Returns:
        the roles, in canonical order.

    >>> default_roles(preset("tiny"))
    ('pp', 'dp_replicate', 'dp_shard', 'cp', 'tp')
    """
    return tuple(r for r in CANONICAL if r != "ep" or model.is_moe)


def enumerate_layouts(
    model: Model,
    world: int,
    topology: Topology | None = None,
    plan: Parallelism | None = None,
    *,
    roles: Sequence[str] | None = None,
    budget: float | None = None,
    allocator_overhead: float = 1.0,
) -> list[Candidate]:
    """Every layout of ``world`` ranks over ``roles`` that ``model`` admits (see the module
    docstring), ordered by :meth:`meshgroups.cost._traffic.Traffic.order_key`, then memory.

    Args:
        model: the model. world: ranks. topology: the machine (``None``: one level).
        plan: schedule and dtypes (its ``roles`` mapping must be empty: the layouts' dims are
            named after their roles). roles: the roles to factor the world into (default
            :func:`default_roles`). budget: bytes per rank; each candidate says whether it fits.
        allocator_overhead: reserved/allocated assumed by the fit (:func:`meshgroups.cost.fit`).

    Returns:
        the candidates.

    Raises:
        LayoutError: a world below 1 or above :data:`MAX_WORLD`, an unknown or repeated role,
            a negative budget, an allocator overhead below 1, or a plan that maps dims.

    >>> [c.label() for c in enumerate_layouts(preset("tiny"), 2, roles=("dp_shard", "tp"))]
    ['tp=2', 'dp_shard=2']
    """
    if isinstance(world, bool) or not isinstance(world, int):
        raise TypeError(f"world must be an int, got {world!r}")
    if not 1 <= world <= MAX_WORLD:
        raise LayoutError(f"world={world} must be in 1..{MAX_WORLD}")
    plan = plan or Parallelism()
    if plan.roles:
        raise LayoutError("enumerate_layouts names dims after their roles; give a plan without roles")
    chosen = tuple(roles) if roles is not None else default_roles(model)
    for r in chosen:
        if r not in CANONICAL:
            raise LayoutError(f"unknown role {r!r}; roles are {', '.join(CANONICAL)}")
    if len(set(chosen)) < len(chosen) or not chosen:
        raise LayoutError(f"roles must be distinct and not empty, got {list(chosen)}")
    if budget is not None and not budget >= 0:
        raise LayoutError(f"budget={budget!r} must be a number of bytes >= 0")
    fit(0.0, 0.0, allocator_overhead)  # checks the overhead
    ordered = [r for r in CANONICAL if r in chosen]
    out = []
    for sizes in factorizations(world, len(ordered)):
        named = dict(zip(ordered, sizes))
        if problems(model, named, plan.virtual_stages, plan.layers_per_stage):
            continue
        layout = Layout(**named)
        mem, moved = peak_memory(model, layout, plan), traffic(model, layout, topology, plan)
        idle = bubble_fraction(named.get("pp", 1), plan.micro_batches, plan.virtual_stages)
        out.append(Candidate(layout, mem, moved, budget, allocator_overhead, idle))
    out.sort(key=lambda c: (c.traffic.order_key(), c.memory.total))
    return out
