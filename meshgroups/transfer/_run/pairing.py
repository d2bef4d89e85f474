"""The check before the first bucket of a transfer: every send pairs with a receive.

Each rank hashes the slices it plans to send and those it plans to receive; one all-reduce of
the two sums over the status group gives every rank the same verdict, so parts of different
plans fail before any data moves (see :func:`check_pairing`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

from meshgroups.errors import TransferError
from meshgroups.transfer._run.buckets import Part
from meshgroups.transfer._run.status import Status, where

_PAIRING_MOD = 1 << 40  # per-rank sums below it: a world of 2^23 ranks sums within int64


def check_pairing(status: Status, parts: Mapping[int, Sequence[Part]], me: int) -> None:
    """Every send pairs with a receive: the hashes of the slices the ranks send and of those
    they receive sum to the same over the status group (one all-reduce; the same verdict on
    every rank). Parts of different plans — other ``plan_transfer`` options on some rank, which
    the digest cannot see — fail here, before any data moves, instead of pairing wrong data.

    Args:
        status: the agreements' group and wait.
        parts: this rank's parts by bucket.
        me: this rank.

    Raises:
        TransferError: (stage ``"check"``, on every rank) the sums differ, or a rank did not
            answer.
    """
    sent = received = 0
    for ps in parts.values():
        for p in ps:
            if p.src == p.dst:
                continue
            text = f"{p.key}|{p.dst}|{p.box}"
            h = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") % _PAIRING_MOD
            if p.src == me:
                sent = (sent + h) % _PAIRING_MOD
            if p.dst == me:
                received = (received + h) % _PAIRING_MOD
    try:
        total_sent, total_received = status.sums([sent, received])
    except Exception as exc:
        raise TransferError(
            f"weight transfer: rank {me} got no status from every rank in {where(-1, 'check')} "
            f"({type(exc).__name__}: {exc}); a rank is gone or stuck",
            (),
            -1,
            "check",
            (),
        ) from exc
    if (total_sent - total_received) % _PAIRING_MOD:
        raise TransferError(
            "weight transfer failed in the check before the first bucket — the ranks' plans do not pair "
            "up: the slices they plan to send are not the slices they plan to receive (parts of different "
            "plans, e.g. plan_transfer called with other options on some rank); nothing was moved",
            (),
            -1,
            "check",
            (),
        )


__all__ = ["check_pairing"]
