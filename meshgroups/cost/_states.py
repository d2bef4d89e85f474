"""What a rank holds that does not depend on the batch: its parameter shards, their gradients,
the master copy and the optimizer's moments — exactly, tensor by tensor, as DTensor, FSDP2 and
``torch.optim`` hold them — and the sizes FSDP2 gathers and reduces per unit.

A rank holds the tensors of its pipeline chunks (:mod:`meshgroups.cost._pipeline`): every layer
of each chunk, the embedding with the first chunk, the final norm and the head with the last
(a tied head is the embedding itself when one rank holds both, else a copy on the last stage, as
Megatron keeps it). Each tensor is cut by tp (its ``tp_axis``; the embedding and the head only
with ``vocab_parallel``), experts by ep, then FSDP2 cuts dim 0 over the sharding dims
(``torch.chunk``: the first chunks are the larger ones). Stored parameters are in
``Precision.params``, gradients in ``Precision.grads``, each moment in ``Precision.moments``;
``torch.optim``'s AdamW adds a 0-d fp32 step per parameter tensor; without FSDP2 the gradient
of torch's vocabulary-parallel embedding is the whole vocabulary's on every tp rank. ZeRO-1 (``zero=1``,
Megatron's distributed optimizer) cuts the master copy and the moments over the data-parallel
dims FSDP does not shard; ZeRO-2 the gradients too::

    >>> from meshgroups import Layout
    >>> from meshgroups.cost._model import preset
    >>> s = rank_states(preset("tiny"), Layout(dp_shard=2, tp=2), 0, Parallelism(precision=Precision.fsdp2()))
    >>> s.params == s.grads, s.optimizer == 2 * s.params + 4 * s.tensors
    (True, True)
"""

from __future__ import annotations

from dataclasses import dataclass

from meshgroups.cost._memory import chunk_size, data_parallel_dims, local_shape
from meshgroups.cost._model import Model, ParamTensor
from meshgroups.cost._pipeline import chunk_layers, stage_chunks
from meshgroups.cost._roles import Parallelism, dtype_bytes
from meshgroups.layout import Layout

__all__ = ["Part", "Parts", "States", "rank_parts", "rank_states", "rank_tensors"]


def rank_tensors(
    model: Model, layout: Layout, rank: int, plan: Parallelism
) -> list[tuple[ParamTensor, int, int]]:
    """The tensors ``rank`` holds: ``(tensor, layers, chunk)`` (``layers``: how many copies,
    one per layer of the chunk; 1 for the embedding, final norm and head).

    Args:
        model: the model. layout: the layout. rank: a rank of it. plan: roles and pipeline.

    Returns:
        the list.

    >>> [(t.name, n, c) for t, n, c in rank_tensors(preset("tiny"), Layout(pp=2), 1, Parallelism())][-2:]
    [('final_norm', 1, 1), ('head', 1, 1)]
    """
    dims = plan.dims(layout)
    pp = layout.size(dims["pp"]) if "pp" in dims else 1
    stage = layout.coords(rank)[dims["pp"]] if "pp" in dims else 0
    chunks = pp * plan.virtual_stages
    counts = chunk_layers(model.layers, chunks, plan.layers_per_stage)
    out: list[tuple[ParamTensor, int, int]] = []
    for c in stage_chunks(pp, plan.virtual_stages, stage):
        for t in model.tensors():
            if t.where == "layer":
                if counts[c]:
                    out.append((t, counts[c], c))
            elif t.where == "embedding" and c == 0:
                out.append((t, 1, c))
            elif t.where in ("final_norm", "head") and c == chunks - 1:
                if t.where == "head" and model.tied_embeddings and stage == 0:
                    continue  # one rank holds both ends: the head is the embedding
                out.append((t, 1, c))
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@dataclass(frozen=True)
class States:
    """Bytes of a rank's states, held all step (gradients: once backward has made them).

    Args:
        params, grads, master, optimizer: bytes (``optimizer``: the moments and AdamW's steps).
        tensors: the rank's parameter tensors (one AdamW step each).

    >>> States(4, 4, 0, 12, 1).total
    20
    """

    params: int
    grads: int
    master: int
    optimizer: int
    tensors: int

    @property
    def total(self) -> int:
        """All of them."""
        return self.params + self.grads + self.master + self.optimizer


def _zero_cut(n: int, layout: Layout, rank: int, repl: tuple[str, ...]) -> int:
    if not repl:
        return n
    group = list(layout.group_of(rank, *repl))
    return chunk_size(n, len(group), group.index(rank))


def rank_states(model: Model, layout: Layout, rank: int, plan: Parallelism) -> States:
    """``rank``'s states (see the module docstring).

    Args:
        model: the model. layout: the layout. rank: a rank of it. plan: roles, dtypes, ZeRO.

    Returns:
        a :class:`States`.

    >>> rank_states(preset("tiny"), Layout(dp_shard=4), 0, Parallelism()).tensors
    27
    """
    pr = plan.precision
    numel = tensors = extra = 0
    shard, repl = data_parallel_dims(layout, plan, expert=False)
    dims = plan.dims(layout)
    tp = layout.size(dims["tp"]) if "tp" in dims else 1
    for t, n, _ in rank_tensors(model, layout, rank, plan):
        numel += n * _numel(local_shape(t, layout, rank, plan))
        tensors += n
        if t.where == "embedding" and tp > 1 and plan.vocab_parallel and not shard:
            # torch's RowwiseParallel embedding: its weight is a vocabulary shard, its gradient
            # the whole vocabulary's (a partial sum each tp rank keeps), measured
            extra += t.numel - _numel(local_shape(t, layout, rank, plan))
    sharded = _zero_cut(numel, layout, rank, repl) if plan.zero else numel
    grads = sharded if plan.zero == 2 else numel + extra
    master = sharded * dtype_bytes(pr.master) if pr.master else 0
    return States(
        params=numel * dtype_bytes(pr.params),
        grads=grads * dtype_bytes(pr.grads),
        master=master,
        optimizer=2 * sharded * dtype_bytes(pr.moments) + 4 * tensors,
        tensors=tensors,
    )


@dataclass(frozen=True)
class Part:
    """Element counts of a group of a rank's tensors: ``numel`` unsharded (after tp and ep),
    ``padded`` as FSDP2 pads dim 0 to a multiple of its shards, ``sharded`` this rank's FSDP2
    chunk (``numel`` without FSDP)."""

    numel: int = 0
    padded: int = 0
    sharded: int = 0

    def __add__(self, other: Part) -> Part:
        return Part(self.numel + other.numel, self.padded + other.padded, self.sharded + other.sharded)


@dataclass(frozen=True)
class Parts:
    """A rank's tensors grouped as FSDP2 units see them: one layer (every layer is alike), the
    layer's down projection (the first gradient its backward makes), its MLP's matmuls (the
    gradients made before the attention's backward), the head side (final norm
    and head, last chunk) and the embedding (first chunk); ``shards`` is FSDP2's shard count
    (1: no FSDP)."""

    layer: Part
    down: Part
    mlp: Part
    head: Part
    embedding: Part
    shards: int


def rank_parts(model: Model, layout: Layout, rank: int, plan: Parallelism) -> Parts:
    """``rank``'s :class:`Parts`.

    Args:
        model, layout, rank, plan: as :func:`rank_states`.

    Returns:
        the parts.

    >>> p = rank_parts(preset("tiny"), Layout(dp_shard=2), 0, Parallelism())
    >>> p.shards, p.layer.sharded * 2 == p.layer.padded
    (2, True)
    """
    shard, _ = data_parallel_dims(layout, plan, expert=False)
    shards = layout.size(*shard) if shard else 1
    groups = {"layer": Part(), "down": Part(), "mlp": Part(), "head": Part(), "embedding": Part()}
    seen_layer: set[str] = set()
    for t, _, _ in rank_tensors(model, layout, rank, plan):
        shape = local_shape(t, layout, rank, plan, fsdp=False)
        n = _numel(shape)
        rest = n // shape[0] if shape[0] else 0
        part = Part(n, -(-shape[0] // shards) * shards * rest, _numel(local_shape(t, layout, rank, plan)))
        if t.where == "layer":
            if t.name in seen_layer:
                continue  # a stage with several chunks lists a layer's tensors once per chunk
            seen_layer.add(t.name)
            groups["layer"] += part
            if t.name in ("fc2", "experts_fc2"):
                groups["down"] = part
            if t.name in ("fc1", "fc2", "gate", "up", "mlp_norm", "router", "experts_fc1", "experts_fc2"):
                groups["mlp"] += part
        elif t.where == "embedding":
            groups["embedding"] += part
        else:
            groups["head"] += part
    return Parts(groups["layer"], groups["down"], groups["mlp"], groups["head"], groups["embedding"], shards)
