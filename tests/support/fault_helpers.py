"""Shared by the fault tests: the layout they build, a check that its groups are never
cross-wired (an all_gather of global ranks inside every family's group), and a call's outcome."""

from __future__ import annotations

from meshgroups import Layout

LAYOUT = Layout(dp=2, tp=2)
FLATTEN = [("dp", "tp")]


def verify_groups(mg, lay, rank):
    """Members by all_gather inside every family's group equal the layout's: never cross-wired."""
    import torch
    import torch.distributed as dist

    for fam in mg.families:
        if isinstance(fam, str):
            continue
        group, expected = mg.group(*fam), lay.group_of(rank, *fam).tolist()
        assert mg.ranks(*fam) == expected
        if group is None:
            continue
        got = [torch.zeros(1, dtype=torch.int64) for _ in expected]
        dist.all_gather(got, torch.tensor([rank]), group=group)
        assert [int(t) for t in got] == expected, (fam, [int(t) for t in got], expected)
    return True


def _outcome(call):
    """(class name, message) of what ``call`` raised, or ("ok", result)."""
    try:
        return "ok", call()
    except Exception as exc:
        return type(exc).__name__, str(exc)
