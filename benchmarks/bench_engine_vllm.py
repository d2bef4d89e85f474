"""Per-sync time and bytes: meshgroups' shard-to-shard sync vs vLLM's ``nccl`` backend's scheme.

vLLM's built-in ``nccl`` backend (trainer rank 0 gathers every full tensor and broadcasts it to
every worker, which loads its shard out of it) needs CUDA (``PyNcclCommunicator``), so it cannot
run on this CPU engine. Its scheme is measured here in meshgroups' harness instead, over the same
separate worlds the real engine uses: 4 trainer processes in a world of their own (a Llama-shaped
model, HF names, FSDP2 dp=2 × TP tp=2, fp32) and 2 "engine" processes in another (vLLM's fused
layout at tp=2: ``qkv_proj``, ``gate_up_proj``, vocab-parallel embedding, built by
``meshgroups.engines.vllm._destination`` as a vLLM worker would), joined by a ``TransferWorld``:

- **meshgroups**: ``WeightSync.sync()`` in the transfer world (each worker receives its shard);
- **full broadcast** (the ``nccl`` scheme): per weight, ``full_tensor()`` over the trainer's
  world, then one broadcast from trainer rank 0 to both workers (a group of the three), each
  worker copying its shard (its fused parts' rows) out of the full tensors.

    python benchmarks/bench_engine_vllm.py [--layers 2 8] [--hidden 256] [--repeat 5]

Prints a table: median per-sync time, bytes each worker receives, bytes trainer rank 0 sends.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _model(layers: int, hidden: int, heads: int, kv: int, ffn: int, vocab: int):
    import torch
    from torch import nn

    hd = hidden // heads
    root = nn.Module()
    root.model = nn.Module()
    root.model.embed_tokens = nn.Embedding(vocab, hidden)
    root.model.layers = nn.ModuleList()
    for _ in range(layers):
        layer = nn.Module()
        layer.self_attn = nn.Module()
        for n, rows in (("q_proj", heads * hd), ("k_proj", kv * hd), ("v_proj", kv * hd)):
            setattr(layer.self_attn, n, nn.Linear(hidden, rows, bias=False))
        layer.self_attn.o_proj = nn.Linear(heads * hd, hidden, bias=False)
        layer.mlp = nn.Module()
        layer.mlp.gate_proj = nn.Linear(hidden, ffn, bias=False)
        layer.mlp.up_proj = nn.Linear(hidden, ffn, bias=False)
        layer.mlp.down_proj = nn.Linear(ffn, hidden, bias=False)
        layer.input_layernorm = nn.Module()
        layer.input_layernorm.weight = nn.Parameter(torch.ones(hidden))
        layer.post_attention_layernorm = nn.Module()
        layer.post_attention_layernorm.weight = nn.Parameter(torch.ones(hidden))
        root.model.layers.append(layer)
    root.model.norm = nn.Module()
    root.model.norm.weight = nn.Parameter(torch.ones(hidden))
    return root


def _params(model, tp: int):
    """The vLLM worker's parameters (what ``read_params`` reads from a vLLM Llama)."""
    from meshgroups.engines.vllm._destination import Param

    out = []
    for name, p in model.named_parameters():
        if ".q_proj." in name:
            base = name.replace("q_proj", "{}")
            sizes = [model.get_parameter(base.format(x)).shape[0] for x in ("q_proj", "k_proj", "v_proj")]
            rows = sum(sizes) // tp
            parts = tuple((base.format(x), s, s) for x, s in zip(("q_proj", "k_proj", "v_proj"), sizes))
            out.append(Param(base.format("qkv_proj"), (rows, p.shape[1]), "float32", 0, parts))
        elif ".gate_proj." in name:
            base = name.replace("gate_proj", "{}")
            f = p.shape[0]
            parts = ((base.format("gate_proj"), f, f), (base.format("up_proj"), f, f))
            out.append(Param(base.format("gate_up_proj"), (2 * f // tp, p.shape[1]), "float32", 0, parts))
        elif any(k in name for k in (".k_proj.", ".v_proj.", ".up_proj.")):
            continue
        elif "o_proj" in name or "down_proj" in name:
            out.append(Param(name, (p.shape[0], p.shape[1] // tp), "float32", 1))
        elif "embed_tokens" in name:
            out.append(Param(name, (p.shape[0] // tp, p.shape[1]), "float32", 0))
        else:
            out.append(Param(name, tuple(p.shape), "float32"))
    return out


def worker(rank: int, ports: list[int], args: argparse.Namespace, layers: int, queue) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from meshgroups import Layout
    from meshgroups.engines._worlds import TransferWorld
    from meshgroups.engines.vllm._destination import destinations
    from meshgroups.transfer._run.sync import WeightSync

    torch.set_num_threads(1)
    trainer_side = rank < 4
    own, size = (rank, 4) if trainer_side else (rank - 4, 2)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{ports[0 if trainer_side else 1]}", rank=own, world_size=size,
        timeout=timedelta(seconds=300),
    )  # fmt: skip
    torch.manual_seed(0)
    model = _model(layers, args.hidden, args.heads, args.kv_heads, 2 * args.hidden, args.vocab)
    params = _params(model, 2)
    weights, name_map = destinations(params, 2)
    buffers = {p.name: torch.zeros(p.local_shape) for p in params}
    if trainer_side:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        plan = {}
        for i in range(layers):
            for n in (
                "self_attn.q_proj",
                "self_attn.k_proj",
                "self_attn.v_proj",
                "mlp.gate_proj",
                "mlp.up_proj",
            ):
                plan[f"model.layers.{i}.{n}"] = ColwiseParallel()
            for n in ("self_attn.o_proj", "mlp.down_proj"):
                plan[f"model.layers.{i}.{n}"] = RowwiseParallel()
        parallelize_module(model, mesh["tp"], plan)
        fully_shard(model, mesh=mesh["dp"])
    if rank == 0:
        tw = TransferWorld(TransferWorld.serve(port=ports[2]), 0, 6, timeout=300)
    else:
        tw = TransferWorld.join(f"127.0.0.1:{ports[2]}", rank, 6, timeout=300)
    with tw.active():
        sync = WeightSync(
            model if trainer_side else None, Layout(dp=2, tp=2), None if trainer_side else buffers,
            Layout(tp=2, rank_offset=4), rollout_weights=weights, name_map=name_map,
        )  # fmt: skip
        bcast = dist.new_group([0, 4, 5])  # the nccl scheme's group: trainer rank 0 + every worker
    ours: list[float] = []
    theirs: list[float] = []
    received = {"meshgroups": 0, "broadcast": 0}
    sent = {"meshgroups": 0, "broadcast": 0}
    names = [n for n, _ in model.named_parameters()]
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    tp_rank = rank - 4
    for _ in range(args.repeat):
        with tw.active():
            dist.barrier()
            t = time.perf_counter()
            report = sync.sync()
            dist.barrier()
            ours.append(time.perf_counter() - t)
        received["meshgroups"], sent["meshgroups"] = report.bytes_received, report.bytes_sent
        # the nccl scheme
        nbytes = 0
        t = time.perf_counter()
        full: dict[str, torch.Tensor] = {}
        for name in names:
            if trainer_side:
                p = model.get_parameter(name)
                tensor = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
            else:
                tensor = torch.empty(shapes[name])
            if rank in (0, 4, 5):
                with tw.active():
                    dist.broadcast(tensor, src=0, group=bcast)
                nbytes += tensor.numel() * tensor.element_size()
            if not trainer_side:
                full[name] = tensor
        if not trainer_side:  # each worker loads its shard (its parts' rows) out of the full tensors
            with torch.no_grad():
                for w in params:
                    src = [s for s, _, _ in w.parts] if w.parts else [w.name]
                    axis = w.axis if w.axis is not None else 0
                    pieces = [full[s].chunk(2, axis)[tp_rank] if w.axis is not None else full[s] for s in src]
                    buffers[w.name].copy_(torch.cat(pieces, axis) if len(pieces) > 1 else pieces[0])
        with tw.active():
            dist.barrier()
        theirs.append(time.perf_counter() - t)
        received["broadcast"] = nbytes if not trainer_side else 0
        sent["broadcast"] = nbytes if rank == 0 else 0
    queue.put((rank, statistics.median(ours), statistics.median(theirs), received, sent, len(weights)))
    with tw.active():
        sync.close()
    tw.close()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()

    import torch.multiprocessing as mp

    from tests.support.dist import free_port

    ctx = mp.get_context("spawn")
    print(
        "| layers | weights | meshgroups sync | full broadcast (nccl scheme) | bytes/worker meshgroups | bytes/worker broadcast | rank 0 sends meshgroups | rank 0 sends broadcast |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for layers in args.layers:
        ports = [free_port() for _ in range(3)]
        queue = ctx.Queue()
        procs = [
            ctx.Process(target=worker, args=(r, ports, args, layers, queue), daemon=True) for r in range(6)
        ]
        for p in procs:
            p.start()
        rows = dict((r, rest) for r, *rest in (queue.get(timeout=600) for _ in procs))
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
        ours = max(rows[r][0] for r in rows)
        theirs = max(rows[r][1] for r in rows)
        recv, sent, weights = rows[4][2], rows[0][3], rows[0][4]
        print(
            f"| {layers} | {weights} | {ours * 1e3:.1f} ms | {theirs * 1e3:.1f} ms | {recv['meshgroups'] / 2**20:.2f} MiB | "
            f"{recv['broadcast'] / 2**20:.2f} MiB | {sent['meshgroups'] / 2**20:.2f} MiB | {sent['broadcast'] / 2**20:.2f} MiB |"
        )


if __name__ == "__main__":
    main()
