"""The collectives a training step makes: for every pipeline stage, each call's op, its group
family (the dims its groups vary, named by them: ``"tp"``, ``"dp_shard+cp"``), how many calls
and each call's *payload* — the buffer a rank passes: an all-reduce's tensor, an all-gather's
output, a reduce-scatter's input, an all-to-all's input, a send's tensor. That is what a rank's
``torch.distributed`` calls carry, and what ``tests/cost/test_cost_exact.py`` counts on real
processes; :mod:`meshgroups.cost._traffic` puts it on links::

    >>> from meshgroups.cost._model import preset
    >>> lay = Layout(dp_shard=4, tp=2)
    >>> sorted({c.family for c in collectives(preset("tiny"), lay)})
    ['dp_shard', 'tp']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from meshgroups.cost._activations import is_recomputed
from meshgroups.cost._memory import data_parallel_dims, local_shape
from meshgroups.cost._model import Model, ParamTensor
from meshgroups.cost._pipeline import chunk_layers, chunk_ranges, stage_chunks
from meshgroups.cost._roles import Parallelism, dtype_bytes
from meshgroups.cost._rules import check
from meshgroups.cost._states import rank_tensors
from meshgroups.layout import Layout

__all__ = ["Collective", "collectives", "rank_payload", "stage_of"]

Op = Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send"]


@dataclass(frozen=True)
class Collective:
    """One kind of call a step makes, on every group of its family in the given stages.

    Args:
        family: the family's name (its dims joined by ``+``). dims: the dims its groups vary.
        op: ``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all`` or ``send``.
        what: what it carries. phase: ``forward``, ``backward`` or ``step``.
        payload: bytes of one call's buffer on one rank (see the module docstring).
        calls: calls per step on each rank of those stages.
        stages: the pipeline stages it runs on.
        peer: for ``send``: the receiver's offset along the family's dim (``+1`` the next
            member, wrapping around).
        where: ``((dim, coordinate), ...)``: only the ranks at these coordinates make it (the
            embedding's and head's FSDP2 traffic when tp cuts the vocabulary unevenly: each
            tp coordinate's chunk is its own size); empty: every rank of ``stages``.

    >>> Collective("tp", ("tp",), "all_reduce", "x", "forward", 1024, 4, (0,)).bytes_per_rank
    4096
    """

    family: str
    dims: tuple[str, ...]
    op: Op
    what: str
    phase: str
    payload: int
    calls: int
    stages: tuple[int, ...]
    peer: int = 0
    where: tuple[tuple[str, int], ...] = ()

    @property
    def bytes_per_rank(self) -> int:
        """``payload × calls``: what one rank's calls of this kind carry in a step."""
        return self.payload * self.calls

    def to_dict(self) -> dict[str, object]:
        """The fields as a dict (for JSON).

        Returns:
            the dict.

        >>> Collective("tp", ("tp",), "all_reduce", "x", "forward", 8, 1, (0,)).to_dict()["op"]
        'all_reduce'
        """
        return {
            "family": self.family,
            "dims": list(self.dims),
            "op": self.op,
            "what": self.what,
            "phase": self.phase,
            "payload": self.payload,
            "calls": self.calls,
            "stages": list(self.stages),
            "peer": self.peer,
            "where": {d: k for d, k in self.where},
        }


def _family(dims: tuple[str, ...]) -> str:
    return "+".join(dims)


def _padded(t: ParamTensor, layout: Layout, rank: int, plan: Parallelism, shards: int) -> int:
    # FSDP2 pads dim 0 of each (tp/ep-cut) tensor to a multiple of the shard count and
    # all-gathers / reduce-scatters the padded buffer
    shape = local_shape(t, layout, rank, plan, fsdp=False)
    n = -(-shape[0] // shards) * shards
    for d in shape[1:]:
        n *= d
    return n


def _dp_collectives(
    model: Model, layout: Layout, plan: Parallelism, stage: int, first: int
) -> list[Collective]:
    """The FSDP2 / HSDP / DDP collectives of pipeline stage ``stage`` (``first``: its rank at
    coordinate 0 of every other dim). A tensor tp cuts unevenly (a vocabulary tp does not
    divide) has a chunk per tp coordinate: its unit's calls are listed per coordinate."""
    pr, m = plan.precision, plan.micro_batches
    gather, reduce = dtype_bytes(pr.gather), dtype_bytes(pr.reduction)
    dims = plan.dims(layout)
    listed = rank_tensors(model, layout, first, plan)
    # the stage's layers (over its chunks) and one layer's tensors, listed once
    n = sum(c for t, c, _ in listed if t.where == "layer" and t.name == "attn_norm")
    tensors, seen = [], set()
    for t, _, _ in listed:
        if t.where != "layer" or t.name not in seen:
            seen.add(t.name)
            tensors.append(t)
    # the ranks standing for each tp coordinate (their chunks may differ in size)
    reps: list[tuple[int, tuple[tuple[str, int], ...]]] = [(first, ())]
    if "tp" in dims and layout.size(dims["tp"]) > 1:
        tp = dims["tp"]
        reps = [
            (layout.rank_at(**{**layout.coords(first), tp: k}), ((tp, k),)) for k in range(layout.size(tp))
        ]
    out = []
    for expert in (False, True) if model.is_moe else (False,):
        shard, repl = data_parallel_dims(layout, plan, expert)
        s = layout.size(*shard) if shard else 1
        mine = [t for t in tensors if t.expert == expert]
        per_rep: list[tuple[tuple[tuple[str, int], ...], dict[str, int]]] = []
        for unit in ("layer", "root"):
            sizes_of = [
                (
                    where,
                    sum(
                        _padded(t, layout, rank, plan, s)
                        for t in mine
                        if (t.where == "layer") == (unit == "layer")
                    ),
                )
                for rank, where in reps
            ]
            if all(x == sizes_of[0][1] for _, x in sizes_of):
                sizes_of = [((), sizes_of[0][1])]
            per_rep += [(where, {unit: numel}) for where, numel in sizes_of]
        per_unit = {"layer": n * m, "root": m}
        kind = "expert " if expert else ""
        for where, units in per_rep:
            for unit, numel in units.items():
                if not numel:
                    continue
                if shard and s > 1:
                    fam = _family(shard)
                    g = gather * numel
                    phases = ("forward", "backward") if unit == "layer" else ("forward",)
                    # FSDP2 keeps the root unsharded from forward to backward
                    for phase in phases:
                        out.append(Collective(fam, shard, "all_gather", f"{kind}{unit} params", phase, g,
                                              per_unit[unit], (stage,), where=where))  # fmt: skip
                    out.append(Collective(fam, shard, "reduce_scatter", f"{kind}{unit} grads", "backward",
                                          reduce * numel, per_unit[unit], (stage,), where=where))  # fmt: skip
                if repl and layout.size(*repl) > 1:
                    # HSDP all-reduces each reduce-scattered shard per micro-batch; DDP all-reduces
                    # the accumulated gradients once per step
                    calls = per_unit[unit] if shard else (n if unit == "layer" else 1)
                    grads = reduce * (numel // s if shard else numel)
                    out.append(Collective(_family(repl), repl, "all_reduce", f"{kind}{unit} grads", "backward",
                                          grads, calls, (stage,), where=where))  # fmt: skip
    return out


def _stage_groups(model: Model, plan: Parallelism, pp: int) -> list[tuple[tuple[int, ...], int, int]]:
    """``(stages, layers, recomputed)``: the stages that hold as many layers and recompute as
    many of them whole (uneven stages and the ``layer`` policy make them differ)."""
    counts = chunk_layers(model.layers, pp * plan.virtual_stages, plan.layers_per_stage)
    ranges = chunk_ranges(counts)
    by: dict[tuple[int, int], list[int]] = {}
    for k in range(pp):
        mine = [i for ch in stage_chunks(pp, plan.virtual_stages, k) for i in ranges[ch]]
        key = (len(mine), sum(is_recomputed(plan, i) for i in mine))
        by.setdefault(key, []).append(k)
    return [(tuple(st), n, r) for (n, r), st in by.items()]


def _layer_collectives(
    model: Model,
    plan: Parallelism,
    sizes: dict[str, int],
    dims: dict[str, str],
    group: tuple[tuple[int, ...], int, int],
) -> list[Collective]:
    """The per-layer tp, cp and ep collectives of the stages in ``group``. Recomputation runs
    a layer's forward collectives again: every one of a layer recomputed whole; with the
    ``op`` policy the tp all-gathers (or all-reduces) and ep all-to-alls (reduce-scatters and
    the attention's outputs are kept); with ``selective`` the attention core's ring sends."""
    t, c, e = sizes["tp"], sizes["cp"], sizes["ep"]
    every, n, r = group
    m = plan.micro_batches
    act = dtype_bytes(plan.precision.activations)
    sp = plan.sequence_parallel
    a = model.micro_batch * model.seq_len // c * model.hidden * act
    op = n if plan.recompute == "op" else 0
    out: list[Collective] = []
    if t > 1 and n:
        tp = (dims["tp"],)
        if sp:
            out.append(
                Collective(
                    "tp", tp, "all_gather", "layer activations", "forward", a, 2 * (n + r + op) * m, every
                )
            )
            out.append(
                Collective(
                    "tp", tp, "reduce_scatter", "layer activations", "forward", a, 2 * (n + r) * m, every
                )
            )
            kinds: tuple[Op, ...] = ("all_gather", "reduce_scatter")
            for kind in kinds:
                out.append(Collective("tp", tp, kind, "layer gradients", "backward", a, 2 * n * m, every))
            # the norms see sequence shards, so their weights' gradients are partial sums over
            # tp: all-reduced per micro-batch (torch's SequenceParallel; Megatron once per step)
            norm = model.hidden * dtype_bytes(plan.precision.grads)
            out.append(
                Collective(
                    "tp", tp, "all_reduce", "norm weight gradients", "backward", norm, 2 * n * m, every
                )
            )
        else:
            out.append(
                Collective("tp", tp, "all_reduce", "layer outputs", "forward", a, 2 * (n + r + op) * m, every)
            )
            out.append(
                Collective("tp", tp, "all_reduce", "layer input gradients", "backward", a, 2 * n * m, every)
            )
    tokens = model.micro_batch * model.seq_len // c
    if c > 1 and n:
        kv = 2 * tokens * (model.kv_heads or 0) // t * (model.head_dim or 0) * act
        core = n if plan.recompute == "selective" else 0
        cp = (dims["cp"],)
        out.append(
            Collective(
                "cp",
                cp,
                "send",
                "K and V (ring attention)",
                "forward",
                kv,
                (c - 1) * (n + r + core) * m,
                every,
                1,
            )
        )
        out.append(
            Collective(
                "cp", cp, "send", "K, V and their gradients", "backward", kv, 2 * (c - 1) * n * m, every, 1
            )
        )
    if e > 1 and model.is_moe and n:
        routed = tokens // (t if sp else 1) * model.top_k * model.hidden * act
        ep = (dims["ep"],)
        out.append(
            Collective(
                "ep",
                ep,
                "all_to_all",
                "token dispatch and combine",
                "forward",
                routed,
                2 * (n + r + op) * m,
                every,
            )
        )
        out.append(
            Collective("ep", ep, "all_to_all", "their gradients", "backward", routed, 2 * n * m, every)
        )
    return out  # fmt: skip


def _activation_collectives(
    model: Model, plan: Parallelism, sizes: dict[str, int], dims: dict[str, str]
) -> list[Collective]:
    t, p = sizes["tp"], sizes["pp"]
    m, v = plan.micro_batches, plan.virtual_stages
    act = dtype_bytes(plan.precision.activations)
    sp = plan.sequence_parallel
    tokens = model.micro_batch * model.seq_len // sizes["cp"]
    a = tokens * model.hidden * act
    out: list[Collective] = []
    for group in _stage_groups(model, plan, p):
        out += _layer_collectives(model, plan, sizes, dims, group)
    if t > 1:
        tp = (dims["tp"],)
        if sp:
            norm = model.hidden * dtype_bytes(plan.precision.grads)
            out.append(
                Collective(
                    "tp", tp, "all_reduce", "final norm weight gradient", "backward", norm, m, (p - 1,)
                )
            )
        if plan.vocab_parallel:
            emb: Op = "reduce_scatter" if sp else "all_reduce"
            out.append(Collective("tp", tp, emb, "embedding output", "forward", a, m, (0,)))
            if sp:  # a reduce-scatter's gradient is an all-gather
                out.append(
                    Collective("tp", tp, "all_gather", "embedding output gradient", "backward", a, m, (0,))
                )
            if sp:
                out.append(Collective("tp", tp, "all_gather", "head input", "forward", a, m, (p - 1,)))
            out.append(Collective("tp", tp, emb, "head input gradient", "backward", a, m, (p - 1,)))
            # the loss on vocabulary shards: max, sum of exponentials and the target's logit,
            # one fp32 value per token each
            out.append(
                Collective("tp", tp, "all_reduce", "loss statistics", "forward", tokens * 4, 3 * m, (p - 1,))
            )
    if p > 1:
        pp = (dims["pp"],)
        boundary = a // (t if sp else 1)
        for k in range(p):
            forward = m * (v if k < p - 1 else v - 1)
            backward = m * (v if k > 0 else v - 1)
            if forward:
                out.append(Collective("pp", pp, "send", "activations", "forward", boundary, forward, (k,), 1))
            if backward:
                out.append(
                    Collective(
                        "pp", pp, "send", "activation gradients", "backward", boundary, backward, (k,), -1
                    )
                )
    return out


def collectives(model: Model, layout: Layout, plan: Parallelism | None = None) -> list[Collective]:
    """Every collective one training step of ``model`` on ``layout`` makes (see the module
    docstring), per micro-batch counts times ``plan.micro_batches``:

    - ``tp``: per layer two all-reduces forward (attention and MLP outputs) and two backward
      (their inputs' gradients), or with sequence parallelism an all-gather and a
      reduce-scatter in place of each (and, per micro-batch, an all-reduce of each norm
      weight's gradient, a partial sum over the sequence shards); with ``vocab_parallel``, one
      for the embedding's output (and its gradient, first stage), one for the head's input (and
      its gradient) and three per-token fp32 all-reduces for the loss (last stage).
    - ``dp_shard`` (FSDP2): per micro-batch, per layer, the padded parameters all-gathered
      forward and backward and the gradients reduce-scattered; the root unit (embedding, final
      norm, head) is all-gathered once (FSDP2 keeps the root unsharded for backward).
      ``dp_replicate``: the reduce-scattered shards all-reduced (HSDP); without a ``dp_shard``
      dim, every gradient once per step (DDP).
    - ``cp``: ring attention, each rank passing its K and V on ``cp - 1`` times per layer
      forward, and K, V and their gradients backward.
    - ``ep``: per MoE layer two all-to-alls forward (dispatch, combine) and two backward, of
      ``tokens × top_k × hidden`` activations.
    - ``pp``: each micro-batch's activations sent to the next stage and their gradients back
      (``v`` times per stage when interleaved, the last chunk excepted).

    Recomputation repeats forward collectives in the backward pass: all of a layer recomputed
    whole (``full``, the ``layer`` policy's layers), the tp all-gathers or all-reduces and the ep
    all-to-alls with ``op``, the ring sends with ``selective``. FSDP2's gathers and
    reduce-scatters are in the gather and reduce dtypes (``Precision.gather``,
    ``Precision.reduction``); a tensor tp cuts unevenly has its FSDP2 traffic listed per tp
    coordinate (``Collective.where``), each rank its own chunk's, as :func:`rank_memory` holds it.

    Args:
        model: the model. layout: the layout. plan: roles, schedule and dtypes.

    Returns:
        the collectives (families of size 1 make none).

    Raises:
        LayoutError: a dim with no role, or sizes the model does not admit.

    >>> [c.op for c in collectives(preset("tiny"), Layout(tp=2)) if c.what == "layer outputs"]
    ['all_reduce']
    """
    plan = plan or Parallelism()
    sizes = plan.sizes(layout)
    check(model, sizes, plan.virtual_stages, plan.layers_per_stage)
    dims = plan.dims(layout)
    out = _activation_collectives(model, plan, sizes, dims)
    zero = {d: 0 for d in layout.names}
    for k in range(sizes["pp"]):
        first = layout.rank_at(**{**zero, **({dims["pp"]: k} if "pp" in dims else {})})
        out += _dp_collectives(model, layout, plan, k, first)
    return [c for c in out if layout.size(*c.dims) > 1 and c.calls > 0]


def stage_of(layout: Layout, plan: Parallelism) -> np.ndarray:
    """Each rank's pipeline stage, indexed by rank (0 for every rank without a ``pp`` dim).

    Args:
        layout: the layout. plan: its roles.

    Returns:
        an int array of length ``layout.max_rank + 1``.

    >>> stage_of(Layout(pp=2, tp=2), Parallelism()).tolist()
    [0, 0, 1, 1]
    """
    dims = plan.dims(layout)
    stage = np.zeros(layout.max_rank + 1, dtype=np.int64)
    if "pp" in dims:
        groups = layout.groups(dims["pp"])
        stage[groups] = np.arange(groups.shape[1])[None, :]
    return stage


def rank_payload(
    collectives: list[Collective], layout: Layout, rank: int, plan: Parallelism | None = None
) -> dict[str, int]:
    """Per family, the payload bytes ``rank``'s calls carry in a step (``payload × calls``
    summed over the collectives of its stage; a send counts at its sender).

    Args:
        collectives: from :func:`collectives`. layout: the layout. rank: a rank of it.
        plan: the roles.

    Returns:
        ``{family: bytes}``.

    >>> lay = Layout(dp_shard=2, tp=2)
    >>> rank_payload(collectives(preset("tiny"), lay), lay, 0)["tp"] > 0
    True
    """
    plan = plan or Parallelism()
    stage = int(stage_of(layout, plan)[rank])
    coords = layout.coords(rank)
    out: dict[str, int] = {}
    for c in collectives:
        if stage in c.stages and all(coords[d] == k for d, k in c.where):
            out[c.family] = out.get(c.family, 0) + c.bytes_per_rank
    return out
