"""A rank's peak memory in a training step, by category, and whether it fits a budget.

The step is walked action by action — each micro-batch's forward and backward in turn, or the
order the pipeline schedule runs them (:mod:`meshgroups.cost._pipeline`) — and at each moment
that can be the peak the rank's live bytes are added up:

- **params, master, optimizer**: the states (:mod:`meshgroups.cost._states`), all step;
- **grads**: those backward has made so far (all of them from the second micro-batch on, or
  all step with ZeRO's persistent buffers); with FSDP2 a unit's sharded gradients appear at its
  reduce-scatter;
- **activations**: what the micro-batches in flight keep (:mod:`meshgroups.cost._activations`)
  and the working set of the layer whose backward runs (a recomputed layer holds its whole set
  again), plus the token ids and, in a pipeline, the stage's receive buffers (one per
  micro-batch for each chunk's input and output gradient, as ``PipelineStage`` keeps them) and,
  with the interleaved schedule, the activations and gradients it has sent (its runtime waits
  for its sends at the end of the step);
- **loss**: the logits' fp32 tensors of the loss's forward or backward;
- **transient**: FSDP2's gathered units (the root kept from forward to backward, the running
  layer and, in backward, the next one prefetched), its all-gather buffer, the unsharded
  gradients and the reduce-scatter's buffers.

The moments: each layer's forward, the loss's forward and backward, each layer's backward (its
MLP's, where the working set peaks), each unit's reduce-scatter, the optimizer step. The result
is peak *allocated* bytes; :func:`fit` compares it with a budget through an explicit allocator
overhead (``reserved ≈ allocated × overhead``) and says which it used::

    >>> from meshgroups import Layout
    >>> from meshgroups.cost._model import preset
    >>> m = rank_memory(preset("llama3-8b"), Layout(dp_shard=8), 0, Parallelism(precision=Precision.fsdp2()))
    >>> m.phase, m.total == m.params + m.grads + m.master + m.optimizer + m.activations + m.loss + m.transient
    ('loss backward', True)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from meshgroups.cost._activations import (
    attention_working,
    embedding_bytes,
    head_bytes,
    is_recomputed,
    layer_recomputed,
    layer_stored,
    layer_working,
    loss_bytes,
)
from meshgroups.cost._model import Model
from meshgroups.cost._pipeline import Action, chunk_layers, chunk_ranges, rank_actions, stage_chunks
from meshgroups.cost._roles import Parallelism, dtype_bytes
from meshgroups.cost._rules import check
from meshgroups.cost._states import rank_parts, rank_states
from meshgroups.errors import LayoutError
from meshgroups.layout import Layout

__all__ = ["Fit", "RankMemory", "fit", "peak_memory", "rank_memory"]

CATEGORIES = ("params", "grads", "master", "optimizer", "activations", "loss", "transient")


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank holds at its peak, by category (see the module docstring).

    Args:
        rank: the rank. params, grads, master, optimizer: its states at the peak (``grads``:
            those made by then). activations: kept activations, the running layer's working
            set and the token ids. loss: the loss's logits-sized tensors. transient: FSDP2's
            gathered units and buffers. phase: where the peak is (``"loss backward"``,
            ``"layer 3 backward"``, ``"optimizer step"``...).

    >>> RankMemory(0, 2, 4, 4, 8, 1.5).total
    19.5
    """

    rank: int
    params: int
    grads: int
    master: int
    optimizer: int
    activations: float
    loss: int = 0
    transient: int = 0
    phase: str = ""

    @property
    def states(self) -> int:
        """Parameters, gradients, master copy and moments at the peak."""
        return self.params + self.grads + self.master + self.optimizer

    @property
    def total(self) -> float:
        """Everything counted: the peak allocated bytes."""
        return self.states + self.activations + self.loss + self.transient

    def to_dict(self) -> dict[str, object]:
        """The fields and ``total`` as a dict (for JSON).

        Returns:
            the dict.

        >>> RankMemory(0, 2, 4, 4, 8, 1.5).to_dict()["total"]
        19.5
        """
        return {**asdict(self), "total": self.total}


def _walk(model: Model, layout: Layout, rank: int, plan: Parallelism) -> RankMemory:
    sizes = plan.sizes(layout)
    dims = plan.dims(layout)
    pp, v, m = sizes["pp"], plan.virtual_stages, plan.micro_batches
    stage = layout.coords(rank)[dims["pp"]] if "pp" in dims else 0
    counts = chunk_layers(model.layers, pp * v, plan.layers_per_stage)
    ranges = chunk_ranges(counts)
    chunks, last = stage_chunks(pp, v, stage), pp * v - 1
    states = rank_states(model, layout, rank, plan)
    parts = rank_parts(model, layout, rank, plan)
    pr = plan.precision
    gather, reduce, grad_b = dtype_bytes(pr.gather), dtype_bytes(pr.reduction), dtype_bytes(pr.grads)
    fsdp = parts.shards > 1
    # bytes: one layer's gradients as kept, the head side's, the embedding's
    lg, hg, eg = (x.sharded * grad_b for x in (parts.layer, parts.head, parts.embedding))
    full = {c: counts[c] * lg + (hg if c == last else 0) + (eg if c == 0 else 0) for c in chunks}
    if 0 in full:  # what the parts do not say (the embedding's whole-vocabulary gradient)
        full[0] += states.grads - sum(full.values())
    stored = {c: [layer_stored(model, plan, sizes, i) for i in ranges[c]] for c in chunks}
    first_input = embedding_bytes(model, plan, sizes)
    recomputed = layer_recomputed(model, plan, sizes)
    working = layer_working(model, plan, sizes)
    attn_fwd, attn_kept, attn_bwd = attention_working(model, plan, sizes)
    head = head_bytes(model, plan, sizes)
    loss = loss_bytes(model, plan, sizes, logits_held=pp > 1)
    tokens = model.micro_batch * model.seq_len // sizes["cp"]
    inputs = 16 * tokens * (m if pp > 1 else 1)  # token ids and targets (int64)
    if pp > 1:
        # torch's PipelineStage keeps a receive buffer per micro-batch for each chunk's input
        # (all but the first chunk) and its output's gradient (all but the last), made once
        recv = sum((c > 0) + (c < last) for c in chunks)
        inputs += recv * m * embedding_bytes(model, plan, sizes)
    if pp > 1:
        actions = rank_actions(pp, v, m, stage)
    else:
        actions = [a for j in range(m) for a in (Action("F", 0, j), Action("B", 0, j))]
    # FSDP2 units in the gather dtype: a layer's, the root's (the ends, kept from forward to
    # backward), the all-gather buffer, the reduce-scatter's input and output
    unit = parts.layer.numel * gather if fsdp else 0
    root = (parts.head.numel + parts.embedding.numel) * gather if fsdp else 0
    buffer = parts.layer.padded * gather if fsdp else 0
    rs = parts.layer.padded * reduce + parts.layer.padded // parts.shards * reduce if fsdp else 0
    # in a pipeline schedule FSDP2 keeps the stage gathered and its gradients unsharded (in
    # the reduce dtype) until the step's last backward (torch's PipelineStage)
    stage_layers = sum(counts[c] for c in chunks)
    keep = fsdp and (pp > 1 or not plan.reshard_after_forward)
    held = unit * stage_layers if keep else 0
    held_grads = parts.layer.numel * reduce * stage_layers if fsdp and pp > 1 else 0
    persistent = plan.zero >= 1
    in_flight: dict[tuple[int, int], tuple[int, int]] = {}
    done: set[int] = set()
    # torch's interleaved runtime waits for its sends only at the end of the step: every
    # chunk output sent forward and every input gradient sent backward stays until then
    sent, send = 0, first_input if pp > 1 and v > 1 else 0
    best: list[RankMemory] = []

    def grads(chunk: int, made: int) -> int:
        if persistent:
            return states.grads
        have = sum(full[c] for c in done if c != chunk)
        return have + (full[chunk] if chunk in done else made)

    def consider(phase: str, act: float, lossb: int, transient: int, g: int) -> None:
        cand = RankMemory(
            rank, states.params, min(g, states.grads), states.master, states.optimizer,
            act + inputs + sent, lossb, transient, phase,
        )  # fmt: skip
        if not best or cand.total > best[0].total:
            best[:] = [cand]

    for a in actions:
        c, layers = a.chunk, stored[a.chunk]
        others = [x for k, x in in_flight.items() if k != (c, a.mb)]
        o_act, o_loss = sum(x for x, _ in others), sum(y for _, y in others)
        ends = head if c == last else 0
        # a chunk's input: the embedding's output, or a copy of what it received; torch's
        # interleaved runtime runs a chunk on its receive buffer itself (measured)
        chunk_in = 0 if v > 1 and c > 0 else first_input
        kept = chunk_in + sum(layers) + ends
        lf, lh, lb, kept_logits = loss if c == last else (0, 0, 0, 0)
        g = grads(c, 0)
        base_t = root + held + (held_grads if c in done else 0)
        if a.kind == "F":
            for i, layer in enumerate(ranges[c]):
                act = o_act + chunk_in + sum(layers[:i]) + recomputed + attn_fwd
                consider(f"layer {layer} forward", act, o_loss, base_t + (0 if keep else unit + buffer), g)
            if c == last:
                consider("loss forward", o_act + kept, o_loss + lf, base_t, g)
            in_flight[(c, a.mb)] = (kept, lh)
            continue
        if c == last:
            consider("loss backward", o_act + kept, o_loss + lb, base_t, g)
        # the head side's gradients: unsharded in the root until its reduce-scatter with
        # FSDP2, the parameters' own otherwise
        head_t = parts.head.numel * gather if fsdp and c == last else 0
        made = 0 if fsdp else (hg if c == last else 0)
        acc = held_grads if fsdp and pp > 1 else 0
        prev_rs = 0
        mlp_t = parts.mlp.numel * gather
        mlp_g = parts.mlp.sharded * grad_b
        # a pipeline stage keeps its output (the logits) until its backward is done
        o_loss += kept_logits
        for i in reversed(range(len(layers))):
            layer = ranges[c][i]
            below = chunk_in + sum(layers[:i])
            again = recomputed if plan.recompute != "selective" or is_recomputed(plan, layer) else layers[i]
            prefetch = unit if i > 0 and not keep else 0
            down_t = parts.down.numel * gather if fsdp else 0
            down_g = 0 if fsdp else parts.down.sharded * grad_b
            t = base_t + head_t + (0 if keep else unit + prefetch) + down_t + acc
            consider(
                f"layer {layer} backward",
                o_act + below + again + working,
                o_loss,
                t + prev_rs,
                grads(c, made + down_g),
            )
            # its attention's backward, once the MLP's has freed that part (the MLP's weight
            # gradients made; with FSDP2 unsharded until the reduce-scatter)
            attn_t = t + (mlp_t if fsdp else 0)
            consider(f"layer {layer} attention backward", o_act + below + attn_kept + attn_bwd, o_loss,
                     attn_t + prev_rs, grads(c, made + (0 if fsdp else mlp_g)))  # fmt: skip
            made += lg
            if fsdp and not keep:
                # FSDP2 reshards the unit, frees the last reduce-scatter's input, then reduces
                # the unsharded gradients; it keeps this reduce-scatter's input until the next
                t = base_t + head_t + prefetch + unit + rs
                consider(
                    f"layer {layer} reduce-scatter", o_act + below + first_input, o_loss, t, grads(c, made)
                )
                prev_rs = parts.layer.padded * reduce
        if fsdp and not keep and root:
            ends_rs = (parts.head.padded + parts.embedding.padded) * reduce
            t = root + ends_rs + ends_rs // parts.shards  # its gradients, the reduce-scatter's buffers
            consider("root reduce-scatter", o_act, o_loss, t, grads(c, full[c]))
        in_flight.pop((c, a.mb), None)
        done.add(c)
        sent += send * ((c < last) + (c > 0))
    sent = 0
    consider("optimizer step", 0, 0, held, states.grads)
    return best[0]


def rank_memory(model: Model, layout: Layout, rank: int, plan: Parallelism | None = None) -> RankMemory:
    """The peak of ``rank`` of ``layout`` in one training step of ``model`` as ``plan`` says,
    by category (see the module docstring).

    Args:
        model: the model. layout: the layout (dims named after roles, or mapped by ``plan``).
        rank: a rank of ``layout``. plan: roles, schedule, recomputation, dtypes (default
            ``Parallelism()``).

    Returns:
        a :class:`RankMemory`.

    Raises:
        LayoutError: a dim with no role, a rank outside the layout, or sizes the model does
            not admit (:func:`meshgroups.cost._rules.problems`).

    >>> rank_memory(preset("tiny"), Layout(dp_shard=2, tp=2), 0).params   # bf16; norms are not cut by tp
    90688
    """
    plan = plan or Parallelism()
    sizes = plan.sizes(layout)
    check(model, sizes, plan.virtual_stages, plan.layers_per_stage)
    if rank not in layout:
        raise LayoutError(f"rank {rank} is not in {layout!r}")
    return _walk(model, layout, rank, plan)


def peak_memory(model: Model, layout: Layout, plan: Parallelism | None = None) -> RankMemory:
    """The rank of ``layout`` that holds the most: over the pipeline stages, the rank at
    coordinate 0 of every other dim (it holds the largest ``torch.chunk`` pieces).

    Args:
        model, layout, plan: as :func:`rank_memory`.

    Returns:
        that rank's :class:`RankMemory`.

    >>> peak_memory(preset("tiny"), Layout(pp=2, dp_shard=2, tp=2), Parallelism(micro_batches=2)).rank in (0, 4)
    True
    """
    plan = plan or Parallelism()
    dims = plan.dims(layout)
    zero = {d: 0 for d in layout.names}
    stages = range(layout.size(dims["pp"])) if "pp" in dims else [0]
    ranks = [layout.rank_at(**{**zero, **({dims["pp"]: k} if "pp" in dims else {})}) for k in stages]
    return max((rank_memory(model, layout, r, plan) for r in ranks), key=lambda m: m.total)


@dataclass(frozen=True)
class Fit:
    """A fit verdict: ``needed`` = peak allocated × ``overhead`` against ``budget``.

    Args:
        fits: whether ``needed <= budget``. needed: bytes. budget: bytes. overhead: the
            allocator overhead used (1.0: allocated bytes compared as they are).

    >>> Fit(True, 10.0, 12.0, 1.0).basis
    'allocated'
    """

    fits: bool
    needed: float
    budget: float
    overhead: float

    @property
    def basis(self) -> str:
        """What was compared: ``"allocated"`` or ``"reserved (allocated × 1.10)"``."""
        return "allocated" if self.overhead == 1.0 else f"reserved (allocated × {self.overhead:.2f})"


def fit(memory: RankMemory | float, budget: float, allocator_overhead: float = 1.0) -> Fit:
    """Whether a peak fits ``budget`` bytes per rank once the caching allocator's overhead is
    added: torch's allocator reserves more than it hands out (rounding, fragmentation, blocks
    cached per stream), so a device runs out when *reserved* bytes reach its capacity. The
    prediction is peak allocated; ``allocator_overhead`` is the factor reserved/allocated
    assumed (1.0: compare allocated bytes as they are). The verdict says which.

    Args:
        memory: a :class:`RankMemory` (or its total in bytes). budget: bytes per rank.
        allocator_overhead: reserved/allocated, ``>= 1``.

    Returns:
        a :class:`Fit`.

    Raises:
        LayoutError: a budget below 0 or an overhead below 1.

    >>> fit(RankMemory(0, 10, 0, 0, 0, 0.0), 10, 1.1).fits
    False
    """
    if not budget >= 0:
        raise LayoutError(f"budget={budget!r} must be a number of bytes >= 0")
    if not allocator_overhead >= 1:
        raise LayoutError(
            f"allocator_overhead={allocator_overhead!r} must be >= 1 (reserved bytes / allocated bytes)"
        )
    total = memory.total if isinstance(memory, RankMemory) else float(memory)
    needed = total * allocator_overhead
    return Fit(needed <= budget, needed, float(budget), float(allocator_overhead))
