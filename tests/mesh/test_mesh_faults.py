"""Faults on real gloo processes (world 4): a rank that raises before, during or after the check,
never arrives, arrives late, dies (also while creating groups); retries; two threads; argument
mismatches; close() cycles; the torchrun demo exiting 0 every time. Every collective call in
step (issue 18's one-rank errors and skipped calls) is in ``test_mesh_faults_in_step.py``.

Every group is verified by an all_gather of global ranks inside it, so a cross-wired group
(members other than declared) fails the test. Every wait has a timeout; elapsed times are
checked against it; every time is scaled by MESHGROUPS_TEST_TIME_SCALE (``scaled``).
"""

from __future__ import annotations

import contextlib
import time

import pytest

from meshgroups import Layout

from ..support.dist import run, scaled
from ..support.fault_helpers import FLATTEN, LAYOUT, _outcome, verify_groups

pytestmark = pytest.mark.processes  # every test here starts processes


def _subsets(lay):
    return {"first": (lay.select("dp", 0), "tp")}


def _timed(call):
    start = time.monotonic()
    try:
        call()
        return None, time.monotonic() - start
    except Exception as exc:
        return exc, time.monotonic() - start


def worker_retries(rank, world):
    import random

    import torch.distributed as dist

    from meshgroups import LayoutError, MeshBuildError, MismatchError, init_mesh

    out = {}
    # 1. A rank raises before the check (a bad argument there only): every rank raises the same
    #    class at once, not after the timeout.
    flatten = FLATTEN if rank != 2 else [("dp", "xp")]
    exc, elapsed = _timed(lambda: init_mesh(LAYOUT, flatten=flatten, timeout=scaled(20)))
    assert isinstance(exc, LayoutError), repr(exc)
    out["early"] = (type(exc).__name__, str(exc), elapsed)
    # 2. The identical retry builds correct groups (the failed call used up its number everywhere).
    with init_mesh(LAYOUT, flatten=FLATTEN, timeout=scaled(20)) as mg:
        verify_groups(mg, LAYOUT, rank)

    # 3. A rank raises inside group creation, after the check; the others are left waiting for
    #    it. Every rank raises MeshBuildError, within the timeout plus a margin.
    real_new_group = dist.new_group
    calls = {"n": 0}

    def failing_new_group(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected failure in group creation")
        return real_new_group(*args, **kwargs)

    from meshgroups.mesh._torch_seam import held_group_count

    for strategy in ("global", "local"):
        calls["n"] = 0
        held = held_group_count()
        if rank == 1:
            dist.new_group = failing_new_group
        try:
            exc, elapsed = _timed(
                lambda s=strategy: init_mesh(LAYOUT, flatten=FLATTEN, timeout=scaled(4), strategy=s)
            )
        finally:
            dist.new_group = real_new_group
        assert isinstance(exc, MeshBuildError), repr(exc)
        assert "failed on rank 1 while creating groups" in str(exc) and "injected failure" in str(exc)
        assert elapsed < scaled(4 + 6), elapsed
        out[f"during_{strategy}"] = elapsed
        assert held_group_count() == held  # the failed call destroyed what it had created
        # 4. The identical retry on every rank: correct groups, never cross-wired.
        with init_mesh(
            LAYOUT, flatten=FLATTEN, subsets=_subsets(LAYOUT), timeout=scaled(20), strategy=strategy
        ) as mg:
            verify_groups(mg, LAYOUT, rank)

    # 5. Property: one argument differs on one rank -> every rank raises MismatchError naming it.
    rnd = random.Random(1234)  # same draws on every rank
    alternatives = {
        "layout": {"layout": Layout(dp=4, tp=1)},
        "flatten": {"flatten": []},
        "subsets": {"subsets": {}},
        "only": {"only": [("tp",)]},
        "strategy": {"strategy": "local"},
        "gloo_twins": {"gloo_twins": True},
        "backend": {"backend": "gloo"},
        "device_type": {"device_type": "meta"},
        "timeout": {"timeout": scaled(21)},
    }
    seen = []
    for _ in range(12):
        argument = rnd.choice(sorted(alternatives))
        bad_rank = rnd.randrange(world)
        kwargs = {"layout": LAYOUT, "flatten": FLATTEN, "subsets": _subsets(LAYOUT), "timeout": scaled(20)}
        if argument == "only":
            kwargs["flatten"] = ()  # only= and flatten= exclude each other
        if rank == bad_rank:
            kwargs.update(alternatives[argument])
        exc, _ = _timed(lambda kwargs=kwargs: init_mesh(kwargs.pop("layout"), **kwargs))
        assert isinstance(exc, MismatchError), (argument, bad_rank, repr(exc))
        assert exc.argument == argument and exc.ranks == (bad_rank,), (argument, bad_rank, str(exc))
        assert f"different {argument!r} on rank {bad_rank}" in str(exc)
        seen.append(argument)
    with init_mesh(LAYOUT, flatten=FLATTEN, timeout=scaled(20)) as mg:
        verify_groups(mg, LAYOUT, rank)

    # 6. A global build whose subset leaves some ranks with fewer groups, then a local build:
    #    held-group counts differ, and the local strategy levels them instead of failing.
    lay = Layout(a=2, b=2)
    keep = init_mesh(lay, subsets={"only_first": (lay.select("a", 0), "b")}, timeout=scaled(20))
    with init_mesh(lay, strategy="local", timeout=scaled(20)) as mg:
        verify_groups(mg, lay, rank)
    keep.close()
    out["mismatches"] = sorted(set(seen))
    return out


def test_failures_then_retries_never_cross_wire():
    results = run(worker_retries, 4, timeout=240)
    for rank, out in enumerate(results):
        name, message, elapsed = out["early"]
        assert name in ("LayoutError", "UnknownDimError") and elapsed < scaled(5), (rank, name, elapsed)
        if rank != 2:
            assert "rank 2 failed before the cross-rank check" in message and "unknown dim 'xp'" in message
    assert len(results[0]["mismatches"]) >= 6  # the property covered most arguments


def worker_late_and_missing(rank, world):
    import re
    import threading

    from meshgroups import ConcurrentInitError, RanksGoneError, RendezvousTimeoutError, init_mesh

    out = {}
    # 1. Rank 3 never arrives; no timeout given: the default group's (scaled(4) s) bounds the wait.
    if rank != 3:
        exc, elapsed = _timed(lambda: init_mesh(LAYOUT))
        assert isinstance(exc, RendezvousTimeoutError) and not isinstance(exc, RanksGoneError), repr(exc)
        assert "rank 3 never arrived" in str(exc) and f"timeout {scaled(4):g}s" in str(exc), str(exc)
        # The timeout decided it, not liveness (rank 3 is alive): the rank that gave up did so at
        # its own deadline. (This rank's own wait may be shorter: under load it may have entered
        # the call late, after the decider, and it ends at the decision.)
        gave_up = float(re.search(r"gave up after ([0-9.]+)s", str(exc)).group(1))
        assert gave_up >= scaled(4) - 0.1 and elapsed < scaled(4 + 3), (gave_up, elapsed)
        out["missing"] = elapsed
    else:
        time.sleep(scaled(5))
        # Now it comes, late, for the same call: it must not pass alone.
        exc, elapsed = _timed(lambda: init_mesh(LAYOUT))
        assert isinstance(exc, RendezvousTimeoutError), repr(exc)
        assert "gave up waiting" in str(exc) and elapsed < scaled(1), (str(exc), elapsed)
    # 2. Everyone in step again: the next call works.
    with init_mesh(LAYOUT, flatten=FLATTEN, timeout=scaled(20)) as mg:
        verify_groups(mg, LAYOUT, rank)

    # 3. Two threads: rank 0 is slow, so on ranks 1-3 the first call is still waiting when a
    #    second thread calls; that one is refused at once and takes no generation number.
    results = {}

    def first_call():
        if rank == 0:
            time.sleep(scaled(2))
        results["mg"] = init_mesh(LAYOUT, timeout=scaled(20))

    thread = threading.Thread(target=first_call)
    thread.start()
    if rank != 0:
        time.sleep(scaled(0.5))
        exc, elapsed = _timed(lambda: init_mesh(LAYOUT, timeout=scaled(20)))
        assert isinstance(exc, ConcurrentInitError) and elapsed < scaled(0.5), repr(exc)
    thread.join(scaled(30))
    verify_groups(results["mg"], LAYOUT, rank)
    results["mg"].close()
    with init_mesh(LAYOUT, timeout=scaled(20)) as mg:  # and the next call still pairs up
        verify_groups(mg, LAYOUT, rank)
    return out


def test_late_missing_and_concurrent_calls():
    run(worker_late_and_missing, 4, timeout=180, pg_timeout=4)


def worker_rank_dies(rank, world, victim):
    import os

    from meshgroups import RendezvousTimeoutError, StoreConnectionError, init_mesh

    with init_mesh(LAYOUT, timeout=scaled(10)) as mg:
        verify_groups(mg, LAYOUT, rank)
    leaving_first = None
    if victim == 0:
        # Every rank fails one call alike; ranks 1-3 are still reading the closing call's
        # counters when rank 0, the store's host, leaves it and exits: they raise the call's own
        # error, not the store's loss (CI caught the lost store in a docs block).
        from meshgroups.mesh._collective import Call
        from meshgroups.mesh._torch_seam import default_store

        store, peek, deadline = default_store(), Call._peek, time.monotonic() + scaled(30)

        def held_peek(self, name):  # ranks 1-3: held until rank 0's process (the store) is gone
            store.add("held", 1)
            with contextlib.suppress(RuntimeError):
                while time.monotonic() < deadline:
                    store.add("held", 0)
                    time.sleep(0.05)
            Call._peek = peek
            return peek(self, name)

        if rank != 0:
            Call._peek = held_peek
        while rank == 0 and int(store.add("held", 0)) < world - 1 and time.monotonic() < deadline:
            time.sleep(0.05)  # rank 0 fails the call last, and leaves it at once
        leaving_first, _ = _timed(lambda: init_mesh(Layout(tp=8), timeout=scaled(10)))
        Call._peek = peek
    if rank == victim:
        os._exit(1)
    if leaving_first is not None:
        assert not isinstance(leaving_first, StoreConnectionError), repr(leaving_first)
        assert "uses rank 7, outside the default group" in str(leaving_first), repr(leaving_first)
    exc, elapsed = _timed(lambda: init_mesh(LAYOUT, timeout=scaled(3)))
    expected = StoreConnectionError if victim == 0 else RendezvousTimeoutError
    assert isinstance(exc, expected), repr(exc)
    if victim != 0:  # named as gone (liveness), not after the timeout
        assert f"rank {victim} never reached" in str(exc) and f"rank {victim} exited" in str(exc), str(exc)
        # rank 0 hosts the store: it waits for the other survivors before its process exits
        from meshgroups.mesh._torch_seam import default_store

        store = default_store()
        store.add("survivors_done", 1)
        deadline = time.monotonic() + scaled(20)
        while int(store.add("survivors_done", 0)) < world - 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        if rank != 0:
            store.add("survivors_left", 1)  # after this rank's last store call
        while rank == 0 and int(store.add("survivors_left", 0)) < world - 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert elapsed < scaled(3 + 3), elapsed
    return type(exc).__name__


def test_a_rank_that_dies_is_reported_not_waited_for():
    assert run(worker_rank_dies, 4, 3, timeout=90, may_exit={3})[:3] == ["RanksGoneError"] * 3


def test_losing_the_store_host_is_not_a_timeout():
    assert run(worker_rank_dies, 4, 0, timeout=90, may_exit={0})[1:] == ["StoreConnectionError"] * 3


def _resources():
    import os

    from meshgroups.mesh._torch_seam import default_store, held_group_count

    return {
        "groups": held_group_count(),
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": len(os.listdir("/proc/self/task")),
        "keys": len(default_store().list_keys()),
    }


def worker_cycles(rank, world, cycles):
    import torch.distributed as dist

    from meshgroups import GroupCache, init_mesh

    out = {}
    lay = Layout(dp=2, tp=2).with_views(expert=Layout(ep=4))
    for strategy in ("global", "local"):
        with init_mesh(
            lay, flatten=FLATTEN, subsets=_subsets(lay), strategy=strategy, timeout=scaled(20)
        ) as mg:
            verify_groups(mg, lay, rank)  # warm-up: gloo's first-collective threads are not leaks
        dist.barrier()
        before = _resources()
        # Every rank measures before any starts the next call, whose store keys would count.
        dist.barrier()
        for _ in range(cycles):
            with init_mesh(
                lay, flatten=FLATTEN, subsets=_subsets(lay), strategy=strategy, timeout=scaled(20)
            ) as mg:
                verify_groups(mg, lay, rank)
        dist.barrier()
        after = _resources()
        dist.barrier()
        out[strategy] = (before, after)
    # Two meshes sharing a cache: closing one keeps the groups the other still uses.
    cache = GroupCache()
    a = init_mesh(LAYOUT, cache=cache, timeout=scaled(20))
    b = init_mesh(LAYOUT, flatten=FLATTEN, cache=cache, timeout=scaled(20))
    assert a.group("tp") is b.group("tp")
    a.close()
    verify_groups(b, LAYOUT, rank)
    assert b.close() > 0 and len(cache) == 0 and b.close() == 0
    try:
        b.group("tp")
        raise AssertionError("a closed mesh answered")
    except RuntimeError as exc:
        assert "closed" in str(exc)
    return out


def test_init_close_cycles_leak_nothing():
    cycles = 50
    for rank, out in enumerate(run(worker_cycles, 4, cycles, timeout=300)):
        for strategy, (before, after) in out.items():
            assert after["groups"] == before["groups"], (rank, strategy, before, after)
            assert after["threads"] <= before["threads"], (rank, strategy, before, after)
            assert after["fds"] <= before["fds"] + 2, (rank, strategy, before, after)
            # store keys: our rendezvous keys and gloo's connection keys are deleted every call
            assert after["keys"] <= before["keys"] + 8, (rank, strategy, before, after)


def worker_dies_creating_groups(rank, world, victim):
    """Case 6: ``victim`` is SIGKILLed inside group creation (its second ``new_group``)."""
    import os
    import signal

    import torch.distributed as dist

    from meshgroups import init_mesh
    from meshgroups.mesh._torch_seam import default_store

    with init_mesh(LAYOUT, timeout=scaled(10)) as mg:
        verify_groups(mg, LAYOUT, rank)
    real_new_group, calls = dist.new_group, {"n": 0}

    def dying_new_group(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_new_group(*args, **kwargs)

    if rank == victim:
        dist.new_group = dying_new_group
    outcome = _outcome(lambda: init_mesh(LAYOUT, flatten=FLATTEN, timeout=scaled(3)))
    if victim != 0:
        # rank 0 hosts the store: it stays until the other survivors made their last store call
        store = default_store()
        store.add("survivors_done", 1)
        deadline = time.monotonic() + 30
        while int(store.add("survivors_done", 0)) < world - 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        # every survivor has left the failed call: its keys are gone (the dead rank never leaves)
        ours = ("meshgroups/rdzv/", "meshgroups/g")  # (a prefix store lists keys with its prefix)
        outcome = (*outcome, sorted(k for k in store.list_keys() if any(p in k for p in ours)))
        if rank != 0:
            store.add("survivors_left", 1)
        while rank == 0 and int(store.add("survivors_left", 0)) < world - 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    return outcome


def test_issue18_case6_the_dead_rank_is_named_everywhere():
    results = run(worker_dies_creating_groups, 4, 2, timeout=scaled(120), may_exit={2})
    survivors = [out for rank, out in enumerate(results) if rank != 2]
    assert {name for name, _, _ in survivors} == {"RanksGoneError"}, survivors  # a MeshBuildError
    for _name, message, leftover in survivors:
        assert "rank 2 never reported" in message and "last published" in message, message
        assert "failed on rank" not in message, message  # a survivor is never blamed
        assert leftover == [], leftover  # the last survivor out swept the failed call's keys


def test_issue18_case6_losing_the_store_host_while_creating_groups():
    results = run(worker_dies_creating_groups, 4, 0, timeout=scaled(120), may_exit={0})
    assert {name for name, _ in results[1:]} == {"StoreConnectionError"}, results[1:]


@pytest.mark.timeout(900)
def test_issue18_case9_torchrun_demo_exits_0_every_time():
    """Case 9: the torchrun demo exits 0 after a passing run, run after run (it used to abort on
    one rank at interpreter exit in about one run of four). Up to ``MESHGROUPS_DEMO_RUNS`` runs
    (default 20, the issue's count), as many as fit in ``MESHGROUPS_DEMO_SECONDS`` (default 60,
    to keep the suite's time in bounds) but never fewer than 8: the budget sets only how many
    samples, never the verdict."""
    import os
    import subprocess
    import sys

    runs = int(os.environ.get("MESHGROUPS_DEMO_RUNS", "20"))
    budget = float(os.environ.get("MESHGROUPS_DEMO_SECONDS", "60"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    failures = []
    started = time.monotonic()
    done = 0
    while done < runs and (done < min(8, runs) or time.monotonic() - started < budget):
        out = subprocess.run(
            [*cmd, "-m", "meshgroups", "demo", "dp=2", "tp=2"],
            capture_output=True,
            text=True,
            timeout=scaled(180),
            env=env,
        )
        assert "all 16 checks passed" in out.stdout, out.stdout + out.stderr
        if out.returncode != 0:
            failures.append((done, out.returncode, out.stderr[-2000:]))
        done += 1
    print(f"torchrun demo: {done} runs, {len(failures)} non-zero exits")
    assert not failures, f"{len(failures)} of {done} runs exited non-zero; first: {failures[0]}"
