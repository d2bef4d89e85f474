"""The stream cut (meshgroups.transfer._plan.senders) against a direct simulation: a holder set's units
laid end to end (node-major), one range of equal bytes per holder, cuts on quantum multiples."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from meshgroups.transfer._plan.senders import Stream, StreamSet


@st.composite
def sets(draw: st.DrawFn) -> tuple[list[tuple[Stream, int]], int]:
    """One holder set: several pairs (each ``K`` units of ``length × row`` bytes, ``K`` varying
    between pairs) in one stream."""
    h = draw(st.integers(1, 12))
    quantum_bytes = draw(st.sampled_from([1, 3, 8, 64, 1 << 20]))
    shapes = [
        (draw(st.integers(0, 5)), draw(st.integers(1, 9)), draw(st.sampled_from([1, 2, 4, 6])))
        for _ in range(draw(st.integers(1, 5)))
    ]
    stream = StreamSet.of([(k, length * row) for k, length, row in shapes], h, draw(st.integers(0, 50)))
    out = [
        (stream.pair(i, length, row, max(1, -(-quantum_bytes // row))), k)
        for i, (k, length, row) in enumerate(shapes)
    ]
    return out, h


@settings(max_examples=300, deadline=None)
@given(sets())
def test_stream_tiles_units_and_balances(case: tuple[list[tuple[Stream, int]], int]) -> None:
    pairs, h = case
    load = [0] * h
    largest_quantum = 0
    for s, k in pairs:
        units, lo, hi, holder = (a.tolist() for a in s.fragments(k))
        frags = list(zip(units, lo, hi, holder))
        # every unit is tiled exactly once, fragments in order
        for u in range(k):
            mine = [(a, b, who) for uu, a, b, who in frags if uu == u]
            assert mine and mine[0][0] == 0 and mine[-1][1] == s.length
            assert all(a < b for a, b, _ in mine)
            assert all(mine[i][1] == mine[i + 1][0] for i in range(len(mine) - 1))
            assert s.unit(u, k) == mine  # the receiver's lookup
            largest_quantum = max(largest_quantum, s.quantum_nbytes)
        for a, b, who in ((a, b, who) for _, a, b, who in frags):
            load[who] += (b - a) * s.row
        # the sender's lookup agrees with the whole list
        for j in range(h):
            assert s.sent_by(j, k) == [(u, a, b) for u, a, b, who in frags if who == j]
    total = sum(load)
    assert total == pairs[0][0].set.total
    # node-major: unit k of every pair comes before unit k + 1 of any
    starts = sorted((int(s._offset(k)), k) for s, n in pairs for k in range(n))
    assert [k for _, k in starts] == sorted(k for _, k in starts)
    for v in load:
        assert total // h - largest_quantum <= v <= -(-total // h) + largest_quantum


def test_fine_quantum_is_exact_share() -> None:
    """Rows of one byte, quantum one index: every holder sends ⌊X/h⌋ or ⌈X/h⌉ bytes."""
    s = StreamSet.of([(3, 100)], h=7, start=3).pair(0, 100, 1, 1)
    load = [0] * 7
    for _, lo, hi, who in zip(*(a.tolist() for a in s.fragments(3))):
        load[who] += hi - lo
    assert sorted(set(load)) == [42, 43] and sum(load) == 300


def test_huge_quantum_keeps_units_whole() -> None:
    """A quantum larger than any unit: no unit is cut, each goes to the holder whose range
    holds its middle byte."""
    s = StreamSet.of([(5, 8)], h=3, start=0).pair(0, 4, 2, 1 << 40)
    units, lo, hi, holder = (a.tolist() for a in s.fragments(5))
    assert units == [0, 1, 2, 3, 4] and set(lo) == {0} and set(hi) == {4}
    assert holder == [0, 0, 1, 2, 2]  # middles 4, 12, 20, 28, 36 in [0, 13), [13, 26), [26, 40)
