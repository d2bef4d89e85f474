"""What ``WeightSync.sync()`` costs over a bare ``execute`` of the same plan, and the bytes a
cast at the sender saves.

Run: ``python benchmarks/bench_weight_sync.py [--layers 2 16 64] [--hidden 128] [--repeat 7]``.

Four real gloo processes on this machine: a trainer with tp=2 (DTensors, fp32) on ranks 0-1, a
rollout with tp=2 (vLLM's fused ``qkv_proj`` / ``gate_up_proj``, bf16 local buffers) on ranks
2-3, a Llama-shaped model of ``--layers`` layers (9 weights each). Per size, in the same
processes, interleaved: ``sync()`` (reads every parameter's description, one small all-reduce
to agree nothing changed, fresh views, ``execute``) against ``execute`` on views and groups
prepared once — the least a hand-written loop does. Median of ``--repeat`` calls (max over
ranks); "overhead" is what ``sync()`` adds. The bytes columns are the trainer's sends: in bf16
(the wire dtype), against the same plan's weights in fp32.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time


def _names(layers: int, hidden: int) -> dict[str, tuple[int, ...]]:
    kv, ffn = hidden // 2, 2 * hidden
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (4 * hidden, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}"
        for name, shape in (
            ("self_attn.q_proj.weight", (hidden, hidden)),
            ("self_attn.k_proj.weight", (kv, hidden)),
            ("self_attn.v_proj.weight", (kv, hidden)),
            ("self_attn.o_proj.weight", (hidden, hidden)),
            ("mlp.gate_proj.weight", (ffn, hidden)),
            ("mlp.up_proj.weight", (ffn, hidden)),
            ("mlp.down_proj.weight", (hidden, ffn)),
            ("input_layernorm.weight", (hidden,)),
            ("post_attention_layernorm.weight", (hidden,)),
        ):
            shapes[f"{p}.{name}"] = shape
    return shapes


def _axis(name: str) -> int | None:
    if "norm" in name:
        return None
    return 1 if ("o_proj" in name or "down_proj" in name) else 0


def _worker(rank: int, world: int, port: int, sizes: list[int], hidden: int, repeat: int, queue) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from meshgroups import Layout
    from meshgroups.transfer import Shard as S
    from meshgroups.transfer import Weight
    from meshgroups.transfer._names.conventions import vllm_map
    from meshgroups.transfer._run.execute import execute
    from meshgroups.transfer._run.jobs import init_job
    from meshgroups.transfer._run.sync import WeightSync

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    trainer, rollout = Layout(tp=2), Layout(tp=2, rank_offset=2)
    rows = []
    with init_job({"trainer": trainer, "rollout": rollout}) as job:
        for layers in sizes:
            shapes = _names(layers, hidden)
            names = vllm_map(list(shapes))
            state = None
            if rank < 2:
                mesh = job["trainer"].mesh
                state = {}
                for n, s in shapes.items():
                    axis = _axis(n)
                    place = [Replicate()] if axis is None else [Shard(axis)]
                    state[n] = distribute_tensor(torch.randn(s), mesh, place)
            roll_w, bufs = [], {}
            for rname, rule in [(n, names.rule(n)) for n in names] + [
                (n, None) for n in shapes if not any(n in names.rule(r).sources for r in names)
            ]:
                parts = [shapes[s] for s in rule.sources] if rule is not None else [shapes[rname]]
                shape = (sum(p[0] for p in parts), *parts[0][1:])
                axis = _axis(rule.sources[0] if rule is not None else rname)
                roll_w.append(Weight(rname, shape, "bfloat16", {} if axis is None else {"tp": S(axis)}))
                local = list(shape)
                if axis is not None:
                    local[axis] //= 2
                bufs[rname] = torch.empty(local, dtype=torch.bfloat16)
            ws = WeightSync(
                state, trainer, bufs if rank >= 2 else None, rollout, rollout_weights=roll_w,
                name_map=names, cast="bfloat16", job=job, timeout=120,
            )  # fmt: skip
            _, trainer_local, rollout_local = ws._read()
            src, dst = ws._views(trainer_local, rollout_local)
            timings: dict[str, list[float]] = {"sync": [], "execute": []}
            for _ in range(repeat):
                for what in ("execute", "sync"):
                    dist.barrier()
                    t0 = time.perf_counter()
                    if what == "sync":
                        report = ws.sync()
                    else:
                        execute(
                            ws.plan, src, dst, bucket_bytes=ws.bucket_bytes, groups=ws.groups, timeout=120
                        )  # type: ignore[arg-type]
                    timings[what].append(time.perf_counter() - t0)
            assert (ws.plans, ws.group_builds) == (1, 1)
            fp32 = sum(link.src.nbytes for link in ws.plan.mapping.links.values())  # type: ignore[union-attr]
            sent = torch.tensor([report.bytes_sent], dtype=torch.int64)
            dist.all_reduce(sent)
            row = [layers, len(shapes), len(ws.plan.mapping.links)]  # type: ignore[union-attr]
            med = torch.tensor([statistics.median(timings["execute"]), statistics.median(timings["sync"])])
            dist.all_reduce(med, op=dist.ReduceOp.MAX)
            rows.append((*row, float(med[0]), float(med[1]), int(sent), fp32))
            ws.close()
    dist.destroy_process_group()
    if rank == 0:
        queue.put(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 16, 64])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(r, 4, port, args.layers, args.hidden, args.repeat, queue))
        for r in range(4)
    ]
    for p in procs:
        p.start()
    rows = queue.get(timeout=1800)
    for p in procs:
        p.join()
    print(f"hidden={args.hidden}, 4 gloo processes (trainer tp=2 fp32 -> rollout tp=2 bf16, fused names)")
    print(
        f"{'layers':>6} {'weights':>7} {'links':>5} {'execute ms':>10} {'sync ms':>8} {'overhead':>8} "
        f"{'sent B (bf16)':>13} {'fp32 B':>10} {'ratio':>5}"
    )
    for layers, weights, links, ex, sy, sent, fp32 in rows:
        print(
            f"{layers:>6} {weights:>7} {links:>5} {ex * 1e3:>10.1f} {sy * 1e3:>8.1f} {sy / ex - 1:>8.1%} "
            f"{sent:>13,} {fp32:>10,} {sent / fp32:>5.2f}"
        )


if __name__ == "__main__":
    main()
