"""Liveness, not timers (issue 46), on real gloo processes: few spawned worlds, many checks each.

Every job sets the default group's timeout to half an hour (scaled): a wait that did not watch
liveness would run into the job's own timeout and fail the test. Every bound is a multiple of
the heartbeat interval ``HB`` (``tests/support/liveness.py``), scaled by
MESHGROUPS_TEST_TIME_SCALE like the suite's other waits.

- world A (4): a layout smaller than the world refused on every rank without ``partial=True``;
  with it, ``group()`` on a non-member is torch's ``NON_GROUP_MEMBER``, which ``all_reduce``,
  ``broadcast`` and ``barrier`` refuse to run there (a warning; an error under ``-W error``)
  while the members' collectives are right; a late rank logged ("still waiting ...", call
  number and site) every ``report_every``; a rank that skips a call; ranks that exit before a
  call named on every survivor;
- world B (6): a rank SIGKILLed inside a compat initializer, ``init_mesh`` and ``flatten`` (the
  later ones over cohorts of the survivors), and a SIGSTOP-ed rank: "stopped responding";
- world C (4): a rank SIGKILLed in the middle of a weight sync;
- world D (6): an elastic step: a SIGKILLed rank, then a SIGSTOP-ed one, lost on every survivor;
- world E (2): a clean exit marks the rank exited (its heartbeat counter), no lease needed.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from meshgroups import Layout

from ..support.dist import run, scaled
from ..support.liveness import (
    BOUND,
    HB,
    LEASE,
    OPTIONS,
    PG_TIMEOUT,
    REPORT,
    Lines,
    die_in_nth_new_group,
    kill_rank,
    leave_together,
    publish_pid,
    results_of,
    share,
    shared_results,
    timed,
)

pytestmark = pytest.mark.processes  # every test here starts processes

# ------------------------------------------------------------------------------------------------
# world A: partial layouts, non-members, late / skipping / exiting ranks
# ------------------------------------------------------------------------------------------------


def _non_member_collectives(mg, rank):
    """all_reduce, broadcast, barrier on ``mg.group("tp")``: the members' results, and on a
    non-member what torch does with the group (a warning, nothing moved; raised as an error
    under ``-W error``)."""
    import warnings

    import torch
    import torch.distributed as dist

    group = mg.group("tp")
    out = {"is_sentinel": group == dist.GroupMember.NON_GROUP_MEMBER, "ranks": mg.ranks("tp")}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        x = torch.tensor([float(rank + 1)])
        dist.all_reduce(x, group=group)
        y = torch.tensor([float(rank + 10)])
        dist.broadcast(y, src=0, group=group)
        dist.barrier(group=group)
    out["values"] = (float(x), float(y))
    out["warnings"] = [str(w.message) for w in seen if "does not belong to the given group" in str(w.message)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out["strict"] = []
        for name, op in (
            ("all_reduce", lambda: dist.all_reduce(torch.ones(1), group=group)),
            ("broadcast", lambda: dist.broadcast(torch.ones(1), src=0, group=group)),
            ("barrier", lambda: dist.barrier(group=group)),
        ):
            try:
                op()
                out["strict"].append((name, "ran"))
            except (UserWarning, ValueError) as exc:
                # torch's logging wrapper re-raises it as "Invalid process group specified"
                out["strict"].append((name, f"{exc} <- {exc.__context__}"))
    return out


def _wait_gone(rank):
    """Until the process of ``rank`` (its pid published) has ended (gone, or a zombie)."""
    from meshgroups.mesh._torch_seam import default_store

    pid = int(default_store().get(f"test/pid/{rank}"))
    deadline = time.monotonic() + BOUND
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return
        except OSError:
            return
        time.sleep(HB / 4)


def worker_a(rank, world):
    from meshgroups import RanksGoneError, init_mesh

    out = {}
    lines = Lines()
    full = Layout(dp=2, tp=2)
    with init_mesh(full, **OPTIONS) as mg:  # starts every rank's heartbeat
        out["full_sentinel"] = mg.group("tp") is None

    # 1. a layout smaller than the world: refused on every rank, saying how to opt in
    for lay in (Layout(dp=1, tp=2), Layout(tp=2, rank_offset=2)):
        exc, _ = timed(lambda lay=lay: init_mesh(lay))
        out.setdefault("refused", []).append((type(exc).__name__, str(exc)))
    # 2. with partial=True: non-members get torch's sentinel, which its collectives refuse
    with init_mesh(Layout(dp=1, tp=2), partial=True) as mg:
        out["partial"] = _non_member_collectives(mg, rank)
    # a subset needs no opt-in; its non-members get the sentinel too
    with init_mesh(full, subsets={"first": (full.select("dp", 0), "tp")}) as mg:
        import torch.distributed as dist

        out["subset_sentinel"] = mg.group("first") == dist.GroupMember.NON_GROUP_MEMBER
    # a bad liveness option on one rank: every rank refuses
    exc, _ = timed(lambda: init_mesh(full, lease=HB if rank == 1 else LEASE, heartbeat=HB))
    out["bad_lease"] = (type(exc).__name__, str(exc))

    # 3. a late rank (alive): the others log who they wait for, where, every REPORT seconds
    if rank == 3:
        time.sleep(4 * REPORT)
    exc, _ = timed(lambda: init_mesh(full, **OPTIONS).close())  # the late call's line
    out["late"] = (exc, [(t, m) for t, m in lines.matching("still waiting for rank 3")])
    # 4. ranks 2, 3 skip a call (alive, busy elsewhere), then make the next one: the others log
    #    them while they are late, then every rank hears of the skipped call at once
    lines.lines.clear()
    if rank in (2, 3):
        time.sleep(3 * REPORT)
    else:
        exc, _ = timed(lambda: init_mesh(full, **OPTIONS).close())  # the call ranks 2, 3 skip
        out["skip_first"] = (type(exc).__name__, str(exc))
    if rank in (2, 3):
        exc, _ = timed(lambda: init_mesh(full, **OPTIONS).close())  # their next call
        out["skip_first"] = (type(exc).__name__, str(exc))
    out["skip_lines"] = [m for _, m in lines.matching("still waiting for ranks 2, 3")]
    with init_mesh(full, **OPTIONS):  # in step again
        pass

    # 5. ranks 2, 3 exit before a call (one without a word, one after destroying its default
    #    group): ranks 0, 1 name both "exited" within a few intervals
    publish_pid(rank)
    share(rank, out)
    if rank == 2:
        os._exit(0)
    if rank == 3:
        return out  # the harness destroys the default group, then the process ends
    for other in (2, 3):  # (both gone before the call: one named alone would be a race)
        _wait_gone(other)
    exc, elapsed = timed(lambda: init_mesh(full, **OPTIONS))
    out["exited"] = (type(exc).__name__, str(exc), elapsed, getattr(exc, "ranks", None))
    assert isinstance(exc, RanksGoneError), repr(exc)
    lines.close()
    leave_together(rank, 2)
    if rank == 0:
        out["shared"] = shared_results([2])
    return out


def test_world_a_partial_layouts_non_members_late_skipping_and_exiting_ranks():
    results = results_of(run(worker_a, 4, timeout=150, pg_timeout=PG_TIMEOUT, may_exit={2}))
    for rank, out in enumerate(results):
        assert out["full_sentinel"] is False
        for name, message in out["refused"]:
            assert name == "MeshConfigError", (rank, name, message)
            assert "partial=True" in message and "none of its groups" in message, message
        assert "rank(s) 2, 3" in out["refused"][0][1] and "rank(s) 0, 1" in out["refused"][1][1]
        part = out["partial"]
        if rank in (0, 1):
            assert not part["is_sentinel"] and part["ranks"] == [0, 1]
            assert part["values"] == (3.0, 10.0) and part["warnings"] == [], part
            assert all(what == "ran" for _, what in part["strict"]), part
        else:  # torch refuses to run them on a non-member: nothing moves, it says so
            assert part["is_sentinel"] and part["ranks"] is None
            assert part["values"] == (float(rank + 1), float(rank + 10)), part
            assert len(part["warnings"]) == 3, part
            assert [name for name, _ in part["strict"]] == ["all_reduce", "broadcast", "barrier"]
            assert all("does not belong to the given group" in what for _, what in part["strict"]), part
        assert out["subset_sentinel"] is (rank in (2, 3))
        assert out["bad_lease"][0] == "MeshConfigError" and "lease=" in out["bad_lease"][1], out["bad_lease"]
        exc, late = out["late"]
        assert exc is None
        if rank != 3:
            # every REPORT seconds while rank 3 was late (4 REPORTs): at least two lines, apart
            assert len(late) >= 2, (rank, late)
            assert all(b - a >= 0.9 * REPORT for (a, _), (b, _) in zip(late, late[1:])), late
            text = late[0][1]
            assert "at the cross-rank check of init_mesh call #" in text and "test_mesh_liveness.py:" in text
        name, message = out["skip_first"]
        assert name == "MismatchError" and "pairs different calls" in message, (rank, name, message)
        if rank in (0, 1):
            assert len(out["skip_lines"]) >= 1, out["skip_lines"]
            name, message, elapsed, gone = out["exited"]
            assert name == "RanksGoneError" and gone == (2, 3), (rank, name, message)
            assert "rank 2 exited" in message and "rank 3 exited" in message, message
            assert elapsed < BOUND, (elapsed, BOUND)


# ------------------------------------------------------------------------------------------------
# world B: SIGKILL inside a compat initializer, init_mesh, flatten; then a SIGSTOP-ed rank
# ------------------------------------------------------------------------------------------------


def worker_b(rank, world):
    from meshgroups.compat import group_initializer as gi

    from meshgroups import init_mesh
    from meshgroups.mesh import Cohort, use_cohort

    out = {}
    publish_pid(rank)
    init_mesh(Layout(dp=3, tp=2), **OPTIONS).close()  # the settings later calls inherit

    # 1. rank 5 dies inside a legacy initializer's group creation
    if rank == 5:
        die_in_nth_new_group(2)
    exc, elapsed = timed(lambda: gi.TPGroupInitializer(rank, world, 2).init_dist_group("gloo"))
    out["compat"] = (type(exc).__name__, str(exc), elapsed, getattr(exc, "ranks", None))
    share(rank, out)

    # 2. over the survivors (a cohort): rank 4 dies inside init_mesh's group creation
    with use_cohort(Cohort((0, 1, 2, 3, 4), epoch=1)):
        lay = Layout.from_grid([[0, 1, 2, 3, 4]], ("a", "b"))
        if rank == 4:
            die_in_nth_new_group(1)
        exc, elapsed = timed(lambda: init_mesh(lay, strategy="local", **OPTIONS))
        out["init_mesh"] = (type(exc).__name__, str(exc), elapsed, getattr(exc, "ranks", None))
        share(rank, out)

    # 3. rank 3 dies inside flatten's group creation
    with use_cohort(Cohort((0, 1, 2, 3), epoch=2)):
        mg = init_mesh(Layout(dp=2, tp=2), strategy="local", **OPTIONS)
        if rank == 3:
            die_in_nth_new_group(1)
        exc, elapsed = timed(lambda: mg.flatten("dp", "tp"))
        out["flatten"] = (type(exc).__name__, str(exc), elapsed, getattr(exc, "ranks", None))
        share(rank, out)

    # 4. rank 2 stops (SIGSTOP) before a call: alive, but its heartbeat stops
    try:
        with use_cohort(Cohort((0, 1, 2), epoch=3)):
            if rank == 2:
                os.kill(os.getpid(), signal.SIGSTOP)
            lay = Layout.from_grid([[0, 1, 2]], ("a", "b"))
            exc, elapsed = timed(lambda: init_mesh(lay, strategy="local", **OPTIONS))
            out["stopped"] = (type(exc).__name__, str(exc), elapsed, getattr(exc, "ranks", None))
    finally:
        if rank == 0:  # (whatever happened: a stopped process would hold the job until its timeout)
            kill_rank(2)
    leave_together(rank, 2)
    if rank == 0:
        out["shared"] = shared_results([2, 3, 4])
    return out


def test_world_b_killed_in_compat_init_mesh_flatten_and_a_stopped_rank():
    results = results_of(run(worker_b, 6, timeout=150, pg_timeout=PG_TIMEOUT, may_exit={2, 3, 4, 5}))
    expected = {"compat": (5, range(5)), "init_mesh": (4, range(4)), "flatten": (3, range(3))}
    for key, (victim, survivors) in expected.items():
        for rank in survivors:
            name, message, elapsed, gone = results[rank][key]
            assert name == "RanksGoneError" and gone == (victim,), (key, rank, name, message)
            assert f"rank {victim} exited" in message, (key, rank, message)
            assert elapsed < BOUND, (key, rank, elapsed, BOUND)
    for rank in (0, 1):
        name, message, elapsed, gone = results[rank]["stopped"]
        assert name == "RanksGoneError" and gone == (2,), (rank, message)
        assert "rank 2 stopped responding" in message and "its process is stopped" in message, message
        assert LEASE - 2 * HB <= elapsed < BOUND, (elapsed, LEASE, BOUND)  # the lease, not an exit


# ------------------------------------------------------------------------------------------------
# world C: a rank SIGKILLed in the middle of a weight sync
# ------------------------------------------------------------------------------------------------


def worker_c(rank, world):
    import torch

    from meshgroups import init_mesh
    from meshgroups.transfer._run.sync import WeightSync

    init_mesh(Layout(dp=2, tp=2), **OPTIONS).close()
    trainer_layout, rollout_layout = Layout(dp=2), Layout(dp=2, rank_offset=2)
    names = [f"w{i}" for i in range(4)]
    trainer = {n: torch.full((64, 16), float(i)) for i, n in enumerate(names)} if rank < 2 else None
    rollout = {n: torch.zeros(64, 16) for n in names} if rank >= 2 else None
    sync = WeightSync(trainer, trainer_layout, rollout, rollout_layout, bucket_bytes=64 * 16 * 4)
    sync.sync()
    out = {"first": rollout is None or all(float(rollout[n][0, 0]) == i for i, n in enumerate(names))}

    def progress(p):
        if rank == 3 and p.bucket == 1:
            os.kill(os.getpid(), signal.SIGKILL)

    exc, elapsed = timed(lambda: sync.sync(progress=progress))
    out["killed"] = (type(exc).__name__, str(exc), elapsed, getattr(exc, "ranks", None))
    leave_together(rank, 3)
    return out


def test_world_c_a_rank_killed_in_the_middle_of_a_weight_sync():
    results = run(worker_c, 4, timeout=120, pg_timeout=PG_TIMEOUT, may_exit={3})
    for rank in range(3):
        out = results[rank]
        assert out["first"]
        name, message, elapsed, gone = out["killed"]
        assert name == "TransferError" and gone == (3,), (rank, message)
        assert "rank 3 exited" in message, message
        assert elapsed < BOUND, (elapsed, BOUND)


# ------------------------------------------------------------------------------------------------
# world D: the elastic verdict on the same liveness: a SIGKILLed rank, then a SIGSTOP-ed one
# ------------------------------------------------------------------------------------------------


def worker_d(rank, world):
    import torch
    import torch.distributed as dist

    from meshgroups import Elastic, RanksLostError

    publish_pid(rank)
    el = Elastic(Layout(dp_replicate=3, tp=2), heartbeat=HB, stale_after=LEASE)

    def step(die=None, where="start"):
        with el.step():
            if rank == die and where == "start":
                os.kill(os.getpid(), signal.SIGKILL)
            x = torch.ones(1)
            dist.all_reduce(x, group=el.mg.group("tp"))
            if rank == die and where == "commit":
                os.kill(os.getpid(), signal.SIGSTOP)
            el.commit()
            dist.all_reduce(x, group=el.mg.group("dp_replicate"))
        return float(x)

    out = {"step1": step()}
    exc, elapsed = timed(lambda: step(die=5))
    out["killed"] = (type(exc).__name__, str(exc), elapsed, getattr(exc, "lost", None))
    share(rank, out)
    if not isinstance(exc, RanksLostError):
        return out  # (the test says what happened)
    mg = el.shrink()
    if mg is None:  # rank 4: its replica lost rank 5; it waits as a spare
        leave_together(rank, 4)
        return out
    try:
        out["step3"] = step()
        exc, elapsed = timed(lambda: step(die=3, where="commit"))
        out["stopped"] = (type(exc).__name__, str(exc), elapsed, getattr(exc, "lost", None))
    finally:
        if rank == 0:  # (whatever happened: a stopped process would hold the job until its timeout)
            kill_rank(3)
    leave_together(rank, 4)
    if rank == 0:
        out["shared"] = shared_results([3])
    return out


def test_world_d_the_elastic_verdict_names_a_killed_then_a_stopped_rank():
    returned = run(worker_d, 6, timeout=150, pg_timeout=PG_TIMEOUT, may_exit={3, 5})
    assert returned[3] is None and returned[5] is None  # SIGKILLed (3 once stopped, at the end)
    results = results_of(returned)  # rank 3's first verdict, shared before it was stopped
    for rank in (0, 1, 2, 3, 4):
        out = results[rank]
        assert out["step1"] == 6.0, out  # tp (2) × dp_replicate (3)
        name, message, elapsed, lost = out["killed"]
        assert name == "RanksLostError" and lost == (5,), (rank, message)
        assert "rank 5 exited" in message, message
        assert elapsed < BOUND, (elapsed, BOUND)
    for rank in range(3):
        out = results[rank]
        assert out["step3"] == 4.0, out
        name, message, elapsed, lost = out["stopped"]
        assert name == "RanksLostError" and lost == (3,), (rank, message)
        assert "rank 3 stopped responding" in message, message
        assert elapsed < BOUND, (elapsed, BOUND)


# ------------------------------------------------------------------------------------------------
# world E: a clean exit marks the rank exited in the store
# ------------------------------------------------------------------------------------------------


def worker_e(rank, world, port):
    from datetime import timedelta

    import torch.distributed as dist

    from meshgroups import init_mesh
    from meshgroups.mesh._liveness import EXITED, heartbeat_key
    from meshgroups.mesh._torch_seam import default_store

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=scaled(60)),
    )
    init_mesh(Layout(dp=2), **OPTIONS).close()
    if rank == 1:
        return None  # no destroy_process_group: the process ends with its world alive
    store = default_store()
    deadline, value = time.monotonic() + BOUND, 0
    while time.monotonic() < deadline:
        value = int(store.get(heartbeat_key(1)))
        if value >= EXITED:
            break
        time.sleep(HB / 4)
    dist.destroy_process_group()
    return value >= EXITED


def test_world_e_a_clean_exit_is_marked_in_the_store():
    from ..support.dist import free_port

    assert run(worker_e, 2, free_port(), backend=None, timeout=120, port_retries=0)[0] is True


def test_world_f_torchrun_ranks_that_exit_before_their_first_call():
    """Under torchrun, ranks that leave before any meshgroups call (no heartbeat ever) are named
    as exited by the survivors on their host from the launcher's own facts (the agent's workers),
    not after the timeout, which is set to half an hour here."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from ..support.dist import free_port

    job = Path(__file__).parents[1] / "support" / "exit_before_first_call_job.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port", str(free_port()),
           str(job), str(scaled(PG_TIMEOUT)), str(HB), str(LEASE)]  # fmt: skip
    out = subprocess.run(
        cmd, capture_output=True, text=True, timeout=scaled(180), env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert out.returncode == 0, out.stdout + out.stderr
    rows = sorted(
        (json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")),
        key=lambda r: r["rank"],
    )
    assert [r["rank"] for r in rows] == [0, 1], out.stdout + out.stderr
    for r in rows:
        assert r["error"] is not None and r["ranks"] == [2, 3], r
        assert all("before its first meshgroups call" in r["states"][k] for k in ("2", "3")), r
        assert r["elapsed"] < BOUND, r  # seconds, not the half hour
