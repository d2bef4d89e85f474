"""The verdict on a real TCPStore, ranks as threads (each with its own client connection): one
decision everywhere; a slow rank that is alive is waited for until the timeout and then lost on
every rank, and told so (``ExcludedError``); a dead rank (stale heartbeat) is lost without waiting
for the timeout; ``commit`` passes when every member arrives and stops at a published failure.
Cohorts: validation and the store namespace."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from meshgroups.elastic._verdict import (
    Heartbeat,
    StepAbortedError,
    agree_lost,
    commit,
    failed_step,
    publish_failure,
)
from meshgroups.errors import ExcludedError
from meshgroups.mesh._cohort import Cohort, current_cohort, use_cohort

from ..support.timing import scaled


@pytest.fixture
def store():
    master = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    yield master


def _client(master):
    return dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=60))


def _verdicts(master, epoch, members, ranks, **kw):
    """agree_lost on each of ``ranks`` at once (threads); {rank: Verdict or exception}."""
    return _on_threads(ranks, lambda r: agree_lost(_client(master), epoch, members, r, **kw), scaled(60))


def _on_threads(ranks, fn, join_timeout):
    """``fn(rank)`` for each of ``ranks`` at once, one thread each; {rank: result or exception}."""
    out = {}

    def one(r):
        try:
            out[r] = fn(r)
        except Exception as exc:
            out[r] = exc

    threads = [threading.Thread(target=one, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=join_timeout)
    return out


def test_a_slow_live_rank_is_waited_for_then_lost_everywhere_and_told(store):
    beats = [Heartbeat(_client(store), r, scaled(0.05)) for r in (0, 1, 2)]
    try:
        publish_failure(store, 0, 1, RuntimeError("Connection closed by peer"))
        started = time.monotonic()
        out = _verdicts(store, 0, (0, 1, 2), (0, 1), timeout=scaled(1.5), stale_after=scaled(5))
        elapsed = time.monotonic() - started
        assert out[0] == out[1]
        assert out[0].lost == (2,) and out[0].survivors == (0, 1), out[0]
        assert "did not report" in out[0].why and "Connection closed" in out[0].cause
        assert scaled(1.5) <= elapsed < scaled(1.5) + scaled(5)  # waited for the live rank
        late = _verdicts(store, 0, (0, 1, 2), (2,), timeout=scaled(1.5), stale_after=scaled(5))[2]
        assert isinstance(late, ExcludedError) and "rank 2 was declared lost in epoch 0" in str(late), late
        assert f"({out[0].why})" in str(late), late  # the rule, read from the closed roll itself
    finally:
        for b in beats:
            b.stop()


def test_a_dead_rank_is_lost_when_its_heartbeat_stops_not_at_the_timeout(store):
    beats = {r: Heartbeat(_client(store), r, scaled(0.05)) for r in (0, 1, 2, 3)}
    beats[3].stop()  # rank 3 "died": its heartbeat no longer changes
    try:
        started = time.monotonic()
        out = _verdicts(store, 4, (0, 1, 2, 3), (0, 1, 2), timeout=scaled(30), stale_after=scaled(1))
        assert time.monotonic() - started < scaled(10)
        assert {v.lost for v in out.values()} == {(3,)}, out
        assert "rank 3 stopped responding" in out[0].why
    finally:
        for b in beats.values():
            b.stop()


def test_every_member_reports_nobody_is_lost(store):
    out = _verdicts(store, 2, (0, 1, 2), (0, 1, 2), timeout=scaled(20), stale_after=scaled(10))
    assert {v.lost for v in out.values()} == {()} and out[0].why == "every member reported"


def test_commit_passes_together_and_stops_at_a_failure(store):
    beats = [Heartbeat(_client(store), r, scaled(0.05)) for r in (0, 1)]
    try:
        results = {}

        def one(r, number):
            try:
                commit(_client(store), 7, number, (0, 1), r, timeout=scaled(20), stale_after=scaled(10))
                results[(r, number)] = "ok"
            except StepAbortedError as exc:
                results[(r, number)] = str(exc)

        threads = [threading.Thread(target=one, args=(r, 0)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=scaled(30))
        assert results == {(0, 0): "ok", (1, 0): "ok"}
        waiter = threading.Thread(target=one, args=(0, 1))  # rank 1 never commits: it failed
        waiter.start()
        time.sleep(scaled(0.3))
        publish_failure(store, 7, 1, RuntimeError("boom"))
        waiter.join(timeout=scaled(30))
        assert "a peer failed in epoch 7" in results[(0, 1)]
    finally:
        for b in beats:
            b.stop()


def test_the_failed_step_is_the_earliest_any_rank_published_and_the_first_cause_counts(store):
    assert failed_step(store, 3) is None
    first = publish_failure(_client(store), 3, 1, RuntimeError("boom"), step=5)
    assert first == "rank 1: RuntimeError: boom" and failed_step(store, 3) == 5
    # ranks that saw it in an earlier step lower it, concurrently; a later step does not raise it
    _on_threads((0, 2, 4), lambda r: publish_failure(_client(store), 3, r, None, step=r + 2), scaled(30))
    assert failed_step(store, 3) == 2
    assert publish_failure(store, 3, 6, None, step=9) == first and failed_step(store, 3) == 2
    assert failed_step(store, 4) is None  # epochs are apart


def test_cohorts():
    c = Cohort((0, 1, 2, 3, 6, 7), epoch=1)
    assert c.leader == 0 and c.tag == "e1-" and 5 not in c and len(c) == 6
    assert Cohort((0, 1), 0).tag == ""
    with use_cohort(c):
        assert current_cohort() is c
    assert current_cohort() is None
    for bad in ((), (1, 0), (0, 0), (-1, 2)):
        with pytest.raises(ValueError, match="distinct non-negative ranks"):
            Cohort(bad, 1)
    with pytest.raises(ValueError, match="epoch"):
        Cohort((0,), -1)


def _meet(master, members, ranks, watch, timeout, base):
    """``Meeting.agree`` of one meeting on each of ``ranks`` at once (threads); {rank: result or
    exception}. ``members`` may hold ranks that never come."""
    from meshgroups.mesh._rendezvous import Meeting

    def one(r):
        meeting = Meeting(
            _client(master), r, len(members), "test call #1", base, timeout, members=members, watch=watch
        )
        return meeting.agree({"x": "1"}, {"x": "1"}, {})

    return _on_threads(ranks, one, timeout.total_seconds() + scaled(30))


def test_a_meeting_stops_waiting_for_a_rank_whose_heartbeat_stopped(store):
    """A cohort's meeting with a liveness probe: rank 3 never arrives and never beats (dead), so
    ranks 0-2 raise the same RendezvousTimeoutError naming it as dead, without waiting out the
    meeting's timeout (10 minutes here: a test that ends at all ended early). With every member
    present the probe never fires and the meeting passes."""
    from meshgroups.elastic._verdict import Staleness
    from meshgroups.errors import RanksGoneError, RendezvousTimeoutError

    beats = [Heartbeat(_client(store), r, scaled(0.05)) for r in (0, 1, 2)]
    try:
        probe_store = _client(store)
        out = _meet(  # (the first two to arrive watch; the third waits on the key they set)
            store,
            (0, 1, 2, 3),
            (0, 1, 2),
            lambda: Staleness(probe_store, scaled(1)).stale,
            timedelta(seconds=600),
            "t/rdzv/1/1",
        )
        for r in (0, 1, 2):
            assert isinstance(out[r], RanksGoneError) and isinstance(out[r], RendezvousTimeoutError), out
            assert "rank 3 never reached the cross-rank check of test call #1" in str(out[r]), out[r]
            assert "rank 3 stopped responding" in str(out[r])
        # every rank present: the probe never fires, the meeting passes
        probe = lambda: Staleness(probe_store, scaled(1)).stale  # noqa: E731
        out = _meet(store, (0, 1), (0, 1), probe, timedelta(seconds=60), "t/rdzv/2/1")
        assert out == {0: {}, 1: {}}, out
    finally:
        for b in beats:
            b.stop()
