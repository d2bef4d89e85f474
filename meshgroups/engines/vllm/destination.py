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

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from meshgroups.errors import LayoutError
from meshgroups.transfer.names import NameMap, Rule, Segment
from meshgroups.transfer.spec import Shard, Weight


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
    """

    name: str
    local_shape: tuple[int, ...]
    dtype: str
    axis: int | None = None
    parts: tuple[tuple[str, int, int], ...] | None = None
    source: str | None = None


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


__all__ = ["Param", "destination", "destinations", "fused_parts"]
