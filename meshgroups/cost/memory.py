"""Bytes a rank holds: parameters, gradients, master weights, optimizer moments, activations.

Parameters are cut the way DTensor and FSDP2 cut them: tensor parallelism takes its chunk of the
tensor's ``tp_axis``, expert parallelism its chunk of the stacked experts, then FSDP2 its chunk of
dim 0 of what is left, each a ``torch.chunk`` chunk (the first chunks are the larger ones). So a
rank's parameter, gradient and moment bytes are exactly its local shards' (the sharded tensors'
``to_local()``), and the rank with coordinate 0 on every dim but ``pp`` holds the most of its
stage.

Activations follow Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models" (MLSys 2023, arXiv:2205.05198), Table 2: bytes per transformer layer for
sequence length ``s``, micro-batch ``b``, hidden size ``h``, ``a`` heads and tp size ``t``,
16-bit activations and 1-byte dropout masks::

    >>> from meshgroups.cost.model import preset
    >>> gpt3 = preset("gpt3-175b")
    >>> activation_bytes_per_layer(gpt3, tp=8, sequence_parallel=True, recompute="selective") / (2048 * 12288)
    4.25
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from meshgroups.errors import LayoutError
from meshgroups.layout import Layout

from .model import Model, ParamTensor
from .roles import Parallelism, Recompute, dtype_bytes
from .rules import check

__all__ = [
    "RankMemory",
    "activation_bytes",
    "activation_bytes_per_layer",
    "chunk_size",
    "data_parallel_dims",
    "local_numel",
    "local_shape",
    "peak_memory",
    "rank_memory",
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

    >>> from meshgroups.cost.model import ParamTensor
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

    >>> from meshgroups.cost.model import ParamTensor
    >>> local_numel(ParamTensor("qkv", (192, 64), 0), Layout(dp_shard=2, tp=2), 1)
    3072
    """
    n = 1
    for d in local_shape(tensor, layout, rank, plan, fsdp=fsdp):
        n *= d
    return n


def stage_tensors(model: Model, pp: int, stage: int) -> list[tuple[ParamTensor, int]]:
    """The tensors pipeline stage ``stage`` of ``pp`` holds, each with its count (layers).

    Layers are spread evenly; the first stage holds the embedding, the last the final norm
    and the output head (a tied head is the embedding itself when one stage holds both, else
    the last stage holds a copy, as Megatron does).

    Args:
        model: the model. pp: stages. stage: ``0..pp-1``.

    Returns:
        ``[(tensor, count), ...]``.

    Raises:
        LayoutError: ``pp`` does not divide the layers.

    >>> [(t.name, n) for t, n in stage_tensors(preset("tiny"), 2, 1)][-2:]
    [('final_norm', 1), ('head', 1)]
    """
    if model.layers % pp:
        raise LayoutError(f"pp={pp} does not divide layers={model.layers}")
    out = []
    for t in model.tensors():
        if t.where == "layer":
            out.append((t, model.layers // pp))
        elif t.where == "embedding" and stage == 0:
            out.append((t, 1))
        elif t.where in ("final_norm", "head") and stage == pp - 1:
            if t.where == "head" and model.tied_embeddings and pp == 1:
                continue
            out.append((t, 1))
    return out


def activation_bytes_per_layer(
    model: Model, tp: int = 1, sequence_parallel: bool = False, recompute: Recompute = "none", cp: int = 1
) -> float:
    """Activation bytes one transformer layer keeps for the backward pass, per micro-batch
    (Korthikanti et al. 2022, Table 2, with ``s`` the sequence each rank holds, ``s / cp``):

    - no recomputation: ``sbh(10 + 24/t + 5as/(ht))``; with sequence parallelism
      ``sbh(34/t + 5as/(ht))`` (``t = 1``: the paper's ``sbh(34 + 5as/h)``);
    - selective (the attention core recomputed): ``sbh(10 + 24/t)``; with sequence
      parallelism ``34·sbh/t``;
    - full (only each layer's 16-bit input kept): ``2sbh`` (the table's value; with sequence
      parallelism the input is a sequence shard: ``2sbh/t``).

    The formulas count multi-head attention and a ``4h`` non-gated MLP; for grouped-query
    attention, gated MLPs and experts they are the same formulas, an approximation.

    Args:
        model: the model (``seq_len``, ``micro_batch``, ``hidden``, ``heads``).
        tp: t. sequence_parallel: with sequence parallelism. recompute: see above. cp: the
            context-parallel size.

    Returns:
        bytes (a float: the formulas divide by t).

    >>> activation_bytes_per_layer(preset("gpt3-175b")) / (2048 * 12288)   # 34 + 5as/h
    114.0
    """
    s, b, h, a = model.seq_len / cp, model.micro_batch, model.hidden, model.heads
    sbh = s * b * h
    attention = 5 * a * s / (h * tp)
    if recompute == "full":
        return 2 * sbh / (tp if sequence_parallel else 1)
    if sequence_parallel:
        return sbh * (34 / tp + (0 if recompute == "selective" else attention))
    return sbh * (10 + 24 / tp + (0 if recompute == "selective" else attention))


def activation_bytes(model: Model, layout: Layout, rank: int, plan: Parallelism | None = None) -> float:
    """Activation bytes ``rank`` holds at its peak: its stage's layers times the micro-batches
    its schedule keeps in flight. 1F1B: stage ``k`` of ``p`` holds ``min(p - k, m)``
    micro-batches (the first stage ``p``, so ``L`` layers' worth whatever ``p``, as the paper
    notes); interleaved with ``v`` chunks multiplies by ``1 + (p-1)/(p·v)`` (the paper's §4.2.3).
    Embedding and loss activations are not counted.

    Args:
        model: the model. layout: the layout. rank: a rank of it. plan: roles and schedule.

    Returns:
        bytes.

    >>> activation_bytes(preset("tiny"), Layout(pp=2, tp=2), 0, Parallelism(micro_batches=4)) == 2 * 2 * activation_bytes_per_layer(preset("tiny"), tp=2)
    True
    """
    plan = plan or Parallelism()
    sizes = plan.sizes(layout)
    dims = plan.dims(layout)
    p, m, v = sizes["pp"], plan.micro_batches, plan.virtual_stages
    stage = layout.coords(rank)[dims["pp"]] if "pp" in dims else 0
    per_layer = activation_bytes_per_layer(
        model, sizes["tp"], plan.sequence_parallel, plan.recompute, sizes["cp"]
    )
    in_flight = min(p - stage, m)
    factor = 1 + (p - 1) / (p * v) if plan.schedule == "interleaved" else 1.0
    return per_layer * (model.layers // p) * in_flight * factor


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank holds.

    Args:
        rank: the rank. params, grads, master, optimizer: bytes of its parameter shards, their
            gradients, the master copy and the optimizer moments. activations: its peak
            activation bytes (see :func:`activation_bytes`).

    >>> RankMemory(0, 2, 4, 4, 8, 1.5).total
    19.5
    """

    rank: int
    params: int
    grads: int
    master: int
    optimizer: int
    activations: float

    @property
    def states(self) -> int:
        """Parameters, gradients, master copy and moments (what does not depend on the batch)."""
        return self.params + self.grads + self.master + self.optimizer

    @property
    def total(self) -> float:
        """Everything counted."""
        return self.states + self.activations

    def to_dict(self) -> dict[str, float]:
        """The fields and ``total`` as a dict (for JSON).

        Returns:
            the dict.

        >>> RankMemory(0, 2, 4, 4, 8, 1.5).to_dict()["total"]
        19.5
        """
        return {**asdict(self), "total": self.total}


def rank_memory(model: Model, layout: Layout, rank: int, plan: Parallelism | None = None) -> RankMemory:
    """What ``rank`` of ``layout`` holds, training ``model`` as ``plan`` says.

    Args:
        model: the model. layout: the layout (dims named after roles, or mapped by ``plan``).
        rank: a rank of ``layout``. plan: roles, schedule and dtypes (default ``Parallelism()``).

    Returns:
        a :class:`RankMemory`.

    Raises:
        LayoutError: a dim with no role, or sizes the model does not admit
            (:func:`meshgroups.cost.rules.problems`).

    >>> rank_memory(preset("tiny"), Layout(dp_shard=2, tp=2), 0).params   # bf16; norms are not cut by tp
    90688
    """
    plan = plan or Parallelism()
    sizes = plan.sizes(layout)
    check(model, sizes, plan.virtual_stages)
    dims = plan.dims(layout)
    stage = layout.coords(rank)[dims["pp"]] if "pp" in dims else 0
    numel = sum(n * local_numel(t, layout, rank, plan) for t, n in stage_tensors(model, sizes["pp"], stage))
    pr = plan.precision
    return RankMemory(
        rank=rank,
        params=numel * dtype_bytes(pr.params),
        grads=numel * dtype_bytes(pr.grads),
        master=numel * dtype_bytes(pr.master) if pr.master else 0,
        optimizer=2 * numel * dtype_bytes(pr.moments),
        activations=activation_bytes(model, layout, rank, plan),
    )


def peak_memory(model: Model, layout: Layout, plan: Parallelism | None = None) -> RankMemory:
    """The rank of ``layout`` that holds the most: over the pipeline stages, the rank at
    coordinate 0 of every other dim (it holds the largest chunks).

    Args:
        model, layout, plan: as :func:`rank_memory`.

    Returns:
        that rank's :class:`RankMemory`.

    >>> peak_memory(preset("tiny"), Layout(pp=2, dp_shard=2, tp=2)).rank in (0, 4)
    True
    """
    plan = plan or Parallelism()
    dims = plan.dims(layout)
    zero = {d: 0 for d in layout.names}
    stages = range(layout.size(dims["pp"])) if "pp" in dims else [0]
    ranks = [layout.rank_at(**{**zero, **({dims["pp"]: k} if "pp" in dims else {})}) for k in stages]
    return max((rank_memory(model, layout, r, plan) for r in ranks), key=lambda m: m.total)
