"""What a vLLM worker holds, as data: each parameter's local shard -> global ``Weight``s and a name map.

vLLM's tensor-parallel layers shard each parameter on their own: a column-parallel layer
(``ColumnParallelLinear``, ``VocabParallelEmbedding``, ``ParallelLMHead``) along its
``output_dim``, a row-parallel one along its ``input_dim``; a fused layer
(``QKVParallelLinear``, ``MergedColumnParallelLinear``) holds its shard of each part, one
after another (``sharding="per_part"``), where a part's size over the whole tp group is its
``output_sizes`` entry. When there are fewer kv heads than tp ranks, vLLM gives each rank one kv
head, shared by ``tp / kv_heads`` ranks: the k and v parts are then *virtually* ``tp`` heads
long, each real head repeated, which a name-map part made of repeated segments says exactly.

This module is vLLM-free (``read.py`` fills a :class:`Param` per parameter from the live
model); from the ``Param`` s of one worker it builds, the same on every worker:

    >>> p = Param("qkv_proj.weight", (12, 8), "float32", axis=0,
    ...           parts=(("q_proj.weight", 16, 16), ("k_proj.weight", 4, 4), ("v_proj.weight", 4, 4)))
    >>> w, rule = destination(p, tp=2)
    >>> w.shape, w.placements["tp"], rule.sources
    ((24, 8), Shard(axis=0), ('q_proj.weight', 'k_proj.weight', 'v_proj.weight'))
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from meshgroups.errors import LayoutError
from meshgroups.transfer import NameMap, Rule, Segment, Shard, Stack, Weight


@dataclass(frozen=True)
class Param:
    """One parameter of one vLLM worker, as the checkpoint loads it (before vLLM's post-load
    processing, which may repack it).

    Args:
        name: vLLM's parameter name (``model.layers.0.self_attn.qkv_proj.weight``).
        local_shape: this worker's shard's shape.
        dtype: its dtype name (``"float32"``, ``"bfloat16"``).
        axis: the axis it is sharded along over the tp group (``None``: every rank holds it whole).
        parts: a fused parameter's parts along ``axis``: ``(trainer name, size over the tp group
            (vLLM's ``output_sizes`` entry), the trainer weight's real size)``; the two sizes
            differ for replicated kv heads. ``None``: not fused (its trainer name is ``source``).
        source: the trainer weight a plain parameter reads (default: its own name).
        experts: a stacked MoE parameter (``experts.w13_weight`` ``[E_local, 2·I/tp, H]``,
            ``experts.w2_weight`` ``[E_local, H, I/tp]``): the global expert at each of this
            worker's slots along axis 0, read from vLLM's layer (its expert map). Sharded over
            experts (expert parallel): ``axis=0`` and each worker holds its own experts; sharded
            over tp: ``axis`` 1 or 2 and every worker holds all experts. Its rule comes from a
            family map (:func:`engine_destinations`).

    A fused qkv projection with 4 q heads and 1 kv head (of 4 rows each) on worker 0 of a tp=2
    engine: each worker holds 2 q heads and the one kv head, repeated::

        >>> from meshgroups.engines.vllm import Param, destinations
        >>> qkv = Param("qkv_proj.weight", (12, 8), "float32", axis=0,
        ...             parts=(("q_proj.weight", 16, 16), ("k_proj.weight", 4, 4), ("v_proj.weight", 4, 4)))
        >>> (weight,), name_map = destinations([qkv], tp=2)
        >>> weight.shape, weight.placements["tp"], name_map.rule("qkv_proj.weight").sources
        ((24, 8), Shard(axis=0), ('q_proj.weight', 'k_proj.weight', 'v_proj.weight'))
    """

    name: str
    local_shape: tuple[int, ...]
    dtype: str
    axis: int | None = None
    parts: tuple[tuple[str, int, int], ...] | None = None
    source: str | None = None
    experts: tuple[int, ...] | None = None


def _replicated_segments(source: str, virtual: int, real: int, tp: int) -> tuple[Segment, ...]:
    """A part ``virtual`` rows long over the tp group, made of ``real`` rows of ``source``:
    tp rank ``r`` holds rows ``[r * L, (r + 1) * L)`` of the virtual part (``L = virtual / tp``),
    which are the real rows of head block ``r // (virtual / real)`` (vLLM's kv-head replicas)."""
    local = virtual // tp
    replicas = virtual // real
    return tuple(Segment(source, (r // replicas) * local, (r // replicas) * local + local) for r in range(tp))


def destination(param: Param, tp: int) -> tuple[Weight, Rule]:
    """The global ``Weight`` (placements over a layout dim ``tp``) and the name-map rule of one
    worker parameter.

    Args:
        param: the parameter.
        tp: the engine's tensor-parallel size.

    Returns:
        ``(weight, rule)``.

    Raises:
        LayoutError: a fused part whose size over the group is not a multiple of the trainer
            weight's (naming the parameter and the part), or parts that do not add up to the
            local shard.

    >>> w, rule = destination(Param("o_proj.weight", (8, 4), "float32", axis=1), tp=2)
    >>> w.shape, rule.sources
    ((8, 8), ('o_proj.weight',))
    """
    shape = list(param.local_shape)
    placements = {}
    if param.axis is not None and tp > 1:
        shape[param.axis] *= tp
        placements["tp"] = Shard(param.axis)
    weight = Weight(param.name, tuple(shape), param.dtype, placements)
    if param.parts is None:
        return weight, Rule.rename(param.source or param.name)
    axis = param.axis if param.axis is not None else 0
    total = sum(virtual for _, virtual, _ in param.parts)
    if total != weight.shape[axis]:
        raise LayoutError(
            f"vLLM parameter {param.name!r}: its parts' sizes {[v for _, v, _ in param.parts]} add up to "
            f"{total}, but it holds {weight.shape[axis]} along axis {axis} over tp={tp}"
        )
    parts: list[tuple[Segment, ...]] = []
    for source, virtual, real in param.parts:
        if virtual == real:
            parts.append((Segment(source),))
        elif virtual % real or virtual % tp or real % (virtual // tp):
            raise LayoutError(
                f"vLLM parameter {param.name!r}: part {source!r} is {virtual} long over tp={tp} but the trainer "
                f"weight is {real}: replicas must repeat whole shards (the rule: {real} divides {virtual})"
            )
        else:
            parts.append(_replicated_segments(source, virtual, real, tp))
    return weight, Rule(tuple(parts), axis, "per_part")


def destinations(params: Iterable[Param], tp: int) -> tuple[list[Weight], NameMap]:
    """Every parameter's ``Weight`` and the name map of all of them (``rollout_weights`` and
    ``name_map`` for ``WeightSync``).

    Args:
        params: a worker's parameters.
        tp: the engine's tensor-parallel size.

    Returns:
        ``(weights, name_map)``.

    >>> ws, m = destinations([Param("norm.weight", (8,), "float32")], tp=2)
    >>> dict(ws[0].placements), m.rule("norm.weight").sources
    ({}, ('norm.weight',))
    """
    weights: list[Weight] = []
    rules: dict[str, Rule] = {}
    for param in params:
        w, rule = destination(param, tp)
        weights.append(w)
        if not (rule.is_rename and rule.sources == (param.name,)):
            rules[param.name] = rule
    return weights, NameMap(rules)


def fused_parts(name: str, packed: dict[str, Sequence[str]]) -> tuple[str, list[str]] | None:
    """The trainer names a fused vLLM parameter is made of, from the model's
    ``packed_modules_mapping`` (``{"qkv_proj": ["q_proj", "k_proj", "v_proj"], ...}``).

    Args:
        name: a vLLM parameter name.
        packed: the model's ``packed_modules_mapping``.

    Returns:
        ``(fused module name, [trainer parameter names])`` or ``None`` when not fused.

    >>> fused_parts("model.layers.0.mlp.gate_up_proj.weight", {"gate_up_proj": ["gate_proj", "up_proj"]})
    ('gate_up_proj', ['model.layers.0.mlp.gate_proj.weight', 'model.layers.0.mlp.up_proj.weight'])
    """
    prefix, _, leaf = name.rpartition(".")
    owner, _, module = prefix.rpartition(".")
    if module not in packed:
        return None
    base = f"{owner}." if owner else ""
    return module, [f"{base}{part}.{leaf}" for part in packed[module]]


_EXPERT_NAME = re.compile(r"\.experts\.(\d+)\.")


def family_names(name: str) -> tuple[str, ...]:
    """The names a family map may give vLLM parameter ``name`` under: its own, and — for
    vLLM's routed experts, which vLLM 0.32 keeps in a ``routed_experts`` submodule of the MoE
    layer (its checkpoint loader inserts the segment the same way) — the name without it.

    >>> family_names("model.layers.0.mlp.experts.routed_experts.w13_weight")
    ('model.layers.0.mlp.experts.routed_experts.w13_weight', 'model.layers.0.mlp.experts.w13_weight')
    """
    alias = name.replace(".experts.routed_experts.", ".experts.", 1)
    return (name,) if alias == name else (name, alias)


def entry_expert(rule: Rule) -> int | None:
    """The expert a stack entry reads: the ``index`` of its segments (a packed ``[E, ...]``
    trainer tensor) or the ``experts.<e>.`` of their names (one module per expert); ``None``
    when its segments do not agree on one.

    >>> entry_expert(Rule.of([{"source": "mlp.experts.gate_up_proj", "index": 3, "start": 0, "stop": 8},
    ...                       {"source": "mlp.experts.gate_up_proj", "index": 3, "start": 8, "stop": None}]))
    3
    >>> entry_expert(Rule.of(["mlp.experts.5.gate_proj.weight", "mlp.experts.5.up_proj.weight"]))
    5
    """
    found: set[int] = set()
    for seg in rule.segments:
        if seg.index is not None:
            found.add(seg.index)
        else:
            match = _EXPERT_NAME.search(seg.source)
            if match is None:
                return None
            found.add(int(match.group(1)))
    return found.pop() if len(found) == 1 else None


def _expert_order(param: Param, per_worker: Sequence[Sequence[Param]], index: int) -> list[int]:
    """The expert at each position of a stacked parameter's global ``[E, ...]`` tensor: the
    workers' slots one after another when it is sharded over experts, else any worker's."""
    lists = [list(worker[index].experts or ()) for worker in per_worker]
    if param.axis == 0:
        return [e for experts in lists for e in experts]
    if any(experts != lists[0] for experts in lists):
        raise LayoutError(f"vLLM parameter {param.name!r}: tp ranks hold different experts {lists}")
    return lists[0]


def _stack_rule(param: Param, rule: object, order: list[int], key: str) -> Stack:
    """The family map's stack for a stacked parameter, checked against vLLM's real placement."""
    if not isinstance(rule, Stack):
        raise LayoutError(
            f"vLLM parameter {param.name!r} holds stacked experts; the family map's rule for {key!r} is not a "
            "stack (the rule: {'stack': [one rule per expert position]}, e.g. hf_to_vllm(config, ...))"
        )
    if len(rule.entries) != len(order):
        raise LayoutError(
            f"vLLM parameter {param.name!r}: the family map stacks {len(rule.entries)} experts, vLLM holds "
            f"{len(order)} (the rule: one entry per expert)"
        )
    for pos, (entry, expert) in enumerate(zip(rule.entries, order)):
        got = entry_expert(entry)
        if got != expert:
            raise LayoutError(
                f"vLLM parameter {param.name!r}: position {pos} holds expert {expert} (vLLM's expert map: "
                f"order {order}), but the family map's entry {pos} reads "
                f"{'no single expert' if got is None else f'expert {got}'} ({entry.sources}); build the map "
                "with the engine's ep and placement (hf_to_vllm(config, ep=..., placement=...))"
            )
    return rule


def engine_destinations(
    per_worker: Sequence[Sequence[Param]], tp: int, family: Mapping[str, object] | None = None
) -> tuple[list[Weight], NameMap]:
    """An engine's destination — every parameter's global ``Weight`` and the name map — from
    the :class:`Param` s each worker read (worker ``r`` at index ``r``) and an optional family
    map (``meshgroups.transfer.hf_to_vllm(config, ...)``). The same on every rank that
    computes it, trainer or worker.

    - Fused dense layers keep the rules read from vLLM's layers (they know replicated kv
      heads); a family rule for the same name must read the same trainer weights.
    - Stacked experts take the family's stack, after checking that entry ``p`` reads the
      expert vLLM keeps at position ``p`` (its expert map, per worker).
    - A plain parameter takes the family's rule if it gives one (a head read from the
      embedding); every other name the family gives must be a vLLM parameter.

    Args:
        per_worker: each worker's parameters (the same names, shapes and rules on every worker;
            under expert parallelism each its own experts).
        tp: the engine's tensor-parallel size (its workers).
        family: ``{vLLM name: rule}`` (a ``NameMap`` or its JSON form); ``None``: none.

    Returns:
        ``(weights, name_map)``.

    Raises:
        LayoutError: workers that read different destinations, a family rule that disagrees
            with vLLM's layer or placement, a family name vLLM lacks, stacked experts without a
            family map — naming the weight and the rule.

    >>> qkv = Param("l.qkv_proj.weight", (8, 4), "float32", 0,
    ...             (("l.q_proj.weight", 8, 8), ("l.k_proj.weight", 4, 4), ("l.v_proj.weight", 4, 4)))
    >>> w13 = Param("l.mlp.experts.routed_experts.w13_weight", (1, 4, 4), "float32", 0, experts=(0,))
    >>> w13b = Param("l.mlp.experts.routed_experts.w13_weight", (1, 4, 4), "float32", 0, experts=(1,))
    >>> fam = {"l.qkv_proj.weight": ["l.q_proj.weight", "l.k_proj.weight", "l.v_proj.weight"],
    ...        "l.mlp.experts.w13_weight": {"stack": [["l.mlp.experts.0.gate_proj.weight", "l.mlp.experts.0.up_proj.weight"],
    ...                                        ["l.mlp.experts.1.gate_proj.weight", "l.mlp.experts.1.up_proj.weight"]]}}
    >>> ws, m = engine_destinations([[qkv, w13], [qkv, w13b]], tp=2, family=fam)
    >>> ws[1].shape, m.rule("l.mlp.experts.routed_experts.w13_weight").sources
    ((2, 4, 4), ('l.mlp.experts.0.gate_proj.weight', 'l.mlp.experts.0.up_proj.weight', 'l.mlp.experts.1.gate_proj.weight', 'l.mlp.experts.1.up_proj.weight'))
    """
    if not per_worker:
        raise LayoutError("engine_destinations: no worker's parameters")
    first = list(per_worker[0])
    for r, worker in enumerate(per_worker[1:], 1):
        mine = [(p.name, p.local_shape, p.dtype, p.axis, p.parts, p.source) for p in worker]
        theirs = [(p.name, p.local_shape, p.dtype, p.axis, p.parts, p.source) for p in first]
        if mine != theirs:
            diff = next(
                (b[0] for a, b in zip(theirs, mine) if a != b),
                f"{len(mine)} parameters against {len(theirs)}",
            )
            raise LayoutError(
                f"engine worker {r} reads another destination than worker 0 (first difference: {diff})"
            )
    fam = NameMap.of(family) if family is not None else NameMap()
    weights, derived = destinations(first, tp)
    rules: dict[str, Rule | Stack] = dict(derived.items())
    used: set[str] = set()
    for index, param in enumerate(first):
        key = next((n for n in family_names(param.name) if n in fam), None)
        if key is not None:
            used.add(key)
        rule = fam[key] if key is not None else None
        if param.experts is not None:
            if rule is None:
                raise LayoutError(
                    f"vLLM parameter {param.name!r} holds stacked experts: the engine cannot tell how the trainer "
                    "names them; pass the family map (VLLMWeightSync(..., name_map=hf_to_vllm(config, ...)))"
                )
            rules[param.name] = _stack_rule(
                param, rule, _expert_order(param, per_worker, index), key or param.name
            )
        elif rule is None:
            continue
        elif param.parts is not None:
            have = rules[param.name]
            if rule.sources != have.sources:
                raise LayoutError(
                    f"vLLM parameter {param.name!r}: the family map fuses {list(rule.sources)}, vLLM's layer fuses "
                    f"{list(have.sources)} (the rule: the same trainer weights, in the same order)"
                )
        elif isinstance(rule, Stack):
            raise LayoutError(
                f"vLLM parameter {param.name!r} holds no stacked experts; the family map stacks {key!r}"
            )
        else:
            rules[param.name] = rule
    unknown = [n for n in fam if n not in used]
    if unknown:
        raise LayoutError(
            f"the family map names {len(unknown)} weight(s) this vLLM model does not have, e.g. {unknown[:3]} "
            "(the rule: every name of the map is a vLLM parameter; a tied head is no parameter of its own)"
        )
    return weights, NameMap(
        {n: r for n, r in rules.items() if not (isinstance(r, Rule) and r.is_rename and r.sources == (n,))}
    )


__all__ = [
    "Param",
    "destination",
    "destinations",
    "engine_destinations",
    "entry_expert",
    "family_names",
    "fused_parts",
]
