"""The trainer program of tests/engines/test_engines_vllm_serve.py, run under torchrun (4 gloo ranks);
no tests here.

The engines are separately started ``vllm serve`` processes (``--servers URL,URL``); trainer
rank 0 drives each through ``HTTPClient`` (its weight-transfer routes), and every rank holds one
``VLLMWeightSync`` per server. Each step: an optimizer step, a sync into every server, then rank 0
asks each server for greedy completions (``/v1/completions``, prompt token ids) and compares
them with a ``transformers`` reference holding the trainer's full weights, and reads the version
each serves (``/weight_info``). ``--kill I``: after the steps, one more step whose sync into
server ``I`` loses an engine worker (SIGKILL after the first bucket); then the other server is
checked (still the last version, its tokens) and synced once more. Rank 0 writes JSON to ``--out``.

    torchrun --nproc-per-node 4 tests/engines/test_engines_vllm_serve_job.py --servers URL,URL --model DIR --out OUT  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
import urllib.request
from datetime import timedelta
from typing import Any

from tests.engines.test_engines_vllm_job import (
    NEW_TOKENS,
    PROMPTS,
    compare,
    is_replicated,
    reference_outputs,
    shard_bytes,
    shard_trainer,
)


def http_outputs(url: str, model: str) -> list[tuple[list[int], list[float]]]:
    """Greedy completions of every prompt, token ids in and out, and their logprobs."""
    out = []
    for prompt in PROMPTS:
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": NEW_TOKENS,
            "temperature": 0.0,
            "logprobs": 1,
            "return_token_ids": True,
            "ignore_eos": True,
        }
        request = urllib.request.Request(
            f"{url}/v1/completions", json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            choice = json.loads(response.read())["choices"][0]
        out.append((list(choice["token_ids"]), [float(x) for x in choice["logprobs"]["token_logprobs"]]))
    return out


def every_rank(value: object) -> list[Any]:
    import torch.distributed as dist

    seen: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, value)
    return seen


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--servers", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--kill", type=int, default=-1)
    ap.add_argument("--timeout", type=float, default=60.0)
    args = ap.parse_args()

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from meshgroups import Layout
    from meshgroups.engines.vllm._clients import HTTPClient
    from meshgroups.engines.vllm._trainer import VLLMWeightSync

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=900))
    rank = dist.get_rank()
    urls = args.servers.split(",")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    shard_trainer(model, mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-2)
    gen = torch.Generator().manual_seed(args.seed)
    result: dict[str, Any] = {"steps": []}

    def train_step() -> None:
        tokens = torch.randint(0, model.config.vocab_size, (2, 16), generator=gen)
        optimizer.zero_grad()
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()

    def full_state() -> dict[str, Any]:
        return {
            n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()
        }

    def check(url: str, state: dict[str, Any]) -> dict[str, Any]:
        row = compare(http_outputs(url, args.model), reference_outputs(args.model, state, torch.float32))
        row["served"] = HTTPClient(url).get_weight_version()
        return row

    t = time.monotonic()
    syncs = [
        VLLMWeightSync(
            model, Layout(dp=2, tp=2), HTTPClient(url, timeout=args.timeout) if rank == 0 else None, timeout=args.timeout,
            bucket_bytes=256 << 10,
        )
        for url in urls
    ]  # fmt: skip
    result["init_s"] = time.monotonic() - t
    result["init_versions"] = every_rank([s.version for s in syncs])
    for _ in range(args.steps):
        train_step()
        t = time.monotonic()
        versions = [s.sync() for s in syncs]
        took = time.monotonic() - t
        state = full_state()
        if rank == 0:
            rows = [check(url, state) for url in urls]
            for row, s in zip(rows, syncs):  # what each worker of each server committed
                tp = s.engine_size
                row["reports"] = {str(r): rep for r, rep in s.engine_reports().items()}
                row["expected_worker_bytes"] = shard_bytes(state, tp, is_replicated)
                row["expected_checksum"] = sum(
                    float(v.double().sum()) * (tp if is_replicated(k) else 1) for k, v in state.items()
                )
            result["steps"].append({"versions": versions, "sync_s": took, "servers": rows})
    last = full_state()
    if args.kill >= 0:
        dead, alive = syncs[args.kill], syncs[1 - args.kill]
        train_step()
        pids = dead.engine_pids()
        fired = threading.Event()

        def progress(p: Any) -> None:
            if p.bucket == 1 and rank == 0 and not fired.is_set():
                fired.set()
                os.kill(pids[1], signal.SIGKILL)  # an engine worker gone mid-transfer

        t = time.monotonic()
        try:
            dead.sync(progress=progress)
            outcome = "no error"
        except Exception as exc:
            outcome = f"{type(exc).__name__}: {str(exc)[:300]}"
        fault: dict[str, Any] = {"outcomes": every_rank(outcome), "after_s": every_rank(time.monotonic() - t)}
        if rank == 0:  # the other engine: still the last complete version, and its tokens
            fault["other_before"] = check(urls[1 - args.kill], last)
            try:  # the engine that lost a worker: vLLM refuses to serve rather than serve half-written weights
                http_outputs(urls[args.kill], args.model)
                fault["dead_serves"] = "it served"
            except Exception as exc:
                fault["dead_serves"] = f"refused: {type(exc).__name__}: {str(exc)[:200]}"
        version = alive.sync()
        state = full_state()
        if rank == 0:
            fault["other_version"] = version
            fault["other_after"] = check(urls[1 - args.kill], state)
        result["fault"] = fault
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)
    for s in syncs:
        s.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
