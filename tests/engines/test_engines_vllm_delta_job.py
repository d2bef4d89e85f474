"""The trainer program of ``tests/engines/test_engines_vllm.py::test_delta_and_lora_bf16``, run under
torchrun (4 gloo ranks); no tests here.

One bf16 engine life (tp=2, ``enable_lora=True``) on the tiny Llama, every check after every
sync against a ``transformers`` reference (greedy tokens; ``peft`` for the adapter):

A. delta sync of the full weights (``delta=True``, FSDP2 dp=2 × TP tp=2 trainer, fp32 → bf16):
   version 1 dense, then Adam steps at a small learning rate, each synced as a delta (bytes
   sent against dense per step); then one element of worker 1's receive buffer changed under
   the same version: the next delta is refused by that worker (digest) and it gets dense.
B. a LoRA adapter (PEFT, r=4 on q/v; FSDP2 dp=4) into vLLM's LoRA slots, twice (an Adam step
   of the adapter between): tokens with the adapter = transformers + peft, tokens without =
   the base (untouched), the previous version's adapter still served (``keep=2``).
C. the same adapter merged into the base (``merged_weights``, a delta sync of its own): tokens =
   the reference merge, then one more adapter step as a delta (only the merged layers move).
D. the trainer of A resumed (``resume=``: its shadows, version 4) while the engine's buffers
   hold C's version: the delta is refused by both workers (version) and healed dense; the next
   one is a delta again.

Rank 0 writes what it saw to ``--out`` as JSON.

    torchrun --nproc-per-node 4 tests/engines/test_engines_vllm_delta_job.py --model DIR --out OUT.json  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from typing import Any

from tests.engines.test_engines_vllm_job import (
    PROMPTS,
    TORCHRUN_VARS,
    compare,
    engine_outputs,
    is_replicated,
    reference_outputs,
    shard_trainer,
)


def start_engine(model_dir: str):
    from vllm import LLM

    saved = {
        k: os.environ.pop(k) for k in list(os.environ) if k in TORCHRUN_VARS or k.startswith("TORCHELASTIC")
    }
    try:
        return LLM(
            model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True, max_model_len=128,
            max_num_seqs=4, tensor_parallel_size=2, enable_lora=True, max_loras=2, max_lora_rank=8,
            weight_transfer_config={"backend": "meshgroups"},
        )  # fmt: skip
    finally:
        os.environ.update(saved)


def lora_outputs(llm, request) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=6, temperature=0.0, detokenize=False)
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, lora_request=request, use_tqdm=False
    )
    return [list(o.outputs[0].token_ids) for o in outs]


def peft_reference(model_dir: str, base: dict, lora: dict, config: Any) -> list[list[int]]:
    """Greedy tokens of transformers + peft in bf16: the base ``base``, the adapter ``lora``."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ref.load_state_dict({k: v.to(torch.float32) for k, v in base.items()}, strict=False)
    ref = get_peft_model(ref, config)
    state = {k: v for k, v in ref.named_parameters()}
    with torch.no_grad():
        for k, v in lora.items():
            state[k].copy_(v)
    ref = ref.to(torch.bfloat16).eval()
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = list(prompt)
            for _ in range(6):
                ids.append(int(torch.argmax(ref(torch.tensor([ids])).logits[0, -1].float())))
            out.append(ids[len(prompt) :])
    return out


def corrupt_worker_1(worker) -> str:
    """Run in each engine worker (``collective_rpc``): worker 1 adds 1 to one element of a
    receive buffer — the same version, other values."""
    import torch
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    engine = worker.weight_transfer_engine
    if get_tensor_model_parallel_rank() != 1:
        return "untouched"
    name = next(n for n in engine.buffers if "qkv_proj" in n)
    with torch.no_grad():
        engine.buffers[name].view(-1)[7] += 1.0
    return name


def worker_buffers(worker) -> dict[str, Any]:
    """Run in each engine worker (``collective_rpc``): its receive buffers (what it committed)."""
    return {n: b.clone() for n, b in worker.weight_transfer_engine.buffers.items()}


def expected_shard(state: dict[str, Any], name: str, r: int, tp: int = 2):
    """What vLLM's tp rank ``r`` holds of ``name``, cut from the full HF ``state`` (an oracle
    that never looks at the plan): fused q ‖ k ‖ v and gate ‖ up of this rank's rows, row-parallel
    columns, vocab rows, the rest whole."""
    import torch

    def rows(n: str):
        return state[n].chunk(tp, dim=0)[r]

    if ".qkv_proj." in name:
        return torch.cat([rows(name.replace("qkv_proj", f"{x}_proj")) for x in "qkv"])
    if ".gate_up_proj." in name:
        return torch.cat([rows(name.replace("gate_up_proj", x)) for x in ("gate_proj", "up_proj")])
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return state[name].chunk(tp, dim=1)[r]
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return rows(name)
    return state[name]


def buffers_exact(llm, state: dict[str, Any]) -> bool:
    """Every element every worker holds equals the oracle's bf16 cast, bit for bit."""
    import torch

    for r, bufs in enumerate(llm.collective_rpc(worker_buffers)):
        for name, buf in bufs.items():
            want = expected_shard(state, name, r).to(torch.bfloat16)
            if not torch.equal(buf.view(torch.int16), want.view(torch.int16)):
                return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--timeout", type=float, default=60.0)
    args = ap.parse_args()

    import torch
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from meshgroups import Layout
    from meshgroups.engines.vllm._lora import LoRA, lora_config, merge, merged_weights, scaling
    from meshgroups.engines.vllm._trainer import LLMClient, VLLMWeightSync

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=900))
    rank = dist.get_rank()
    out: dict[str, Any] = {"rows": []}
    t0 = time.monotonic()
    llm = start_engine(args.model) if rank == 0 else None
    if rank == 0:
        out["engine_start_s"] = time.monotonic() - t0
    dist.barrier()
    client = LLMClient(llm) if rank == 0 else None
    bf16 = torch.bfloat16

    def full(module) -> dict[str, Any]:
        return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in module.named_parameters()}  # fmt: skip

    def row(label: str, sync, state=None, lora=None, extra=None) -> None:
        """After a sync: rank 0 compares the engine with the reference and records the figures."""
        d = sync.last_report.delta if sync.last_report is not None else None
        r: dict[str, Any] = {"label": label, "version": sync.version}
        if d is not None:
            r.update(ratio=d.ratio, payload=d.payload_ratio, refused=list(d.refused), reasons=list(d.reasons),
                     base=d.base, dense=d.total_dense, sent=d.total_sent)  # fmt: skip
        if rank == 0:
            r["engine_version"] = client.get_weight_version()
            if state is not None:
                engine_state = {k: v.to(bf16) for k, v in state.items()}
                got, _ = engine_outputs(llm)
                r.update(compare(got, reference_outputs(args.model, engine_state, bf16)))
                reports = sync.engine_reports()
                r["checksum"] = sum(reports[w]["checksum"] for w in reports)
                r["expected_checksum"] = sum(
                    float(v.double().sum()) * (2 if is_replicated(k) else 1) for k, v in engine_state.items()
                )
                r["buffers_exact"] = buffers_exact(llm, state)
            if extra:
                r.update(extra())
        out["rows"].append(r)

    # ---------------------------------------------------------------- A: delta sync, full weights
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    shard_trainer(model, mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-5)
    gen = torch.Generator().manual_seed(1)

    def train(module, opt) -> None:
        tokens = torch.randint(0, module.config.vocab_size, (2, 16), generator=gen)
        opt.zero_grad()
        module(input_ids=tokens, labels=tokens).loss.backward()
        opt.step()

    def new_sync(**kw) -> VLLMWeightSync:
        return VLLMWeightSync(model, Layout(dp=2, tp=2), client, cast="bfloat16", timeout=args.timeout,
                              bucket_bytes=256 << 10, delta=True, **kw)  # fmt: skip

    sync = new_sync()
    t = time.monotonic()
    sync.sync()
    out["first_sync_s"] = time.monotonic() - t
    row("A1 first (dense)", sync, full(model))
    for i in (2, 3):
        train(model, optimizer)
        t = time.monotonic()
        sync.sync()
        out.setdefault("delta_sync_s", []).append(time.monotonic() - t)
        row(f"A{i} adam", sync, full(model))
    if rank == 0:
        out["corrupted"] = llm.collective_rpc(corrupt_worker_1)
    train(model, optimizer)
    sync.sync()
    row("A4 worker 1 changed", sync, full(model))
    base_state = full(model)  # what the engine's base now is (version 4)
    sync.close()

    # ---------------------------------------------------------------- B: a LoRA adapter
    torch.manual_seed(7)  # the same adapter on every rank
    peft_model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    peft_model.load_state_dict(base_state, strict=False)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    peft_model = get_peft_model(peft_model, config)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.05)  # PEFT starts B at zero (a no-op adapter): make it act
    dp4 = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    for layer in peft_model.base_model.model.model.layers:
        fully_shard(layer, mesh=dp4)
    fully_shard(peft_model, mesh=dp4)
    lora_opt = torch.optim.Adam([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)

    def adapter_state() -> dict[str, Any]:
        return {n: v for n, v in full(peft_model).items() if "lora_" in n}

    # the adapter's versions in this test's own directory (another run on the machine has its own)
    root = os.path.join(os.path.dirname(os.path.abspath(args.out)), "lora")
    lora = LoRA("policy", lora_config(peft_model), keep=2, root=root)
    lsync = VLLMWeightSync(peft_model, Layout(dp=4), client, cast="bfloat16", timeout=args.timeout, lora=lora)
    for i in (5, 6):
        if i == 6:
            train(peft_model, lora_opt)
        lsync.sync()
        adapter = adapter_state()

        def lora_check(adapter=adapter, i=i) -> dict[str, Any]:
            if rank == 0:
                print("MESHGROUPS-ADAPTERS", lsync.engine_reports(), repr(lsync.lora_request()), flush=True)
            want = peft_reference(args.model, base_state, adapter, config)
            got = lora_outputs(llm, lsync.lora_request())
            plain = lora_outputs(llm, None)  # the base: what version 4 generated
            res = {"adapters": {w: rep.get("adapter") for w, rep in lsync.engine_reports().items()},
                   "request": repr(lsync.lora_request()), "lora_tokens_equal": got == want, "lora_tokens": got, "reference_tokens": want,
                   "base_untouched": plain == out["rows"][3]["engine_tokens"], "differs_from_base": got != plain}  # fmt: skip
            if i == 6:  # keep=2: version 5's adapter is still served, as it was
                res["previous_served"] = (
                    lora_outputs(llm, lsync.lora_request(5)) == out["rows"][-1]["lora_tokens"]
                )
            return res

        row(f"B{i} lora adapter", lsync, extra=lora_check)
    lsync.close()

    # ---------------------------------------------------------------- C: merged into the base
    def merged_reference() -> dict[str, Any]:
        """The reference merge on full tensors (rank 0 compares with the engine)."""
        st = full(peft_model)
        ref = {}
        scale = scaling(lora_config(peft_model))
        for n, v in st.items():
            if "lora_" in n:
                continue
            base = n.removeprefix("base_model.model.").replace(".base_layer.", ".")
            owner = n.rsplit(".", 1)[0].removesuffix(".base_layer")
            a = st.get(f"{owner}.lora_A.default.weight") if n.endswith(".base_layer.weight") else None
            ref[base] = v if a is None else merge(v, a, st[f"{owner}.lora_B.default.weight"], scale)
        return ref

    msync = VLLMWeightSync(merged_weights(peft_model), Layout(dp=4), client, cast="bfloat16",
                           timeout=args.timeout, delta=True)  # fmt: skip
    msync.sync()
    row("C7 merged (dense)", msync, merged_reference())
    train(peft_model, lora_opt)
    msync.model = merged_weights(peft_model)  # the merged shards of the new adapter
    msync.sync_state.trainer = msync.model
    msync.sync()
    row("C8 merged, one more step (delta)", msync, merged_reference())
    msync.close()

    # ---------------------------------------------------------------- D: a delta on a stale base
    sync2 = new_sync(resume=sync)
    out["resumed_version"] = sync2.sync_state.version
    train(model, optimizer)
    sync2.sync()
    row("D9 resumed at 4, the engine holds 8", sync2, full(model))
    train(model, optimizer)
    sync2.sync()
    row("D10 delta again", sync2, full(model))
    sync2.close()
    out["total_s"] = time.monotonic() - t0
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(out, f)
        llm.llm_engine.engine_core.shutdown()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
