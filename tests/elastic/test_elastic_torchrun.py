"""torchrun's elastic agent restarts a node's workers and they take their ranks back (issue 51), on
two real ``torchrun`` agents of 4 gloo workers each.

One agent per node, each with a rendezvous of its own (``--nnodes=1``, ``--max-restarts=1``),
the job's store hosted by this (pytest) process, outside both agents. HSDP × TP
(dp_replicate=2 × dp_shard=2 × tp=2): node 0 is replica 0 (ranks 0-3), node 1 replica 1 (ranks
4-7). Rank 5 SIGKILLs itself in the middle of step 2; node 1's agent stops 4, 6 and 7 and starts
four new workers (``TORCHELASTIC_RESTART_COUNT=1``). Every worker runs one code path
(``meshgroups.elastic.start``, ``tests/support/elastic_torchrun.py``): node 0 names the lost
ranks, shrinks, takes a good step within a few heartbeat intervals, admits the restarted workers
(each gets its own rank back), grows, heals replica 1 bit-exact, trains two more steps with equal
replicas, and the model equals a single-process reference.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from datetime import timedelta

import pytest
import torch.distributed as dist

from ..support.elastic_torchrun import KILLED, result_key
from ..support.reaper import descendants
from ..support.timing import scaled

HEARTBEAT = scaled(0.25)  # the job's liveness interval
BOUND = 16 * HEARTBEAT  # kill -> next good step on node 0; the collective timeout is scaled(60)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXPECTED = {(r, 0) for r in range(4)} | {(r, 1) for r in range(4, 8)}
# python -m torch.distributed.run, dying with this process even when it is SIGKILLed (its workers
# die with it: tests/support/elastic_torchrun.py)
AGENT = (
    "import sys; from tests.support.reaper import die_with_parent; die_with_parent(); "
    "from torch.distributed.run import main; main(sys.argv[1:])"
)


def _agent(node: int, port: int, log) -> subprocess.Popen:
    """torchrun for one node (``python -m torch.distributed.run``): its own c10d rendezvous on a
    port of its own (0: the OS picks)."""
    cmd = [
        sys.executable,
        "-c",
        AGENT,
        "--nnodes=1",
        "--nproc-per-node=4",
        "--max-restarts=1",
        "--monitor-interval=0.1",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=127.0.0.1:0",
        f"--rdzv-id=node{node}-{uuid.uuid4().hex[:8]}",
        "-m",
        "tests.support.elastic_torchrun",
        str(port),
        str(HEARTBEAT),
    ]
    env = {
        **os.environ,
        "MESHGROUPS_NODE_RANK": str(node),
        "PYTHONWARNINGS": "ignore",
        "OMP_NUM_THREADS": "1",
    }
    return subprocess.Popen(
        cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )


def _stop(agents: list[subprocess.Popen]) -> None:
    """Kill each agent's process group and every process below it (workers run in sessions of
    their own); nothing outlives the test."""
    for agent in agents:
        below = descendants(agent.pid)
        for kill, target in [(os.killpg, agent.pid)] + [(os.kill, pid) for pid in below]:
            try:
                kill(target, signal.SIGKILL)
            except OSError:
                pass  # ended meanwhile
        agent.wait(timeout=10)


def _logs(paths: list[str]) -> str:
    out = []
    for path in paths:
        with open(path, errors="replace") as f:
            out.append(f"--- {path} (last 60 lines)\n" + "".join(f.readlines()[-60:]))
    return "\n".join(out)


def _collect(store, agents, paths, deadline: float) -> dict[tuple[int, int], dict]:
    """The workers' reports, as they arrive; fails at the first error, an agent that gave up, or
    the deadline."""
    results: dict[tuple[int, int], dict] = {}
    while not EXPECTED <= results.keys():
        for rank in range(8):
            for restart in (0, 1):
                key = result_key(rank, restart)
                if (rank, restart) not in results and store.check([key]):
                    results[(rank, restart)] = json.loads(store.get(key))
        errors = {k: v["error"] for k, v in results.items() if "error" in v}
        assert not errors, f"workers failed: {errors}\n{_logs(paths)}"
        ended = [(i, a.returncode) for i, a in enumerate(agents) if a.poll() not in (None, 0)]
        assert not ended, f"agents {ended} failed (node, exit code)\n{_logs(paths)}"
        assert time.monotonic() < deadline, (
            f"only {sorted(results)} reported in time (MESHGROUPS_TEST_TIME_SCALE)\n{_logs(paths)}"
        )
        time.sleep(0.2)
    return results


@pytest.mark.processes
def test_torchrun_restarts_a_nodes_workers_and_they_take_their_ranks_back(tmp_path):
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=scaled(60))
    )
    paths = [str(tmp_path / f"agent{node}.log") for node in (0, 1)]
    agents: list[subprocess.Popen] = []
    started = time.monotonic()
    try:
        for node, path in enumerate(paths):
            agents.append(_agent(node, store.port, open(path, "w")))
        results = _collect(store, agents, paths, started + scaled(240))
        for agent in agents:  # every worker done: both agents end, with success
            assert agent.wait(timeout=scaled(30)) == 0, _logs(paths)
    finally:
        _stop(agents)
    elapsed = time.monotonic() - started

    first = {r: results[(r, 0)] for r in range(4)}
    restarted = {r: results[(r, 1)] for r in range(4, 8)}
    kill_t = float(store.get("test/kill_t"))
    print(
        f"\nwall {elapsed:.1f}s; verdicts {first[0]['lost']}, then gone {first[0]['spares_before']}; kill -> good step "
        f"{max(res['kill_to_good_step'] for res in first.values()):.2f}s (bound {BOUND:.2f}s; verdict "
        f"{max(res['t_verdict'] for res in first.values()) - kill_t:.2f}s, shrunk "
        f"{max(res['t_shrunk'] for res in first.values()) - kill_t:.2f}s); "
        f"kill -> restarted workers started {min(res['t_start'] for res in restarted.values()) - kill_t:.2f}s, "
        f"-> admitted {first[0]['t_admitted'] - kill_t:.2f}s, -> healed and two steps {first[0]['t_done'] - kill_t:.2f}s"
    )
    for r, res in first.items():
        # the verdict names the killed rank (and those of node 1's workers its agent had already
        # stopped); every other rank of node 1 is found gone when the restarted workers arrive
        assert KILLED in res["lost"][0] and set(res["lost"][0]) <= {4, 5, 6, 7}, res
        lost = {x for verdict in res["lost"] for x in verdict}
        assert lost | set(res["spares_before"]) == {4, 5, 6, 7}, res
        assert res["kept"] == {"tp": True, "dp_shard": True}, res
        assert res["kept_after_grow"] == {"tp": True, "dp_shard": True}, res
        assert res["kill_to_good_step"] < BOUND, (res["kill_to_good_step"], BOUND)
        assert res["newcomers"] == [4, 5, 6, 7] and res["spares_then"] == [4, 5, 6, 7], res
        assert res["healed_equal"] is True and res["equal_after"] is True, res
        assert res["reference_close"], (r, res["vs_reference"])
    for r, res in restarted.items():
        assert res["restart"] == 1 and res["node"] == 1 and res["world"] == 8, res
        assert res["rank"] == r, res  # each restarted worker got its own rank back (prefer=)
        assert res["received"] > 0 and res["healed_equal"] is True and res["equal_after"] is True, res
        assert res["reference_close"], (r, res["vs_reference"])


@pytest.mark.processes
def test_python_m_meshgroups_store_hosts_the_job_store_until_sigterm():
    """The store process of one's own that docs/elastic.md launches the job with."""
    cmd = [sys.executable, "-m", "meshgroups", "store", "--host", "127.0.0.1", "--port", "0", "--json"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = proc.stdout.readline()  # the address, printed once the store listens
        address = json.loads(line)
        assert address["address"] == f"127.0.0.1:{address['port']}", line
        client = dist.TCPStore(
            "127.0.0.1", address["port"], is_master=False, timeout=timedelta(seconds=scaled(30))
        )
        client.set("k", "v")
        assert client.get("k") == b"v"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=scaled(30)) == 0
    finally:
        _stop([proc])


def test_a_newcomer_gets_the_rank_it_prefers_when_free_else_the_lowest_left():
    """``Elastic.join(prefer=)``: how the first member pairs waiting processes with free ranks."""
    from meshgroups.elastic._join import KEY, _pair

    store = dist.HashStore()
    for token, rank in (("a", 6), ("b", 6), ("c", 9)):  # b wants a taken rank, c one not free
        store.set(f"{KEY}/join/{token}/prefers", str(rank))
    assert _pair(store, ["a", "b", "c", "d"], [4, 5, 6, 7]) == [("a", 6), ("b", 4), ("c", 5), ("d", 7)]
    assert _pair(store, [], [4]) == []
