"""The ``meshgroups`` backend's protocol between trainer ranks and engine workers (vLLM-free).

Three exchanges over the transfer world, each one small ``all_gather_object`` that every
trainer rank and every worker makes, so that every rank decides the same thing from the same
data — and a refusal on either side reaches every rank *before* anything else happens:

1. **Init** (``init_weight_transfer_engine``): each worker offers :class:`WorkerOffer` — what
   it holds (its ``Param`` s), the version it serves, or why it refuses (a layer this backend
   cannot describe); trainer rank 0 offers :class:`TrainerOffer` (its layout, ``WeightSync``
   settings, family map). A refusal of any worker is raised on every trainer rank; the
   workers record it and return normally (see below).
2. **Preflight** of each update (:func:`decide_version`): trainer ranks propose the version
   they were asked for (``sync(version=n)``, or ``None``: the next one), workers the version
   they serve. The update's version is the proposal, or one more than the newest version any
   side knows — so **versions never go backwards**, across ``VLLMWeightSync`` objects and
   trainer restarts: they are taken from what the engine serves. A proposal not newer than what
   the engine serves is refused (:class:`VersionError`) on every rank before any byte moves.
3. **Commit reports**: after ``finish_weight_update`` each worker writes
   ``{"version", "bytes_received", "buckets", "shard_bytes", "checksum"}`` under
   :func:`report_key` in the transfer world's store; trainer rank 0 checks that every worker
   committed the version before it tells the other trainer ranks the outcome.

**The engine's RPC channel stays clean.** A worker never raises from vLLM's weight-transfer
calls for a handled refusal or failure (vLLM's ``collective_rpc`` stops at the first failing
worker and leaves the others' failures queued for the next call, and its engine core logs a
traceback per failure): it logs one line, records the error, and returns. The trainer learns
of it through the exchanges above, which every rank makes anyway.

**Versions** are ints, ``0`` for the weights vLLM loaded itself; vLLM's own record
(``llm.get_weight_version()``, each output's ``weight_versions``) is ``str(version)``, set only
once every worker committed — so a generated sequence is attributed to the version that made it.

    >>> decide_version([None, None], [3, 3], trainer_version=2)
    4
    >>> decide_version([7, 7], [3, 3], trainer_version=2)
    7
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

import meshgroups.errors as errors
from meshgroups.errors import LayoutError, MeshConfigError, MismatchError, StoreConnectionError, VersionError
from meshgroups.transfer import TransferError


@dataclass(frozen=True)
class WorkerOffer:
    """What an engine worker sends at init.

    Attributes:
        params: its parameters (``destination.Param`` s), ``None`` when it refuses.
        version: the version it serves (its last commit; ``0``: vLLM's own load).
        refusal: ``(error class name, message)`` when it cannot take part, else ``None``.
        lora: its LoRA slots (``{"max_rank", "dtype"}``), ``None`` when LoRA is off.
    """

    params: Any
    version: int
    refusal: tuple[str, str] | None = None
    lora: dict[str, Any] | None = None


@dataclass(frozen=True)
class TrainerOffer:
    """What trainer rank 0 sends at init: its layout, ``WeightSync`` settings, family map
    (JSON or ``None``), the version vLLM's front end reports (``-1``: unknown) and, for an
    adapter sync, the adapter (``_lora.LoRA.spec``; ``None``: the base model)."""

    layout: Any
    settings: dict[str, Any]
    family: str | None
    front_version: int = -1
    lora: dict[str, Any] | None = None


#: Error classes an outcome is rebuilt as on every rank (name -> class), besides those of
#: ``meshgroups.errors``; others become ``RuntimeError`` naming the class.
KINDS: dict[str, type[BaseException]] = {
    cls.__name__: cls
    for cls in (
        LayoutError,
        MeshConfigError,
        MismatchError,
        StoreConnectionError,
        VersionError,
        ValueError,
        TypeError,
        RuntimeError,
        TimeoutError,
    )
}


def describe(exc: BaseException) -> tuple[str, str]:
    """``(class name, message)`` of an error, what travels between ranks.

    >>> describe(LayoutError("no"))
    ('LayoutError', 'no')
    """
    return type(exc).__name__, str(exc)


def rebuild(kind: str, message: str, stage: str = "commit") -> BaseException:
    """The error described by :func:`describe`, as a new instance (a ``TransferError`` keeps
    ``stage``; an unknown class becomes ``RuntimeError`` naming it).

    >>> rebuild("LayoutError", "no")
    LayoutError('no')
    """
    if kind == "TransferError":
        return TransferError(message, (), -1, stage, ())
    cls = KINDS.get(kind) or getattr(errors, kind, None)
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        return RuntimeError(f"{kind}: {message}")
    try:
        return cls(message)
    except TypeError:  # a constructor of other arguments
        return RuntimeError(f"{kind}: {message}")


def first_refusal(offers: Sequence[Any]) -> tuple[int, tuple[str, str]] | None:
    """The first worker (index, ``(class, message)``) that refused, else ``None``."""
    for r, offer in enumerate(offers):
        if isinstance(offer, WorkerOffer) and offer.refusal is not None:
            return r, offer.refusal
    return None


def decide_version(proposals: Sequence[int | None], served: Sequence[int], trainer_version: int = 0) -> int:
    """The version an update makes, the same on every rank (see the module docstring).

    Args:
        proposals: each trainer rank's ``sync(version=)`` (``None``: the next one).
        served: each worker's committed version.
        trainer_version: the last version the trainer's sync object committed.

    Returns:
        The version.

    Raises:
        VersionError: trainer ranks proposed different versions, or a proposal not newer than
            what some worker serves.

    >>> decide_version([2], [3])
    Traceback (most recent call last):
    ...
    meshgroups.errors.VersionError: sync(version=2) is not newer than version 3, which the engine serves (worker 0); versions only increase: sync(version=n) with n > 3, or sync() for the next one
    """
    if len(set(proposals)) > 1:
        raise VersionError(
            f"trainer ranks asked for different versions {list(proposals)}: every rank passes the same "
            "sync(version=...)"
        )
    newest = max([trainer_version, *served])
    want = proposals[0] if proposals else None
    if want is None:
        return newest + 1
    if isinstance(want, bool) or not isinstance(want, int) or want < 1:
        raise VersionError(f"sync(version={want!r}): a version is an int >= 1")
    stale = [(r, v) for r, v in enumerate(served) if v >= want]
    if stale:
        r, v = max(stale, key=lambda x: x[1])
        raise VersionError(
            f"sync(version={want}) is not newer than version {v}, which the engine serves (worker {r}); versions "
            f"only increase: sync(version=n) with n > {max(served)}, or sync() for the next one"
        )
    return int(want)


def gather(item: object, size: int) -> list[Any]:
    """One ``all_gather_object`` over the current default group (the transfer world, inside
    ``TransferWorld.active()``)."""
    out: list[Any] = [None] * size
    dist.all_gather_object(out, item)
    return out


def preflight(rank: int, size: int, trainer_size: int, proposal: int | None, version: int) -> int:
    """The preflight of one update, on this rank, inside the transfer world: every rank offers
    ``(proposal, version)`` — a trainer rank its ``sync(version=)`` and its sync object's
    version, a worker ``None`` and the version it serves — and every rank decides the same
    version (:func:`decide_version`) or raises the same :class:`VersionError`.

    Args:
        rank: this rank in the transfer world.
        size: the transfer world's size.
        trainer_size: its trainer ranks (``[0, trainer_size)``).
        proposal: see above.
        version: see above.

    Returns:
        The version of this update.

    Raises:
        VersionError: see :func:`decide_version`.
        TransferError: stage ``"check"``, a peer is gone (the gather failed).
    """
    try:
        offers = gather((proposal, int(version)), size)
    except Exception as exc:
        raise TransferError(
            f"weight sync preflight: transfer rank {rank} got no answer from every rank ({type(exc).__name__}: "
            f"{exc}); a trainer rank or an engine worker is gone",
            (),
            -1,
            "check",
            (),
        ) from exc
    trainer = offers[:trainer_size]
    return decide_version(
        [p for p, _ in trainer], [v for _, v in offers[trainer_size:]], max(v for _, v in trainer)
    )


def agree(error: BaseException | None, group: dist.ProcessGroup | None = None) -> None:
    """Every trainer rank raises the same error, or none does (one ``all_gather_object`` over
    the trainer's ``group``). The error chosen is rank 0's (it talks to the engine), else the
    lowest failing rank's; a rank whose own error is that one raises it as it is.

    Args:
        error: this rank's error, or ``None``.
        group: the trainer's group (default: its default group).

    Raises:
        The chosen error, on every rank.
    """
    seen: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(seen, None if error is None else (*describe(error), _stage(error)), group=group)
    chosen = next((s for s in seen if s is not None), None)
    if chosen is None:
        return
    kind, message, stage = chosen
    if error is not None and describe(error) == (kind, message):
        raise error
    raise rebuild(kind, message, stage)


def _stage(error: BaseException) -> str:
    return str(getattr(error, "stage", "commit"))


def report_key(tp_rank: int) -> str:
    """The store key of worker ``tp_rank``'s last commit report (see the module docstring)."""
    return f"meshgroups/engine/{tp_rank}/report"


def pid_key(tp_rank: int) -> str:
    """The store key of worker ``tp_rank``'s process id (written at init)."""
    return f"meshgroups/engine/{tp_rank}/pid"


__all__ = [
    "KINDS",
    "TrainerOffer",
    "VersionError",
    "WorkerOffer",
    "agree",
    "decide_version",
    "describe",
    "first_refusal",
    "gather",
    "pid_key",
    "preflight",
    "rebuild",
    "report_key",
]
