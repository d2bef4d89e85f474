"""Which failed peers a rank blocked in a collective severs (``meshgroups.elastic._unblock``), from
the counts a 16-process HSDP 4 × 2 × TP 2 job published when rank 5 was SIGKILLed after a
forward (``benchmarks/bench_elastic_live.py --replicas 4``), and the 8-process job of the same
shape. No processes: the decision only; the severing itself runs in the elastic process tests.

Ranks are ``replica * 4 + dp_shard * 2 + tp``; each rank holds its replicate, dp_shard and tp
group. In the backward the tp all-reduces come first, then the dp_shard reduce-scatter, then the
replicate all-reduce (a ring over more than two ranks).
"""

from __future__ import annotations

from meshgroups.elastic._unblock import stuck_on


def test_a_ring_neighbour_level_with_this_rank_is_severed_where_the_collective_cannot_complete():
    # Rank 12 waits in its replicate all-reduce (count 16) over {0, 4, 8, 12}: rank 4 failed in
    # its tp all-reduce with the dead rank 5 and never posted it (15); ranks 0 and 8 posted it,
    # were woken (they are level with 12) and left. 12 waits on one of them: only severing the
    # level ones frees it (before, it waited out the 60 s collective timeout).
    mine = {"rep": 16, "shard": 32, "tp": 128}
    used = {"rep": {0, 4, 8, 12}, "shard": {12, 14}, "tp": {12, 13}}
    failed = {4: {"rep": 15}, 0: {"rep": 16}, 8: {"rep": 16}, 13: {"tp": 128}}
    assert sorted(stuck_on(mine, failed, used, dead={5})) == [0, 4, 8]
    # its tp peer 13, level in a group whose collective completes, is not severed: that group
    # (of survivors, in step) is kept by the rebuild
    assert 13 not in stuck_on(mine, failed, used, dead={5})


def test_a_group_holding_the_dead_rank_dooms_its_level_members():
    # Rank 13 in {1, 5, 9, 13}: the dead rank 5's ring neighbour 9 failed inside the all-reduce
    # (level with 13), and nobody published a lower count: the dead member dooms the group.
    mine = {"rep": 16, "shard": 32, "tp": 128}
    used = {"rep": {1, 5, 9, 13}, "shard": {13, 15}, "tp": {12, 13}}
    assert stuck_on(mine, {9: {"rep": 16}}, used, dead={5}) == [9]
    assert stuck_on(mine, {9: {"rep": 16}}, used, dead=set()) == []  # not yet known gone


def test_eight_ranks_sever_only_the_peer_behind_and_keep_the_survivors_groups():
    # Rank 0 (8 processes): its replicate peer 4 failed in tp before the replicate all-reduce
    # (behind); its tp peer 1 failed in the replicate all-reduce with the dead rank, level with
    # 0 in tp. Severing 0-1 would make the rebuild replace the survivors' tp group {0, 1}.
    mine = {"rep": 16, "shard": 32, "tp": 128}
    used = {"rep": {0, 4}, "shard": {0, 2}, "tp": {0, 1}}
    failed = {4: {"rep": 15, "tp_45": 126}, 1: {"rep_15": 16, "tp": 128}}  # (groups by name)
    assert stuck_on(mine, failed, used, dead={5}) == [4]


def test_a_group_this_step_did_not_use_never_dooms():
    # A world-spanning group (the live group) holds the dead rank, but no collective of this step
    # ran on it: peers level there are not stuck with this rank.
    mine = {"live": 3, "tp": 128}
    used = {"tp": {2, 3}}  # "live" kept its count since the step started
    assert stuck_on(mine, {1: {"live": 3}, 3: {"tp": 128}}, used, dead={5}) == []
    assert stuck_on(mine, {1: {"live": 2}}, used, dead={5}) == [1]  # behind: always stuck-making


def test_a_newcomer_in_a_lost_ranks_place_is_judged_afresh_by_the_watcher():
    """The step watcher keeps liveness of its own (on its own connection): once a new process
    took a lost rank, what it saw of the lost process (its pid) must not judge the new one."""
    import json
    import os

    import torch.distributed as dist

    from meshgroups.elastic._unblock import StepWatcher
    from meshgroups.mesh import GroupCache
    from meshgroups.mesh._liveness import _identity, _info_key, heartbeat_key

    store = dist.HashStore()
    lost = {**_identity(), "pid": 2**22 + 7, "start": "1"}  # no such process: it exited
    store.set(heartbeat_key(3), "4")
    store.set(_info_key(3), json.dumps(lost))
    watcher = StepWatcher(store, 0, GroupCache(), poll=0.05, keep_port=None, lease=5.0)
    try:
        assert watcher.liveness is not None
        assert watcher.liveness.gone([3]) == {3: "exited"}
        store.set(_info_key(3), json.dumps(_identity()))  # a newcomer (this process) took rank 3
        store.set(heartbeat_key(3), "1")
        assert watcher.liveness.gone([3]) == {3: "exited"}  # what the watcher saw still speaks
        watcher.forget([3])  # Elastic does this where it admits newcomers (_join._forget_ranks)
        assert watcher.liveness.gone([3]) == {}
        assert os.getpid() == watcher.liveness.info[3]["pid"]
    finally:
        watcher.close(0)
