"""The accounting equals what real FSDP2 + TP training steps do, on 8 gloo processes.

One spawned job runs several layouts in turn (each mesh from ``meshgroups.init_mesh``): a small
transformer built from a ``meshgroups.cost.Model`` (fused qkv, grouped-query attention, RMSNorm,
vocabulary-parallel embedding and head with torch's ``loss_parallel``), tensor-parallel with
``parallelize_module`` over ``tp`` (once with sequence parallelism) and ``fully_shard`` over ``dp_shard`` (HSDP with
``dp_replicate``), trained with Adam over two micro-batches per step. A ``TorchDispatchMode``
sees every ``c10d`` and ``_c10d_functional`` collective of the counted step (the one after a
warm-up step) with its tensors and its group; each rank's bytes per group family must equal
:func:`meshgroups.cost._calls.rank_payload`, and its parameter, gradient and Adam-moment
bytes the local shards' (``to_local()``) as :func:`meshgroups.cost.rank_states` gives them.
The same job then runs torch's 1F1B pipeline schedule on ``dp_replicate=4 pp=2`` and compares
each rank's send bytes with the ``pp`` family's.
"""

from __future__ import annotations

import pytest

from meshgroups import Layout
from meshgroups.cost import Model, Parallelism, Precision, collectives, rank_states
from meshgroups.cost._calls import rank_payload

from ..support.dist import run

pytestmark = pytest.mark.processes  # every test here starts processes

SPEC = Model(layers=2, hidden=32, heads=8, kv_heads=4, ffn=64, vocab=64, seq_len=8, micro_batch=2)
FP32 = Precision(params="float32", grads="float32", master=None, moments="float32", activations="float32")
MICRO_BATCHES = 2
# (sizes, sequence parallelism)
LAYOUTS = [
    ({"dp_shard": 4, "tp": 2}, False),
    ({"dp_shard": 2, "tp": 4}, False),
    ({"dp_replicate": 2, "dp_shard": 2, "tp": 2}, False),
    ({"dp_replicate": 2, "dp_shard": 4}, False),
    ({"dp_shard": 4, "tp": 2}, True),
]


def _plan(sp: bool) -> Parallelism:
    return Parallelism(precision=FP32, micro_batches=MICRO_BATCHES, sequence_parallel=sp)


def _model(spec: Model):
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            h, hd = spec.hidden, spec.head_dim
            self.attn_norm = nn.RMSNorm(h)
            self.qkv = nn.Linear(h, (spec.heads + 2 * spec.kv_heads) * hd, bias=False)
            self.o = nn.Linear(spec.heads * hd, h, bias=False)
            self.mlp_norm = nn.RMSNorm(h)
            self.fc1 = nn.Linear(h, spec.ffn, bias=False)
            self.fc2 = nn.Linear(spec.ffn, h, bias=False)

        def forward(self, x):
            hd = spec.head_dim
            qkv = self.qkv(self.attn_norm(x))  # this rank's columns: its share of the heads
            b, s, _ = qkv.shape  # the whole sequence (with sequence parallelism x holds a shard)
            share = spec.heads * hd * qkv.shape[-1] // ((spec.heads + 2 * spec.kv_heads) * hd)
            kv = (qkv.shape[-1] - share) // 2
            q, k, v = qkv.split([share, kv, kv], dim=-1)
            q = q.reshape(b, s, -1, hd).transpose(1, 2)
            k = k.reshape(b, s, -1, hd).transpose(1, 2).repeat_interleave(q.shape[1] // (kv // hd), dim=1)
            v = v.reshape(b, s, -1, hd).transpose(1, 2).repeat_interleave(q.shape[1] // (kv // hd), dim=1)
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
            x = x + self.o(att)
            return x + self.fc2(F.gelu(self.fc1(self.mlp_norm(x))))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embedding = nn.Embedding(spec.vocab, spec.hidden)
            self.layers = nn.ModuleList([Block() for _ in range(spec.layers)])
            self.final_norm = nn.RMSNorm(spec.hidden)
            self.head = nn.Linear(spec.hidden, spec.vocab, bias=False)

        def forward(self, ids):
            x = self.embedding(ids)
            for layer in self.layers:
                x = layer(x)
            return self.head(self.final_norm(x))

    torch.manual_seed(0)
    return Net()


class _Count:
    """A TorchDispatchMode counting each collective's payload bytes per process group name."""

    def __new__(cls):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        payload = {
            "all_reduce": lambda a: a[0].nbytes,
            "all_gather_into_tensor": lambda a: a[0].nbytes * a[1],
            "reduce_scatter_tensor": lambda a: a[0].nbytes,
            "all_to_all_single": lambda a: a[0].nbytes,
            "allreduce_": lambda a: sum(t.nbytes for t in a[0]),
            "_allgather_base_": lambda a: a[0].nbytes,
            "_reduce_scatter_base_": lambda a: a[1].nbytes,
            "allgather_into_tensor_coalesced_": lambda a: sum(t.nbytes for t in a[0]),
            "reduce_scatter_tensor_coalesced_": lambda a: sum(t.nbytes for t in a[1]),
            "alltoall_base_": lambda a: a[1].nbytes,
            "send": lambda a: sum(t.nbytes for t in a[0]),
        }
        ignored = {"wait_tensor", "recv_", "barrier", "_wrap_tensor_autograd"}  # no bytes of their own

        class Count(TorchDispatchMode):
            def __init__(self) -> None:
                super().__init__()
                self.bytes: dict[str, int] = {}
                self.ops: dict[tuple[str, str], int] = {}

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if any(t is not torch.Tensor for t in types):
                    # a DTensor: let it run its own handler, whose collectives come back here
                    return NotImplemented
                out = func(*args, **(kwargs or {}))
                namespace, _, name = func._overloadpacket._qualified_op_name.partition("::")
                if namespace in ("c10d", "_c10d_functional", "c10d_functional") and name not in ignored:
                    if name not in payload:
                        raise AssertionError(f"an uncounted collective: {namespace}::{name}")
                    # the schema names the group argument: c10d ops take it boxed, functional
                    # collectives take its name
                    where = [
                        i
                        for i, a in enumerate(func._schema.arguments)
                        if a.name in ("process_group", "group_name")
                    ]
                    if not where:
                        raise AssertionError(f"{namespace}::{name}: no group argument in {func._schema}")
                    group = args[where[0]]
                    if isinstance(group, torch.ScriptObject):
                        group = torch.distributed.ProcessGroup.unbox(group)
                    if not isinstance(group, str):
                        group = group.group_name
                    self.bytes[group] = self.bytes.get(group, 0) + int(payload[name](args))
                    self.ops[(group, name)] = self.ops.get((group, name), 0) + 1
                return out

        return Count()


def _train(layout: Layout, sp: bool, rank: int):
    import torch
    import torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        loss_parallel,
        parallelize_module,
    )

    from meshgroups import init_mesh

    mg = init_mesh(layout)
    try:
        net = _model(SPEC)
        tp = "tp" in layout.names
        if tp:
            # with sequence parallelism (torchtitan's plan): activations between the matmuls
            # are sequence shards, the norms run on them
            seq = Shard(1) if sp else Replicate()
            plan = {
                "embedding": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
                "head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
            }
            if sp:
                plan["final_norm"] = SequenceParallel()
            for i in range(SPEC.layers):
                for name, style in (("qkv", ColwiseParallel(input_layouts=seq)), ("o", RowwiseParallel(output_layouts=seq)),
                                    ("fc1", ColwiseParallel(input_layouts=seq)), ("fc2", RowwiseParallel(output_layouts=seq))):  # fmt: skip
                    plan[f"layers.{i}.{name}"] = style
                if sp:
                    plan.update(
                        {
                            f"layers.{i}.attn_norm": SequenceParallel(),
                            f"layers.{i}.mlp_norm": SequenceParallel(),
                        }
                    )
            parallelize_module(net, mg.mesh["tp"], plan)
        dp = tuple(d for d in ("dp_replicate", "dp_shard") if d in layout.names)
        dp_mesh = mg.mesh[dp] if len(dp) > 1 else mg.mesh[dp[0]]
        for block in net.layers:
            fully_shard(block, mesh=dp_mesh)
        fully_shard(net, mesh=dp_mesh)
        opt = torch.optim.Adam(net.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(1 + layout.coords(rank).get("dp_shard", 0))

        def step() -> None:
            for _ in range(MICRO_BATCHES):
                ids = torch.randint(0, SPEC.vocab, (SPEC.micro_batch, SPEC.seq_len + 1), generator=gen)
                logits = net(ids[:, :-1])
                if tp:
                    with loss_parallel():
                        F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
                else:
                    F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
            opt.step()

        step()  # warm-up: FSDP2's lazy init, Adam's state
        opt.zero_grad(set_to_none=True)
        counter = _Count()
        with counter:
            step()
        family = {}
        for dims in {(d,) for d in layout.names}:
            family[mg.group(*dims).group_name] = "+".join(dims)
        measured: dict[str, int] = {}
        for group, n in counter.bytes.items():
            measured[family[group]] = measured.get(family[group], 0) + n

        def local(t) -> int:
            return (t.to_local() if hasattr(t, "to_local") else t).nbytes

        params = sum(local(p) for p in net.parameters())
        grads = sum(local(p.grad) for p in net.parameters())
        moments = sum(local(opt.state[p][k]) for p in net.parameters() for k in ("exp_avg", "exp_avg_sq"))
        ops = {f"{family[g]}:{op}": n for (g, op), n in counter.ops.items()}
        return measured, (params, grads, moments), ops
    finally:
        mg.close()


PIPELINE = {"dp_replicate": 4, "pp": 2}  # pp innermost: each pipeline's two stages on neighbours
PIPELINE_MICRO_BATCHES = 4
PIPELINE_PLAN = Parallelism(precision=FP32, micro_batches=PIPELINE_MICRO_BATCHES)


def _pipeline(layout: Layout, rank: int) -> dict[str, int]:
    """Two 1F1B stages (torch.distributed.pipelining) per pipeline, no data-parallel wrapper:
    only the ``pp`` family's sends are compared (FSDP2 inside a pipeline schedule syncs
    gradients on the last micro-batch only, which the accounting does not model)."""
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from meshgroups import init_mesh

    mg = init_mesh(layout)
    try:
        net = _model(SPEC)
        stage = layout.coords(rank)["pp"]
        if stage == 0:
            part = nn.Sequential(net.embedding, *net.layers[: SPEC.layers // 2])
        else:
            part = nn.Sequential(*net.layers[SPEC.layers // 2 :], net.final_norm, net.head)
        pipe = PipelineStage(part, stage, 2, torch.device("cpu"), group=mg.group("pp"))

        def loss(logits, target):
            return F.cross_entropy(logits.flatten(0, 1), target.flatten())

        schedule = Schedule1F1B(pipe, n_microbatches=PIPELINE_MICRO_BATCHES, loss_fn=loss)
        gen = torch.Generator().manual_seed(7)

        def step() -> None:
            ids = torch.randint(
                0, SPEC.vocab, (SPEC.micro_batch * PIPELINE_MICRO_BATCHES, SPEC.seq_len + 1), generator=gen
            )
            if stage == 0:
                schedule.step(ids[:, :-1])
            else:
                schedule.step(target=ids[:, 1:], losses=[])

        step()  # warm-up: the stages exchange their shapes
        counter = _Count()
        with counter:
            step()
        family = {mg.group("pp").group_name: "pp"}
        return {family[g]: n for g, n in counter.bytes.items()}
    finally:
        mg.close()


def worker(rank: int, world: int):
    return [_train(Layout(**sizes), sp, rank) for sizes, sp in LAYOUTS], _pipeline(Layout(**PIPELINE), rank)


def test_bytes_of_every_collective_and_every_shard_match_real_fsdp2_tp_steps():
    results = run(worker, 8, timeout=600, pg_timeout=120)
    for i, (sizes, sp) in enumerate(LAYOUTS):
        layout = Layout(**sizes)
        expected = collectives(SPEC, layout, _plan(sp))
        for rank in range(8):
            measured, (params, grads, moments), ops = results[rank][0][i]
            want = rank_payload(expected, layout, rank, _plan(sp))
            assert measured == want, (sizes, sp, rank, ops)
            st = rank_states(SPEC, layout, rank, _plan(sp))  # AdamW's 0-d steps: 4 bytes per tensor
            assert (params, grads, moments) == (st.params, st.grads, st.optimizer - 4 * st.tensors), (
                sizes,
                sp,
                rank,
            )
    layout = Layout(**PIPELINE)
    expected = collectives(SPEC, layout, PIPELINE_PLAN)
    for rank in range(8):
        assert results[rank][1] == {"pp": rank_payload(expected, layout, rank, PIPELINE_PLAN)["pp"]}, rank
