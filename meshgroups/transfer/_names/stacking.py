"""Stacking along a new leading axis: MoE experts, and where each ep rank holds which expert.

A :class:`Stack` is a rule whose rollout weight has a new axis 0: entry ``p`` of the stack is
itself a :class:`~meshgroups.transfer.Rule` over the remaining axes. vLLM's and SGLang's
``experts.w13_weight`` ``[E, 2·I, H]`` is, per expert, ``gate_proj`` ‖ ``up_proj`` (a rule of two
parts along axis 0 of ``[2·I, H]``, sharded per part under tp), and ``experts.w2_weight``
``[E, H, I]`` is ``down_proj``. Every entry has the same parts (sizes checked against the
trainer's shapes when the plan is made), so the rollout's parts are ``[E, I, H]`` each and a rank's
buffer is ``[E_local, I/tp ‖ I/tp, H]``::

    >>> s = Stack.of({"stack": [["e0.gate", "e0.up"], ["e1.gate", "e1.up"]]})
    >>> s.sources, s.axis, s.sharding
    (('e0.gate', 'e0.up', 'e1.gate', 'e1.up'), 1, 'per_part')

A segment may read one expert of a packed trainer tensor (``index``: Transformers 5's
``mlp.experts.gate_up_proj`` ``[E, 2·I, H]``, or Megatron's grouped ``linear_fc1.weight<i>`` as a
``[ep, 2·I, H]`` weight sharded over ep) and may be transposed (``transpose``).

**Expert placement.** The rollout's stacked tensor is described as a global ``[E, ...]`` weight
sharded ``Shard(0)`` over its ``ep`` dim, so rank ``r`` holds positions ``[r·E/ep, (r+1)·E/ep)``.
Which expert sits at position ``p`` is the stack's order: :func:`expert_order` gives it for vLLM's
linear placement (expert ``p``) and round-robin placement (rank ``r`` holds experts ``r, r+ep,
r+2·ep, ...``)::

    >>> expert_order(8, 2, "round_robin")
    [0, 2, 4, 6, 1, 3, 5, 7]
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from meshgroups._checks import is_int
from meshgroups.errors import LayoutError
from meshgroups.transfer._names.rules import Rule, Segment

#: Expert placements :func:`expert_order` knows.
PLACEMENTS = ("linear", "round_robin")


@dataclass(frozen=True)
class Stack:
    """A rollout weight = its entries stacked along a new axis 0 (MoE experts: vLLM's
    ``experts.w13_weight`` ``[E, 2·I, H]`` is, per expert, ``gate_proj`` ‖ ``up_proj``).

    Args:
        entries: one :class:`~meshgroups.transfer.Rule` per position along axis 0, over
            the remaining axes; all with the same axis, sharding and number of parts.

    Raises:
        LayoutError: no entries, a nested stack, entries whose axis, sharding or number of
            parts differ (naming the first that differs).

    >>> Stack((Rule.rename("a"), Rule.rename("b"))).to_json()
    {'stack': ['a', 'b']}
    """

    entries: tuple[Rule, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.entries, tuple) or not self.entries:
            raise LayoutError(f"a stack needs at least one entry, got {self.entries!r}")
        first = self.entries[0]
        for p, e in enumerate(self.entries):
            if not isinstance(e, Rule):
                raise LayoutError(f"stack entry {p} must be a Rule (stacks do not nest), got {e!r}")
            if (e.axis, e.sharding, len(e.parts)) != (first.axis, first.sharding, len(first.parts)):
                raise LayoutError(
                    f"stack entry {p}: axis {e.axis}, sharding {e.sharding!r}, {len(e.parts)} parts; entry 0 "
                    f"has axis {first.axis}, sharding {first.sharding!r}, {len(first.parts)} parts — every "
                    "entry of a stack must be cut alike"
                )

    @property
    def axis(self) -> int:
        """The axis of the rollout weight the entries' parts are concatenated along."""
        return self.entries[0].axis + 1

    @property
    def sharding(self) -> str:
        return self.entries[0].sharding

    @property
    def is_rename(self) -> bool:
        return False

    @property
    def segments(self) -> tuple[Segment, ...]:
        """Every segment of every entry, in order."""
        return tuple(s for e in self.entries for s in e.segments)

    @property
    def sources(self) -> tuple[str, ...]:
        """The trainer weights used, in first-use order."""
        return tuple(dict.fromkeys(s.source for s in self.segments))

    def to_json(self) -> dict[str, object]:
        return {"stack": [e.to_json() for e in self.entries]}

    @classmethod
    def of(cls, spec: object) -> Stack:
        """From ``{"stack": [rule, ...]}`` (each entry any JSON form of a
        :class:`~meshgroups.transfer.Rule`), or a Stack."""
        if isinstance(spec, Stack):
            return spec
        if not isinstance(spec, Mapping) or set(spec) != {"stack"} or not isinstance(spec["stack"], list):
            raise LayoutError(f"a stack is {{'stack': [rule, ...]}}, got {spec!r}")
        return cls(tuple(Rule.of(e) for e in spec["stack"]))


def expert_order(num_experts: int, ep: int, placement: str = "linear") -> list[int]:
    """The expert at each position of a rollout's stacked expert tensor sharded ``Shard(0)``
    over ``ep`` ranks.

    Args:
        num_experts: experts in all (``E``).
        ep: the rollout's expert-parallel size; rank ``r`` holds positions
            ``[r·E/ep, (r+1)·E/ep)``.
        placement: ``"linear"`` (rank ``r`` holds experts ``r·E/ep ...``, vLLM's default) or
            ``"round_robin"`` (rank ``r`` holds experts ``r, r+ep, ...``).

    Returns:
        ``order[p]``: the expert at position ``p``.

    Raises:
        LayoutError: an unknown placement, ``ep`` not dividing ``num_experts`` (each rank holds
            ``E/ep`` experts in both placements), sizes below 1.

    >>> expert_order(4, 2), expert_order(4, 2, "round_robin")
    ([0, 1, 2, 3], [0, 2, 1, 3])
    """
    if not is_int(num_experts) or not is_int(ep) or num_experts < 1 or ep < 1:
        raise LayoutError(f"num_experts={num_experts!r} and ep={ep!r} must be ints >= 1")
    if placement not in PLACEMENTS:
        raise LayoutError(f"expert placement {placement!r} is not one of {PLACEMENTS}")
    if num_experts % ep:
        raise LayoutError(
            f"expert placement: ep={ep} does not divide num_experts={num_experts}; each rank holds E/ep experts"
        )
    local = num_experts // ep
    if placement == "linear":
        return list(range(num_experts))
    return [j * ep + r for r in range(ep) for j in range(local)]


def stack_experts(entry: Callable[[int], object], order: Sequence[int]) -> Stack:
    """A :class:`Stack` whose position ``p`` is ``entry(order[p])`` (any JSON form of a rule).

    Args:
        entry: the rule of one expert, from its index.
        order: the expert at each position (:func:`expert_order`).

    Returns:
        The stack.

    >>> stack_experts(lambda e: [f"{e}.gate", f"{e}.up"], [1, 0]).sources
    ('1.gate', '1.up', '0.gate', '0.up')
    """
    return Stack(tuple(Rule.of(entry(e)) for e in order))


__all__ = ["PLACEMENTS", "Stack", "expert_order", "stack_experts"]
