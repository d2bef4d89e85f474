"""Pipeline stages and schedules: which layers each model chunk holds, which chunks a stage
runs, and the order of its forwards and backwards as ``torch.distributed.pipelining`` runs them.

A pipeline of ``p`` stages with ``v`` chunks per stage (``v = 1`` for 1F1B) cuts the layers into
``p·v`` chunks, in pipeline order; chunk ``c`` runs on stage ``c % p`` (the interleaved layout).
The first chunk also holds the embedding, the last the final norm, the head and the loss.
Chunks may be uneven (``Parallelism.layers_per_stage``, e.g. Llama 3.1 405B's 126 layers on 8
stages); by default they are as even as the layers allow, the larger ones first.

The order of actions is torch's: :class:`~torch.distributed.pipelining.Schedule1F1B` (stage
``k`` runs ``min(m, p - k)`` forwards, then one backward and one forward in turn, then the
remaining backwards) and :class:`~torch.distributed.pipelining.ScheduleInterleaved1F1B` (its
warm-up of ``(v - 1)·r + 2(p - 1 - k)`` forwards, ``r`` micro-batches per round, then a forward
and a backward per step, each on the chunk its step index names, depth first); the tests compare
these orders with the schedules' own ``pipeline_order``. What a stage keeps in flight follows
from the order::

    >>> [len(a) for a in (rank_actions(4, 1, 8, 0), rank_actions(4, 1, 8, 3))]
    [16, 16]
    >>> max_in_flight(4, 1, 8, 0), max_in_flight(4, 1, 8, 3), max_in_flight(4, 2, 8, 0)
    (4, 1, 11)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NamedTuple

from meshgroups.errors import LayoutError

__all__ = ["Action", "chunk_layers", "chunk_ranges", "max_in_flight", "rank_actions", "stage_chunks"]

Kind = Literal["F", "B"]


class Action(NamedTuple):
    """One action of a stage: a forward (``"F"``) or a full backward (``"B"``) of micro-batch
    ``mb`` on model chunk ``chunk`` (its index in pipeline order)."""

    kind: Kind
    chunk: int
    mb: int


def chunk_layers(layers: int, chunks: int, layers_per_stage: Sequence[int] | None = None) -> list[int]:
    """The layers of each model chunk, in pipeline order.

    Args:
        layers: the model's layers. chunks: ``pp × virtual_stages``.
        layers_per_stage: the split (checked: ``chunks`` entries adding up to ``layers``);
            ``None``: as even as possible, the larger chunks first.

    Returns:
        one count per chunk.

    Raises:
        LayoutError: a split of the wrong length or total, or more chunks than layers.

    >>> chunk_layers(126, 8), chunk_layers(8, 4, [1, 3, 3, 1])
    ([16, 16, 16, 16, 16, 16, 15, 15], [1, 3, 3, 1])
    """
    if layers_per_stage is not None:
        split = list(layers_per_stage)
        if len(split) != chunks or sum(split) != layers or min(split, default=0) < 0:
            raise LayoutError(
                f"layers_per_stage={split} must have {chunks} entries >= 0 adding up to layers={layers}"
            )
        return split
    if chunks > layers:
        raise LayoutError(f"{chunks} pipeline chunks is more than layers={layers}")
    base, extra = divmod(layers, chunks)
    return [base + (1 if c < extra else 0) for c in range(chunks)]


def chunk_ranges(counts: Sequence[int]) -> list[range]:
    """Each chunk's global layer indices.

    Args:
        counts: from :func:`chunk_layers`.

    Returns:
        one ``range`` per chunk.

    >>> chunk_ranges([2, 1, 3])
    [range(0, 2), range(2, 3), range(3, 6)]
    """
    out, start = [], 0
    for n in counts:
        out.append(range(start, start + n))
        start += n
    return out


def stage_chunks(pp: int, virtual_stages: int, stage: int) -> list[int]:
    """The chunks stage ``stage`` runs: ``stage, stage + p, ...``.

    Args:
        pp: stages. virtual_stages: chunks per stage. stage: ``0..pp-1``.

    Returns:
        chunk indices, in pipeline order.

    >>> stage_chunks(4, 2, 1)
    [1, 5]
    """
    return [stage + k * pp for k in range(virtual_stages)]


def _single(pp: int, m: int, stage: int) -> list[Action]:
    # Schedule1F1B: warm-up forwards, then backward-then-forward pairs, then the rest
    warm = min(m, pp - stage)
    out = [Action("F", stage, i) for i in range(warm)]
    f = warm
    for b in range(m):
        out.append(Action("B", stage, b))
        if f < m:
            out.append(Action("F", stage, f))
            f += 1
    return out


def _interleaved(pp: int, v: int, m: int, stage: int) -> list[Action]:
    # ScheduleInterleaved1F1B: rounds of r micro-batches; step i's forward runs chunk
    # (i // r) % v of this stage, its backward the chunks in reverse from the warm-up on
    rounds = max(1, m // pp)
    if m % rounds:
        raise LayoutError(
            f"micro_batches={m} must be a multiple of the {rounds} rounds the interleaved schedule runs"
        )
    per_round = m // rounds
    warm = min((v - 1) * per_round + 2 * (pp - 1 - stage), m * v)
    total = m * v

    def fwd_chunk(i: int) -> int:
        return ((i // per_round) % v) * pp + stage

    def bwd_chunk(i: int) -> int:
        return (v - 1 - ((i - warm) // per_round) % v) * pp + stage

    fmb: dict[int, int] = {}
    bmb: dict[int, int] = {}
    out: list[Action] = []

    def take(counter: dict[int, int], chunk: int) -> int:
        counter[chunk] = counter.get(chunk, 0) + 1
        return counter[chunk] - 1

    for i in range(warm + total):
        if i < total:
            c = fwd_chunk(i)
            out.append(Action("F", c, take(fmb, c)))
        if i >= warm:
            c = bwd_chunk(i)
            out.append(Action("B", c, take(bmb, c)))
    return out


def rank_actions(pp: int, virtual_stages: int, micro_batches: int, stage: int) -> list[Action]:
    """The forwards and backwards stage ``stage`` runs in one step, in order (see the module
    docstring): 1F1B for one chunk per stage, the interleaved schedule for more.

    Args:
        pp: stages. virtual_stages: chunks per stage. micro_batches: m. stage: ``0..pp-1``.

    Returns:
        the actions.

    Raises:
        LayoutError: a stage outside ``0..pp-1``, or an interleaved ``m`` that is not a multiple
            of its rounds. (torch's ``Schedule1F1B`` also refuses fewer micro-batches than
            stages; the order here is defined for them all the same: ``min(m, p - k)`` warm-up
            forwards.)

    >>> rank_actions(2, 1, 2, 0)
    [Action(kind='F', chunk=0, mb=0), Action(kind='F', chunk=0, mb=1), Action(kind='B', chunk=0, mb=0), Action(kind='B', chunk=0, mb=1)]
    """
    if not 0 <= stage < pp:
        raise LayoutError(f"stage={stage} must be in 0..{pp - 1}")
    if virtual_stages == 1:
        return _single(pp, micro_batches, stage)
    return _interleaved(pp, virtual_stages, micro_batches, stage)


def max_in_flight(pp: int, virtual_stages: int, micro_batches: int, stage: int) -> int:
    """The most (chunk, micro-batch) forwards stage ``stage`` holds at once (run and not yet
    backwarded), counted when a backward starts.

    Args:
        pp, virtual_stages, micro_batches, stage: as :func:`rank_actions`.

    Returns:
        the count.

    >>> max_in_flight(8, 1, 32, 0), max_in_flight(8, 4, 32, 0)
    (8, 39)
    """
    live, most = 0, 0
    for a in rank_actions(pp, virtual_stages, micro_batches, stage):
        if a.kind == "F":
            live += 1
        else:
            most = max(most, live)
            live -= 1
    return most
