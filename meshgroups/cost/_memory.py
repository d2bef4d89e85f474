"""Bytes a rank holds: where each parameter tensor's pieces live, and the entry points of the
memory accounting.

Parameters are cut the way DTensor and FSDP2 cut them: tensor parallelism takes its chunk of the
tensor's ``tp_axis``, expert parallelism its chunk of the stacked experts, then FSDP2 its chunk of
dim 0 of what is left, each a ``torch.chunk`` chunk (the first chunks are the larger ones). So a
rank's parameter, gradient and moment bytes are exactly its local shards' (the sharded tensors'
``to_local()``), and the rank with coordinate 0 on every dim but ``pp`` holds the most of its
stage. What a rank holds at its peak in a training step — states, activations, the loss,
FSDP2's transient buffers — is :func:`rank_memory` (:mod:`meshgroups.cost._peak`), with the
activations of :mod:`meshgroups.cost._activations`::

    >>> from meshgroups.cost._model import preset
    >>> m = rank_memory(preset("llama3-8b"), Layout(dp_shard=8), 0, Parallelism(precision=Precision.fsdp2()))
    >>> m.phase, round(m.total / 2**30, 1), round(m.loss / 2**30, 1)
    ('loss backward', 68.6, 11.7)
"""

from __future__ import annotations

from meshgroups.cost._model import Model, ParamTensor
from meshgroups.cost._roles import Parallelism
from meshgroups.layout import Layout

__all__ = [
    "chunk_size",
    "data_parallel_dims",
    "local_numel",
    "local_shape",
    "stage_tensors",
]


def chunk_size(length: int, parts: int, index: int) -> int:
    """The length of chunk ``index`` of ``torch.chunk(range(length), parts)`` (which makes chunks
    of ``ceil(length / parts)``, the last ones shorter or empty).

    Args:
        length: the axis length. parts: chunks asked for. index: which chunk.

    Returns:
        its length.

    >>> [chunk_size(10, 4, i) for i in range(4)], [chunk_size(5, 4, i) for i in range(4)]
    ([3, 3, 3, 1], [2, 2, 1, 0])
    """
    step = -(-length // parts)
    return max(0, min(step, length - index * step))


def data_parallel_dims(
    layout: Layout, plan: Parallelism, expert: bool
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(shard_dims, replicate_dims)`` of a parameter kind, in layout order.

    The data-parallel dims of dense parameters are those of ``dp_replicate``, ``dp_shard``,
    ``ep`` and ``cp`` (ep and cp see different tokens, so they average gradients like data
    parallelism); experts drop ``ep`` (it holds different experts). With a ``dp_shard`` dim in
    the layout (even of size 1), FSDP shards over all of them but ``dp_replicate`` (torchtitan's
    ``dp_shard × cp`` mesh) and ``dp_replicate`` all-reduces (HSDP); without one, nothing is
    sharded and gradients are all-reduced over all of them (DDP).

    Args:
        layout: the layout. plan: its roles. expert: the experts' dims, else dense ones.

    Returns:
        the two tuples of dim names.

    >>> data_parallel_dims(Layout(dp_replicate=2, dp_shard=2, tp=2), Parallelism(), expert=False)
    (('dp_shard',), ('dp_replicate',))
    """
    dims = plan.dims(layout)
    roles = ("dp_replicate", "dp_shard", "cp") if expert else ("dp_replicate", "dp_shard", "ep", "cp")
    order = {d: i for i, d in enumerate(layout.names)}
    present = sorted((dims[r] for r in roles if r in dims), key=order.__getitem__)
    if "dp_shard" not in dims:
        return (), tuple(present)
    replicate = dims.get("dp_replicate")
    return tuple(d for d in present if d != replicate), (() if replicate is None else (replicate,))


def _index_in(layout: Layout, rank: int, dims: tuple[str, ...]) -> int:
    if not dims:
        return 0
    return int(list(layout.group_of(rank, *dims)).index(rank))


def local_shape(
    tensor: ParamTensor, layout: Layout, rank: int, plan: Parallelism | None = None, *, fsdp: bool = True
) -> tuple[int, ...]:
    """The shape of ``rank``'s piece of ``tensor``: its tp chunk, its ep chunk (experts), then
    (``fsdp``) its FSDP2 chunk of dim 0, as DTensor and FSDP2 cut them.

    Args:
        tensor: the tensor. layout: the layout. rank: a rank of it. plan: the roles (default
            ``Parallelism()``). fsdp: apply the FSDP cut (``False``: what FSDP all-gathers per rank).

    Returns:
        the shape (a rank holding an empty chunk has a 0 in it).

    >>> from meshgroups.cost._model import ParamTensor
    >>> local_shape(ParamTensor("qkv", (192, 64), 0), Layout(dp_shard=2, tp=2), 1)   # 96 rows, then 48
    (48, 64)
    """
    plan = plan or Parallelism()
    dims = plan.dims(layout)
    shape = list(tensor.shape)
    coords = layout.coords(rank)
    if tensor.tp_axis is not None and "tp" in dims and (plan.vocab_parallel or tensor.where == "layer"):
        t = layout.size(dims["tp"])
        shape[tensor.tp_axis] = chunk_size(shape[tensor.tp_axis], t, coords[dims["tp"]])
    if tensor.expert and "ep" in dims:
        shape[0] = chunk_size(shape[0], layout.size(dims["ep"]), coords[dims["ep"]])
    shard, _ = data_parallel_dims(layout, plan, tensor.expert)
    if fsdp and shard:
        shape[0] = chunk_size(shape[0], layout.size(*shard), _index_in(layout, rank, shard))
    return tuple(shape)


def local_numel(
    tensor: ParamTensor, layout: Layout, rank: int, plan: Parallelism | None = None, *, fsdp: bool = True
) -> int:
    """Elements of :func:`local_shape`.

    Args:
        tensor, layout, rank, plan, fsdp: as :func:`local_shape`.

    Returns:
        the element count.

    >>> from meshgroups.cost._model import ParamTensor
    >>> local_numel(ParamTensor("qkv", (192, 64), 0), Layout(dp_shard=2, tp=2), 1)
    3072
    """
    n = 1
    for d in local_shape(tensor, layout, rank, plan, fsdp=fsdp):
        n *= d
    return n


def stage_tensors(
    model: Model, pp: int, stage: int, plan: Parallelism | None = None
) -> list[tuple[ParamTensor, int]]:
    """The tensors pipeline stage ``stage`` of ``pp`` holds, each with its count (layers), its
    chunks' layers as ``plan`` splits them (:func:`meshgroups.cost._pipeline.chunk_layers`:
    ``layers_per_stage``, else as even as they allow); the first stage holds the embedding, the
    last the final norm and the output head (a tied head is the embedding itself when one stage
    holds both, else the last stage holds a copy, as Megatron does).

    Args:
        model: the model. pp: stages. stage: ``0..pp-1``. plan: the pipeline's split and
            virtual stages (default ``Parallelism()``).

    Returns:
        ``[(tensor, count), ...]``.

    Raises:
        LayoutError: a split the layers do not fill.

    >>> [(t.name, n) for t, n in stage_tensors(preset("tiny"), 2, 1)][-2:]
    [('final_norm', 1), ('head', 1)]
    """
    from meshgroups.cost._pipeline import chunk_layers, stage_chunks

    plan = plan or Parallelism()
    chunks = pp * plan.virtual_stages
    counts = chunk_layers(model.layers, chunks, plan.layers_per_stage)
    mine = stage_chunks(pp, plan.virtual_stages, stage)
    layers = sum(counts[c] for c in mine)
    out = []
    for t in model.tensors():
        if t.where == "layer":
            if layers:
                out.append((t, layers))
        elif t.where == "embedding" and 0 in mine:
            out.append((t, 1))
        elif t.where in ("final_norm", "head") and chunks - 1 in mine:
            if t.where == "head" and model.tied_embeddings and 0 in mine:
                continue
            out.append((t, 1))
    return out
