"""The trainer program of tests/engines/test_engines_vllm.py, run under torchrun (4 gloo ranks); no tests here.

Rank 0 starts a real vLLM engine (tp=2, its own workers and world) on a tiny model saved by the
test, every rank builds the same model with ``transformers`` and shards it FSDP2 (dp=2) × TP (tp=2)
— the trainer's own world — and ``VLLMWeightSync`` moves the weights after each optimizer step.
After each sync rank 0 compares the engine's greedy tokens and logprobs with a ``transformers``
reference loaded with the trainer's full weights, and the engine's reports (version, bytes per
worker) with what each worker's shard holds. The last sync is the fault: a trainer rank that
leaves mid-transfer (``--fault trainer``) or an engine worker killed mid-transfer (``--fault
worker``). Rank 0 writes what it saw to ``--out`` as JSON.

    torchrun --nproc-per-node 4 tests/engines/test_engines_vllm_job.py --model DIR --out OUT.json  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
import traceback
from datetime import timedelta
from typing import Any

PROMPTS = [[1, 5, 9, 13, 17], [2, 4, 8, 16, 32, 64], [7, 3]]
NEW_TOKENS = 6


def shard_bytes(state: dict[str, Any], tp: int, replicated) -> int:
    """What one engine worker holds of ``state`` (HF names, the engine's dtype): a 1/tp share of
    each sharded weight, all of each replicated one."""
    total = 0
    for name, t in state.items():
        n = t.numel() * t.element_size()
        total += n if replicated(name) else n // tp
    return total


def is_replicated(name: str) -> bool:
    """Replicated on vLLM's tp ranks: norms (layer norms, Qwen3's q/k norms), row-parallel
    biases and MoE routers (``mlp.gate``: a ``ReplicatedLinear``)."""
    return (
        "norm" in name
        or name.endswith(
            ("o_proj.bias", "down_proj.bias", "mlp.gate.weight", "e_score_correction_bias", "q_a_proj.weight")
        )
        or name.endswith("kv_a_proj_with_mqa.weight")
    )  # MLA's fused q_a ‖ kv_a: whole on every rank


def family_check(family, used) -> dict[str, Any]:
    """How the plan's name map (vLLM's names) relates to the family map: its stacks are the
    family's (vLLM 0.32 names routed experts ``experts.routed_experts.*``), its fused rules
    read the same trainer weights."""
    from meshgroups.engines.vllm._destination import family_names

    names = {alias: name for name in used for alias in family_names(name)}
    return {
        "names": len(family),
        "missing": [k for k in family if k not in names],
        "stacks": sum(1 for k in family if hasattr(family[k], "entries")),
        "stacks_equal": all(used[names[k]] == family[k] for k in family if hasattr(family[k], "entries")),
        "sources_equal": all(used[names[k]].sources == family[k].sources for k in family if k in names),
    }


def reference_outputs(model_dir: str, state: dict[str, Any], dtype) -> list[tuple[list[int], list[float]]]:
    """Greedy continuation and its logprobs by a transformers model holding ``state``."""
    import torch
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    missing, unexpected = ref.load_state_dict(
        {k: v.to(torch.float32) for k, v in state.items()}, strict=False
    )
    assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
    if dtype == torch.bfloat16:  # the engine computes in bf16: so does the reference
        ref = ref.to(torch.bfloat16)
    ref.eval()
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = list(prompt)
            logps = []
            for _ in range(NEW_TOKENS):
                logits = ref(torch.tensor([ids])).logits[0, -1].float()
                lp = torch.log_softmax(logits, -1)
                tok = int(torch.argmax(lp))
                ids.append(tok)
                logps.append(float(lp[tok]))
            out.append((ids[len(prompt) :], logps))
    return out


def engine_outputs(llm) -> tuple[list[tuple[list[int], list[float]]], list[Any]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, logprobs=0, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
    got = []
    versions = []
    for o in outs:
        c = o.outputs[0]
        toks = list(c.token_ids)
        got.append((toks, [float(step[t].logprob) for step, t in zip(c.logprobs, toks)]))
        versions.append(repr(getattr(c, "weight_versions", None)))
    return got, versions


def compare(got, want) -> dict[str, Any]:
    same = all(g[0] == w[0] for g, w in zip(got, want))
    diff = max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g[1], w[1]))
    return {"tokens_equal": same, "max_logprob_diff": diff, "engine_tokens": [g[0] for g in got]}


def start_engine(model_dir: str, dtype: str):
    """vLLM started from a torchrun rank: torchrun's variables would be read by vLLM's own
    processes (``LOCAL_RANK``, ``RANK``...), so they are cleared while it starts."""
    from vllm import LLM

    saved = {
        k: os.environ.pop(k) for k in list(os.environ) if k in TORCHRUN_VARS or k.startswith("TORCHELASTIC")
    }
    try:
        return LLM(
            model=model_dir,
            skip_tokenizer_init=True,
            dtype=dtype,
            enforce_eager=True,
            max_model_len=128,
            max_num_seqs=4,
            tensor_parallel_size=2,
            weight_transfer_config={"backend": "meshgroups"},
        )
    finally:
        os.environ.update(saved)


TORCHRUN_VARS = {
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_WORLD_SIZE",
    "ROLE_NAME",
}


def shard_trainer(model, mesh) -> None:
    """TP over ``mesh["tp"]`` (q/k/v/gate/up column-wise, o/down row-wise), FSDP2 over ``mesh["dp"]``."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan: dict[str, Any] = {}
    modules = dict(model.named_modules())
    for i, _ in enumerate(model.model.layers):  # MoE experts and routers, MLA stay whole over tp
        styles = [
            ("mlp.gate_proj", ColwiseParallel),
            ("mlp.up_proj", ColwiseParallel),
            ("mlp.down_proj", RowwiseParallel),
        ]
        if f"model.layers.{i}.self_attn.q_proj" in modules:
            styles += [(f"self_attn.{x}_proj", ColwiseParallel) for x in "qkv"] + [
                ("self_attn.o_proj", RowwiseParallel)
            ]
        for name, style in styles:
            if f"model.layers.{i}.{name}" in modules:
                plan[f"model.layers.{i}.{name}"] = style()
    parallelize_module(model, mesh["tp"], plan)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])


def every_rank(outcome: str) -> list[str]:
    import torch.distributed as dist

    seen: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, outcome)
    return seen


def attempt(fn) -> str:
    try:
        fn()
        return "no error"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def refusals(args, model, llm, rank: int, result: dict[str, Any], new_sync):
    """On the engine that serves version 1: a trainer lacking one weight, then a tied-head map
    the trainer's untied head refutes — each refused on every trainer rank; then a new sync object
    (its version taken from the engine) refused a stale ``version=``; it is returned, usable."""
    from meshgroups import Layout
    from meshgroups.engines.vllm._trainer import LLMClient, VLLMWeightSync
    from meshgroups.transfer._names.families import hf_to_vllm

    if rank == 0:
        print("MESHGROUPS-REFUSALS-BEGIN", flush=True)
    client = LLMClient(llm) if rank == 0 else None
    lacking = {n: p for n, p in model.named_parameters() if n != MISSING}
    out: dict[str, Any] = {}
    out["missing"] = every_rank(
        attempt(lambda: VLLMWeightSync(lacking, Layout(dp=2, tp=2), client, timeout=args.timeout))
    )
    tied = hf_to_vllm(model.config, tied_head=True)
    out["tied_head"] = every_rank(
        attempt(
            lambda: VLLMWeightSync(model, Layout(dp=2, tp=2), client, timeout=args.timeout, name_map=tied)
        )
    )
    sync = new_sync()
    out["recovered_version"] = every_rank(str(sync.version))
    out["stale"] = every_rank(attempt(lambda: sync.sync(version=1)))
    out["version_after_stale"] = every_rank(str(sync.version))
    result["refusals"] = out
    return sync


#: The weight the trainer of the refusal check lacks.
MISSING = "model.layers.1.mlp.up_proj.weight"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--fault", choices=["none", "trainer", "worker"], default="none")
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument(
        "--family", action="store_true", help="name_map=hf_to_vllm(config) (a MoE model needs it)"
    )
    ap.add_argument("--bad-family", action="store_true", help="first a family map vLLM's layers refute")
    ap.add_argument("--identity", action="store_true", help="a first sync before any step: outputs unchanged")
    ap.add_argument("--refusals", action="store_true", help="after step 1: refusals, then a new sync object")
    args = ap.parse_args()

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from meshgroups import Layout
    from meshgroups.engines.vllm._trainer import LLMClient, VLLMWeightSync
    from meshgroups.transfer._run.status import TransferError

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=900))
    rank = dist.get_rank()
    result: dict[str, Any] = {"steps": []}
    llm = None
    t0 = time.monotonic()
    if rank == 0:
        llm = start_engine(args.model, args.dtype)
        result["engine_start_s"] = time.monotonic() - t0
    dist.barrier()
    engine_dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    shard_trainer(model, mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-2)
    cast = "bfloat16" if args.dtype == "bfloat16" else None
    family = None
    if args.family:
        from meshgroups.transfer._names.families import hf_to_vllm

        family = hf_to_vllm(model.config)  # Transformers 5: packed experts
    if args.bad_family and family is not None:
        # a family map that disagrees with vLLM's layers (q and k swapped in layer 0's qkv_proj):
        # every rank — trainer and worker — refuses it at init with the same LayoutError; the
        # engine lives on, and the next VLLMWeightSync (below) starts afresh
        from meshgroups.errors import LayoutError
        from meshgroups.transfer import NameMap

        qkv = "model.layers.0.self_attn.qkv_proj.weight"
        q, k, v = family[qkv].sources
        try:
            VLLMWeightSync(
                model, Layout(dp=2, tp=2), LLMClient(llm) if rank == 0 else None, timeout=args.timeout,
                name_map=family | NameMap({qkv: [k, q, v]}),
            )  # fmt: skip
            result["bad_family"] = "no error"
        except LayoutError as exc:
            result["bad_family"] = f"LayoutError: {exc}"
        except Exception as exc:
            result["bad_family"] = f"{type(exc).__name__}: {exc}"
        outcomes: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(outcomes, result["bad_family"])
        result["bad_family"] = outcomes
    t1 = time.monotonic()
    # DeepSeek-V3's router bias is a persistent buffer in transformers (a parameter in vLLM): the
    # module's persistent buffers are read like its parameters
    from meshgroups.transfer._run.torch_io import module_tensors

    buffers = {n: b for n, b in module_tensors(model) if n.endswith("e_score_correction_bias")}

    def new_sync() -> VLLMWeightSync:
        return VLLMWeightSync(
            model,
            Layout(dp=2, tp=2),
            LLMClient(llm) if rank == 0 else None,
            cast=cast,
            timeout=args.timeout,
            bucket_bytes=256 << 10,  # several buckets: a fault lands mid-transfer
            name_map=family,
        )

    sync = VLLMWeightSync(
        model,
        Layout(dp=2, tp=2),
        LLMClient(llm) if rank == 0 else None,
        cast=cast,
        timeout=args.timeout,
        bucket_bytes=256 << 10,  # several buckets: a fault lands mid-transfer
        name_map=family,
    )
    result["init_s"] = time.monotonic() - t1
    if family is not None:
        result["family"] = family_check(family, sync.name_map)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)

    def train_step() -> None:
        tokens = torch.randint(0, vocab, (2, 16), generator=gen)  # the same batch on every rank
        optimizer.zero_grad()
        model(input_ids=tokens, labels=tokens).loss.backward()
        # Qwen3's q/k norms act on each tp rank's own heads (after the column-parallel q/k), so
        # each rank holds part of their gradient: summed over tp, or the replicas would drift apart
        tp_group = mesh["tp"].get_group()
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")) and p.grad is not None:
                grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                dist.all_reduce(grad, group=tp_group)
        optimizer.step()

    def full_state() -> dict[str, Any]:
        return {
            n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in [*model.named_parameters(), *buffers.items()]
        }

    if rank == 0:
        first, _ = engine_outputs(llm)
    state0 = full_state()  # the weights vLLM loaded from the checkpoint: the baseline of the comparison
    if rank == 0:
        got, _ = engine_outputs(llm)
        result["repeat"] = compare(got, first)  # the engine against itself, same weights (its own noise)
        result["before"] = compare(
            got,
            reference_outputs(args.model, {k: v.to(engine_dtype) for k, v in state0.items()}, engine_dtype),
        )
    last_state = None
    if args.identity:  # a sync of the weights vLLM loaded: the commit must give back what vLLM's load made
        sync.sync()
        if rank == 0:
            again, _ = engine_outputs(llm)
            result["identity"] = compare(again, got)
    for step in range(args.steps):
        if args.refusals and step == 1:
            sync.close()
            sync = refusals(args, model, llm, rank, result, new_sync)
        train_step()
        t = time.monotonic()
        version = sync.sync()
        if args.refusals and step == 1 and rank == 0:
            print("MESHGROUPS-REFUSALS-END", flush=True)
        took = time.monotonic() - t
        state = full_state()
        if rank == 0:
            engine_state = {k: v.to(engine_dtype) for k, v in state.items()}
            got, versions = engine_outputs(llm)
            want = reference_outputs(args.model, engine_state, engine_dtype)
            row = compare(got, want)
            row.update(
                version=version,
                engine_version=LLMClient(llm).get_weight_version(),
                output_versions=versions[:1],
                sync_s=took,
                reports=sync.engine_reports(),
                expected_worker_bytes=shard_bytes(engine_state, 2, is_replicated),
                # the sum of what both workers hold: a replicated weight counted once per worker
                expected_checksum=sum(
                    float(v.double().sum()) * (2 if is_replicated(k) else 1) for k, v in engine_state.items()
                ),
                trainer_bytes_sent=sync.last_report.bytes_sent if sync.last_report else None,
                counters=(sync.sync_state.plans, sync.sync_state.group_builds, sync.sync_state.syncs),
            )
            result["steps"].append(row)
        last_state = state
    dist.barrier()

    if args.fault != "none":
        train_step()
        pids = sync.engine_pids()
        fired = threading.Event()

        def progress(p) -> None:
            if p.bucket == 1 and not fired.is_set():
                fired.set()
                if args.fault == "trainer" and rank == 3:
                    os._exit(0)  # a trainer rank gone mid-transfer (exit 0: torchrun keeps the others)
                if args.fault == "worker" and rank == 0:
                    os.kill(pids[1], signal.SIGKILL)  # an engine worker gone mid-transfer

        t = time.monotonic()
        try:
            sync.sync(progress=progress)
            outcome = "no error"
        except TransferError as exc:
            outcome = f"TransferError stage={exc.stage}: {str(exc)[:300]}"
        except Exception as exc:
            outcome = f"{type(exc).__name__}: {str(exc)[:300]}"
        fault = {"outcome": outcome, "error_after_s": time.monotonic() - t}
        if rank == 0:
            assert last_state is not None
            engine_state = {k: v.to(engine_dtype) for k, v in last_state.items()}
            box: dict[str, Any] = {}

            def serve() -> None:
                try:
                    got, _ = engine_outputs(llm)
                    box["row"] = compare(got, reference_outputs(args.model, engine_state, engine_dtype))
                    box["engine_version"] = LLMClient(llm).get_weight_version()
                except Exception as exc:
                    box["refused"] = f"{type(exc).__name__}: {str(exc)[:200]}"

            th = threading.Thread(target=serve, daemon=True)
            th.start()
            th.join(120)
            if th.is_alive():
                box["refused"] = "generate did not return within 120 s"
            fault["after"] = box
        # every rank's outcome, through the transfer world's store (the trainer's world lost a rank)
        sync.world.store.set(f"test/fault/{rank}", json.dumps(fault))
        if rank == 0:
            ranks = [r for r in range(4) if not (args.fault == "trainer" and r == 3)]
            sync.world.store.wait([f"test/fault/{r}" for r in ranks], timedelta(seconds=120))
            result["fault"] = {r: json.loads(sync.world.store.get(f"test/fault/{r}")) for r in ranks}
    if rank == 0:
        result["total_s"] = time.monotonic() - t0
        with open(args.out, "w") as f:
            json.dump(result, f)
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:
            traceback.print_exc()
    if args.fault == "none":
        sync.close()
        dist.barrier()
        dist.destroy_process_group()
    else:
        os._exit(0)  # the trainer's world lost a rank or the engine: no collective teardown


if __name__ == "__main__":
    main()
