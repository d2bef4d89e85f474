"""Delta sync against dense: bytes and time per sync, for several learning rates and rollout
dtypes.

Run: ``python benchmarks/bench_delta_sync.py [--hidden 256] [--layers 2] [--steps 3]
[--lrs 1e-6 1e-5 1e-4 1e-3] [--dtypes bfloat16 float16 float32]``.

Four real gloo processes on this machine: a trainer with tp=2 (fp32 DTensors, initialised as
LLMs are: normal, std 0.02; norms at 1) on ranks 0-1, a rollout with tp=2 on ranks 2-3 holding
vLLM's fused ``qkv_proj`` / ``gate_up_proj`` in the given dtype. Per (dtype, learning rate), in
the same processes: a ``WeightSync(delta=True)`` (its first sync dense), then ``--steps`` Adam
steps (a random gradient, the same on every rank, scaled like a loss's), each followed by a
delta sync; and a plain ``WeightSync`` doing the same dense. Per config: the fraction of
rollout elements that changed per step (mean), the bytes a delta sync sent against dense
(headers and base checks included; the payload alone), and the median time of a delta and a
dense sync (max over ranks). Every delta sync is checked bit-exact against the dense one's
buffers.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time


def _shapes(layers: int, hidden: int) -> dict[str, tuple[int, ...]]:
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


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from meshgroups import Layout
    from meshgroups.transfer import Shard as S
    from meshgroups.transfer import Weight, WeightSync, init_job, vllm_map

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    trainer, rollout = Layout(tp=2), Layout(tp=2, rank_offset=2)
    shapes = _shapes(args.layers, args.hidden)
    names = vllm_map(list(shapes))
    rows = []
    with init_job({"trainer": trainer, "rollout": rollout}) as job:
        for dtype in args.dtypes:
            for lr in args.lrs:
                gen = torch.Generator().manual_seed(0)
                state = None
                if rank < 2:
                    mesh = job["trainer"].mesh
                    state = {}
                    for n, s in shapes.items():
                        axis = _axis(n)
                        init = torch.ones(s) if axis is None else torch.randn(s, generator=gen) * 0.02
                        place = [Replicate()] if axis is None else [Shard(axis)]
                        state[n] = torch.nn.Parameter(distribute_tensor(init, mesh, place))
                    opt = torch.optim.Adam(list(state.values()), lr=lr)
                roll_w, bufs, dense_bufs = [], {}, {}
                fused = {src for r in names for src in names.rule(r).sources}
                plain = [(n, None) for n in shapes if n not in fused]  # the same name on both sides
                for rname, rule in [(n, names.rule(n)) for n in names] + plain:
                    sources = rule.sources if rule is not None else (rname,)
                    parts = [shapes[s] for s in sources]
                    shape = (sum(p[0] for p in parts), *parts[0][1:])
                    axis = _axis(sources[0])
                    roll_w.append(Weight(rname, shape, dtype, {} if axis is None else {"tp": S(axis)}))
                    local = list(shape)
                    if axis is not None:
                        local[axis] //= 2
                    bufs[rname] = torch.zeros(local, dtype=getattr(torch, dtype))
                    dense_bufs[rname] = torch.zeros(local, dtype=getattr(torch, dtype))
                kw = dict(rollout_weights=roll_w, name_map=names, cast=True, job=job, timeout=300)
                delta = WeightSync(state, trainer, bufs if rank >= 2 else None, rollout, delta=True, **kw)
                dense = WeightSync(state, trainer, dense_bufs if rank >= 2 else None, rollout, **kw)
                delta.sync()
                dense.sync()
                times: dict[str, list[float]] = {"delta": [], "dense": []}
                ratios, payloads, changed = [], [], []
                for _ in range(args.steps):
                    before = {n: b.clone() for n, b in bufs.items()}
                    if rank < 2:
                        opt.zero_grad()
                        for p in state.values():  # type: ignore[union-attr]
                            g = torch.randn(p.shape, generator=gen) * 1e-3
                            p.grad = distribute_tensor(g, p.device_mesh, p.placements)
                        opt.step()
                    for what, ws in (("dense", dense), ("delta", delta)):
                        dist.barrier()
                        t0 = time.perf_counter()
                        report = ws.sync()
                        times[what].append(time.perf_counter() - t0)
                    d = report.delta
                    ratios.append(d.ratio)
                    payloads.append(d.payload_ratio)
                    if rank >= 2:
                        for n in bufs:  # bit-exact against the dense sync's buffers
                            if not torch.equal(bufs[n].view(torch.uint8), dense_bufs[n].view(torch.uint8)):
                                raise AssertionError(
                                    f"delta sync of {n} is not the dense one's ({dtype}, lr={lr})"
                                )
                    mine = rank >= 2  # the rollout's elements only (the trainer ranks hold no rollout)
                    n_all = sum(b.numel() for b in bufs.values()) if mine else 0
                    n_changed = sum(int((bufs[x] != before[x]).sum()) for x in bufs) if mine else 0
                    counts = torch.tensor([n_changed, n_all], dtype=torch.int64)
                    dist.all_reduce(counts)
                    changed.append(int(counts[0]) / int(counts[1]))
                med = torch.tensor([statistics.median(times["delta"]), statistics.median(times["dense"])])
                dist.all_reduce(med, op=dist.ReduceOp.MAX)
                rows.append((dtype, lr, statistics.mean(changed), statistics.median(ratios),
                             statistics.median(payloads), float(med[0]), float(med[1]), d.total_dense))  # fmt: skip
                delta.close()
                dense.close()
    dist.destroy_process_group()
    if rank == 0:
        queue.put(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 1e-5, 1e-4, 1e-3])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16", "float32"])
    args = parser.parse_args()
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, 4, port, args, queue)) for r in range(4)]
    for p in procs:
        p.start()
    rows = queue.get(timeout=3600)
    for p in procs:
        p.join()
    print(
        f"hidden={args.hidden}, layers={args.layers}, 4 gloo processes (trainer tp=2 fp32, Adam -> rollout tp=2), "
        f"{args.steps} steps per row; dense bytes per sync: {rows[0][-1]:,} (bf16)"
    )
    print(
        f"{'dtype':>9} {'lr':>7} {'changed':>8} {'sent/dense':>10} {'payload':>8} {'delta ms':>8} {'dense ms':>8}"
    )
    for dtype, lr, changed, ratio, payload, t_delta, t_dense, _ in rows:
        print(
            f"{dtype:>9} {lr:>7.0e} {changed:>8.2%} {ratio:>10.3f} {payload:>8.3f} {t_delta * 1e3:>8.1f} "
            f"{t_dense * 1e3:>8.1f}"
        )


if __name__ == "__main__":
    main()
