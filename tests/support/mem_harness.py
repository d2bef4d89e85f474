"""Train the test transformer (``tests/support/mem_model.py``) one step under a layout and count
what each rank holds at its peak, by category (``tests/support/live_memory.py``).

A configuration is a dict: ``sizes`` (the layout, dims named after the cost model's roles),
``sp`` (sequence parallelism), ``recompute`` (a policy of ``mem_model.POLICIES``), ``attention``
(``"flash"`` / ``"eager"``), ``micro_batches``, and for pipelines ``schedule`` (``"1f1b"`` /
``"interleaved"``), ``virtual_stages`` and ``layers_per_stage`` (one entry per model chunk, in
pipeline order). Every configuration trains as torchtitan does: tensor parallelism with
sequence parallelism (``parallelize_module``), then recomputation (``checkpoint_wrapper``), then
FSDP2 (``fully_shard`` per block and the root, ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)``: fp32 stored, bf16 computed), AdamW (``fused=True``), a warm-up step, then
the counted step: forward, the loss on fp32 logits, the logits dropped (``del``), backward, the
optimizer step. Context parallelism cuts the sequence over ``cp`` and runs the attention core as
ring attention keeps it (``mem_model.build(cp_group=...)``).
"""

from __future__ import annotations

import contextlib
from typing import Any

__all__ = ["measure"]


def _states(net: Any, opt: Any) -> tuple[int, int, int]:
    """Bytes of the distinct storages behind the parameters' local shards, their gradients and
    the optimizer's state (FSDP2's sharded gradients are views of one buffer per unit)."""

    def total(tensors: Any) -> int:
        seen: dict[int, int] = {}
        for t in tensors:
            t = t.to_local() if hasattr(t, "to_local") else t
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        return sum(seen.values())

    params = list(net.parameters())
    grads = [x.grad for x in params if x.grad is not None]
    return total(params), total(grads), total(v for x in params for v in opt.state[x].values())


def _tp_plan(spec: Any, sp: bool, blocks: Any) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    seq = Shard(1) if sp else Replicate()
    plan: dict[str, Any] = {
        "embedding": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
    }
    if sp:
        plan["final_norm"] = SequenceParallel()
    cols = [t.name for t in spec.tensors() if t.where == "layer" and t.tp_axis == 0]
    for i in blocks:
        for name in cols:
            plan[f"layers.{i}.{name}"] = ColwiseParallel(input_layouts=seq)
        plan[f"layers.{i}.o"] = RowwiseParallel(output_layouts=seq)
        plan[f"layers.{i}.fc2"] = RowwiseParallel(output_layouts=seq)
        if sp:
            plan[f"layers.{i}.attn_norm"] = SequenceParallel()
            plan[f"layers.{i}.mlp_norm"] = SequenceParallel()
    return plan


def _chunks(net: Any, spec: Any, cfg: dict[str, Any], pp: int) -> list[Any]:
    """The model cut into ``pp × v`` chunk modules in pipeline order (the embedding in the
    first, the final norm and the head in the last)."""
    from torch import nn

    from meshgroups.cost._pipeline import chunk_layers, chunk_ranges

    v = cfg.get("virtual_stages", 1)
    ranges = chunk_ranges(chunk_layers(spec.layers, pp * v, cfg.get("layers_per_stage")))

    class Chunk(nn.Module):
        def __init__(self, c: int, span: range) -> None:
            super().__init__()
            self.embedding = net.embedding if c == 0 else None
            self.layers = nn.ModuleList([net.layers[i] for i in span])
            last = c == pp * v - 1
            self.final_norm = net.final_norm if last else None
            self.head = net.head if last else None

        def forward(self, x: Any) -> Any:
            if self.embedding is not None:
                x = self.embedding(x)
            s = x.shape[1]
            for layer in self.layers:
                x = layer(x, self.rope_cos[:s], self.rope_sin[:s])
            if self.head is not None:
                x = self.head(self.final_norm(x))
            return x

    out = []
    for c, span in enumerate(ranges):
        chunk = Chunk(c, span)
        chunk.rope_cos, chunk.rope_sin = net.cos, net.sin  # plain attributes: not buffers
        out.append(chunk)
    return out


def _measure_pipeline(spec: Any, cfg: dict[str, Any], rank: int, seed: int) -> dict[str, Any]:
    """A pipeline-only layout: torch's own schedules (``Schedule1F1B`` or
    ``ScheduleInterleaved1F1B``) over the chunks this rank's stage runs, fp32 throughout."""
    import torch
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    from meshgroups import Layout, init_mesh
    from meshgroups.cost._pipeline import stage_chunks

    from .live_memory import LiveMemory
    from .mem_model import build, recompute

    layout = Layout(**cfg["sizes"])
    mg = init_mesh(layout)
    try:
        pp, v, m = layout.size("pp"), cfg.get("virtual_stages", 1), cfg["micro_batches"]
        stage = layout.coords(rank)["pp"]
        net = build(spec, cfg.get("attention", "flash"), seed=seed)
        recompute(net, cfg.get("recompute", "none"), cfg.get("every", 2))
        chunks = _chunks(net, spec, cfg, pp)
        mine = stage_chunks(pp, v, stage)
        modules = [chunks[c] for c in mine]
        # drop the other stages' chunks: only what this rank runs stays alive
        net.embedding = net.layers = net.final_norm = net.head = None
        del chunks[: len(chunks)], build
        chunks_mine = dict(zip(mine, modules))
        stages = [
            PipelineStage(chunks_mine[c], c, pp * v, torch.device("cpu"), group=mg.group("pp")) for c in mine
        ]
        live = LiveMemory()
        last = pp * v - 1
        for mod in modules:
            for layer in mod.layers:
                layer.register_forward_pre_hook(lambda *_: live.set("activations"))
            if mod.embedding is not None:
                mod.embedding.register_forward_pre_hook(lambda *_: live.set("activations"))
            if mod.head is not None:
                mod.head.register_forward_pre_hook(lambda *_: live.set("loss"))
                mod.final_norm.register_full_backward_pre_hook(lambda *_: live.set("activations"))

        def loss_fn(logits: Any, target: Any) -> Any:
            out = net.loss(logits, target)
            out.register_hook(lambda g: live.set("loss") or g)
            return out

        if v == 1:
            schedule: Any = Schedule1F1B(stages[0], n_microbatches=m, loss_fn=loss_fn)
        else:
            schedule = ScheduleInterleaved1F1B(stages, n_microbatches=m, loss_fn=loss_fn)
        params = [p for mod in modules for p in mod.parameters()]
        opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
        opt.register_step_pre_hook(lambda *_: live.set("optimizer"))
        opt.register_step_post_hook(lambda *_: live.set("activations"))
        gen = torch.Generator().manual_seed(7)

        def step(counted: bool) -> None:
            ids = torch.randint(0, spec.vocab, (spec.micro_batch * m, spec.seq_len + 1), generator=gen)
            inputs = ids[:, :-1].clone() if 0 in mine else None
            target = ids[:, 1:].clone() if last in mine else None
            del ids
            args = (inputs,) if inputs is not None else ()
            kwargs = {"target": target, "losses": []} if target is not None else {}
            schedule.step(*args, return_outputs=False, **kwargs)
            del inputs, target, args, kwargs
            opt.step()
            if not counted:
                opt.zero_grad(set_to_none=True)

        step(False)  # warm-up: shapes exchanged, receive buffers made, AdamW's state
        import gc

        gc.collect()
        # what the stages made in the warm-up and keep: a receive buffer per micro-batch for
        # each input and each output gradient (torch's PipelineStage)
        kept = [
            info.buffer
            for st in stages
            for table in (st.args_recv_info, st.grad_recv_info)
            for infos in table.values()
            for info in infos
            if getattr(info, "buffer", None) is not None
        ]
        torch_peak = None
        with contextlib.ExitStack() as stack:
            if cfg.get("memtracker"):
                # torch's own tracker around the same step: its peak must be ours
                from torch.distributed._tools.mem_tracker import MemTracker

                tracker = MemTracker()
                tracker.track_external(*modules, opt, *kept, *net.buffers())
                stack.enter_context(tracker)
            stack.enter_context(live)
            live.track(params, "params")
            live.track([x for st in opt.state.values() for x in st.values()], "optimizer")
            live.track(net.buffers(), "other")
            live.track(kept, "pipeline buffers")
            del kept
            live.reset_peak()
            if cfg.get("trace"):
                live.trace = []
            step(True)
        if cfg.get("memtracker"):
            torch_peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
        known = {
            "params": params,
            "grads": [p.grad for p in params if p.grad is not None],
            "optimizer": [x for p in params for x in opt.state[p].values()],
        }
        return {
            "peak": live.peak,
            "breakdown": live.breakdown(**known),
            "states": _states(torch.nn.ModuleList(modules), opt),
            "where": live.peak_where,
            "trace": live.trace,
            "live": sorted(live.at_peak.values()) if cfg.get("trace") else None,
            "torch_peak": torch_peak,
        }
    finally:
        mg.close()


def measure(spec: Any, cfg: dict[str, Any], rank: int, seed: int = 0) -> dict[str, Any]:
    """One configuration on this rank: ``{"peak": bytes, "breakdown": {category: bytes},
    "states": (params, grads, optimizer)}`` (see the module docstring)."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    from meshgroups import Layout, init_mesh

    from .live_memory import LiveMemory
    from .mem_model import build, recompute

    if cfg["sizes"].get("pp", 1) > 1:
        return _measure_pipeline(spec, cfg, rank, seed)
    layout = Layout(**cfg["sizes"])
    names = layout.names
    shard = tuple(d for d in ("dp_shard", "cp") if d in names)
    flatten = [shard] if len(shard) > 1 else []
    mg = init_mesh(layout, flatten=flatten)
    try:
        coords = layout.coords(rank)
        cp = layout.size("cp") if "cp" in names else 1
        net = build(
            spec,
            cfg.get("attention", "flash"),
            seed=seed,
            cp_group=mg.group("cp") if cp > 1 else None,
        )
        tp = "tp" in names and layout.size("tp") > 1
        if tp:
            parallelize_module(net, mg.mesh["tp"], _tp_plan(spec, cfg.get("sp", False), range(spec.layers)))
        recompute(net, cfg.get("recompute", "none"), cfg.get("every", 2))
        dims = (*(d for d in ("dp_replicate",) if d in names), *(("_".join(shard),) if flatten else shard))
        if dims:
            mesh = mg.mesh[dims] if len(dims) > 1 else mg.mesh[dims[0]]
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for block in net.layers:
                fully_shard(block, mesh=mesh, mp_policy=mp)
            fully_shard(net, mesh=mesh, mp_policy=mp)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True)
        m = cfg.get("micro_batches", 1)
        local_s = spec.seq_len // cp
        gen = torch.Generator().manual_seed(1 + coords.get("dp_shard", 0) + 7 * coords.get("dp_replicate", 0))
        live = LiveMemory()
        live.instrument(net, opt)

        def batch() -> tuple[Any, Any]:
            ids = torch.randint(0, spec.vocab, (spec.micro_batch, spec.seq_len + 1), generator=gen)
            if cp > 1:  # this rank's part of the sequence (the same ids on every cp rank)
                r = coords["cp"]
                ids = ids[:, r * local_s : (r + 1) * local_s + 1]
                net.positions = r * local_s
            # two tensors, as a data loader gives them: token ids and targets
            return ids[:, :-1].clone(), ids[:, 1:].clone()

        def step(counted: bool) -> None:
            for _ in range(m):
                inputs, targets = batch()
                live.set("activations")
                logits = net(inputs)
                if tp:
                    with loss_parallel():
                        loss = net.loss(logits, targets)
                        del logits
                        live.set("loss")
                        loss.backward()
                else:
                    loss = net.loss(logits, targets)
                    del logits
                    live.set("loss")
                    loss.backward()
                del loss, inputs, targets
            opt.step()
            if not counted:  # torchtitan zeroes at the start of a step: none are held into it
                opt.zero_grad(set_to_none=True)

        step(False)  # warm-up: FSDP2's lazy init, AdamW's state
        if dims:
            # FSDP2's unsharded parameters (made at lazy init, kept across steps): their
            # gradients live from their backward to the reduce-scatter, FSDP2's transient
            for module in net.modules():
                state = getattr(module, "_get_fsdp_state", None)
                group = state()._fsdp_param_group if state is not None else None
                for fp in group.fsdp_params if group is not None else ():
                    fp.unsharded_param.register_post_accumulate_grad_hook(
                        lambda p: live.retag(p.grad, "transient")
                    )
        torch_peak = None
        with contextlib.ExitStack() as stack:
            if cfg.get("memtracker"):
                # torch's own tracker around the same step: its peak must be ours. (Only
                # without FSDP2: torch 2.13's MemTracker and FSDPMemTracker count a resharded
                # unit's parameters as still live, and neither takes several micro-batches.)
                from torch.distributed._tools.mem_tracker import MemTracker

                tracker = MemTracker()
                tracker.track_external(net, opt)
                stack.enter_context(tracker)
            stack.enter_context(live)
            live.track(net.parameters(), "params")
            live.track(net.buffers(), "other")
            live.track([v for st in opt.state.values() for v in st.values()], "optimizer")
            live.reset_peak()
            if cfg.get("trace"):
                live.trace = []
            step(True)
        if cfg.get("memtracker"):
            snap = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
            torch_peak = snap["Total"]
            if cfg.get("trace"):
                print("MemTracker peak", {str(k): v for k, v in snap.items()}, flush=True)
        params = list(net.parameters())
        known = {
            "params": params,
            "grads": [p.grad for p in params if p.grad is not None],
            "optimizer": [v for p in params for v in opt.state[p].values()],
        }
        return {
            "peak": live.peak,
            "breakdown": live.breakdown(**known),
            "states": _states(net, opt),
            "where": live.peak_where,
            "trace": live.trace,
            "live": sorted(live.at_peak.values()) if cfg.get("trace") else None,
            "torch_peak": torch_peak,
        }
    finally:
        mg.close()
