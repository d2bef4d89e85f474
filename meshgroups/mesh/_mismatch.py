"""The ``MismatchError`` of a meeting whose ranks made a call differently (``_rendezvous.py``).

Every rank that differs from the meeting's leader appended ``[rank, {argument: digest}]`` to the
meeting's ``bad`` key; every rank reads the same lines and builds the same error from them: the
first differing argument in the leader's order (the call site first when it differs: a rank
that skipped a call pairs its next call with another one, and its arguments differ as a
consequence), the odd ranks, and what the odd and the usual rank passed::

    >>> error = mismatch_error(
    ...     '[1, {"timeout": "d2"}]\\n',
    ...     lambda r: {"timeout": "20s" if r == 1 else "10s"},
    ...     {"operation": "init_mesh", "timeout": "d1"},
    ...     leader=0, world_size=4, what="init_mesh call #3", rank=2,
    ... )
    >>> str(error).split(";")[0]
    "init_mesh call #3 was made with a different 'timeout' on rank 1: rank 1 has timeout=20s but rank 0 has timeout=10s"
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping

from meshgroups.errors import MismatchError
from meshgroups.mesh._waiting import rank_list


def mismatch_error(
    bad: str,
    shown_of: Callable[[int], Mapping[str, str]],
    reference: Mapping[str, str],
    *,
    leader: int,
    world_size: int,
    what: str,
    rank: int,
) -> MismatchError:
    """The error of a meeting from its ``bad`` lines; ``shown_of(rank)``: what that rank
    published to be shown (its ``mine`` key), ``reference``: the leader's digests."""
    by_arg: dict[str, dict[int, str]] = {}
    for line in bad.splitlines():
        r, args = json.loads(line)
        for arg, digest in args.items():
            by_arg.setdefault(arg, {})[int(r)] = digest
    order = list(reference)
    first = min(by_arg, key=lambda a: order.index(a) if a in order else len(order))
    if "call_site" in by_arg and first != "operation":
        first = "call_site"  # a call paired with another: its arguments differ as a consequence
    ranks = sorted(by_arg[first])
    odd, usual = ranks[0], leader
    if len(ranks) > world_size // 2 and len(set(by_arg[first].values())) == 1:
        # Most ranks agree with each other, not with the leader: the leader is the odd one out.
        odd, usual, ranks = leader, ranks[0], [leader]
    odd_shown, usual_shown = shown_of(odd), shown_of(usual)
    others = [a for a in by_arg if a != first]
    if first == "call_site":
        then = f" (as a result its arguments differ too: {', '.join(others)})" if others else ""
        return MismatchError(
            f"{what} pairs different calls (call_site): {rank_list(ranks)} made it as "
            f"{odd_shown.get('call_site')}, rank {usual} as {usual_shown.get('call_site')}{then}; "
            f"this is rank {rank}. A rank skipped a collective call, or made one the others "
            "did not: every rank must make the same collective calls in the same order",
            argument="call_site",
            ranks=tuple(ranks),
        )
    if first == "operation":
        advice = (
            "every rank must make the same collective calls in the same order; did a rank skip a "
            "call, or make one the others did not?"
        )
    else:
        advice = "every rank must make this call with the same arguments"
    return MismatchError(
        f"{what} was made with a different {first!r} on {rank_list(ranks)}: rank {odd} has "
        f"{first}={odd_shown.get(first)} but rank {usual} has {first}={usual_shown.get(first)}"
        + (f" (also differing: {', '.join(others)})" if others else "")
        + f"; this is rank {rank}. {advice[0].upper()}{advice[1:]}",
        argument=first,
        ranks=tuple(ranks),
    )


__all__ = ["mismatch_error"]
