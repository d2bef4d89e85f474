"""A tiny Llama-shaped trainer (Hugging Face names: separate q/k/v with grouped-query sizes,
gate/up, a head tied to the embedding) on FSDP2 × TP, one real optimizer step of it, and the
rollout side in vLLM's layout (fused ``qkv_proj`` / ``gate_up_proj``, each tp rank holding its
shard of q, then of k, then of v), built from local tensors. Used by ``test_transfer_weight_sync.py``."""

from __future__ import annotations

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB, LAYERS = 8, 4, 2, 2, 12, 16, 2
Q, KV = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM  # 8 and 4 rows: grouped-query attention


def make_trainer(seed: int = 0):
    """The trainer model in Hugging Face names (``lm_head.weight`` is the embedding: one
    parameter, named ``model.embed_tokens.weight``)."""
    import torch
    from torch import nn

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj = nn.Linear(HIDDEN, Q, bias=False)
            self.k_proj = nn.Linear(HIDDEN, KV, bias=False)
            self.v_proj = nn.Linear(HIDDEN, KV, bias=False)
            self.o_proj = nn.Linear(Q, HIDDEN, bias=False)

        def forward(self, h):
            q, k, v = self.q_proj(h), self.k_proj(h), self.v_proj(h)  # this tp rank's heads
            groups = q.shape[-1] // k.shape[-1]  # query heads per kv head, locally alike
            kv = (k * v).reshape(*k.shape[:-1], -1, 1, HEAD_DIM)
            a = q.reshape(*q.shape[:-1], -1, groups, HEAD_DIM) * kv
            return self.o_proj(a.reshape(q.shape))

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_proj = nn.Linear(HIDDEN, FFN, bias=False)
            self.up_proj = nn.Linear(HIDDEN, FFN, bias=False)
            self.down_proj = nn.Linear(FFN, HIDDEN, bias=False)

        def forward(self, h):
            return self.down_proj(nn.functional.silu(self.gate_proj(h)) * self.up_proj(h))

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.input_layernorm = nn.Parameter(torch.ones(HIDDEN) + 0.1 * torch.randn(HIDDEN))
            self.self_attn = Attention()
            self.mlp = MLP()

        def forward(self, x):
            h = x * self.input_layernorm
            return x + self.self_attn(h) + self.mlp(h)

    class Body(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
            self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
            self.norm = nn.Parameter(torch.ones(HIDDEN))

    class CausalLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = Body()
            self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
            self.lm_head.weight = self.model.embed_tokens.weight  # tied

        def forward(self, tokens):
            x = self.model.embed_tokens(tokens)
            for layer in self.model.layers:
                x = layer(x)
            return self.lm_head(x * self.model.norm)

    torch.manual_seed(seed)
    return CausalLM()


def shard_trainer(model, mesh) -> None:
    """TP over ``mesh["tp"]`` (q/k/v/gate/up column-wise, o/down row-wise), then FSDP2 over
    ``mesh["dp_shard"]``."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {}
    for i in range(LAYERS):
        for name in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
        ):
            plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{i}.{name}"] = RowwiseParallel()
    parallelize_module(model, mesh["tp"], plan)
    fully_shard(model, mesh=mesh["dp_shard"])


def train_step(model, optimizer, step: int) -> None:
    """One real step: forward, backward (FSDP2 reduce-scatters the gradients), optimizer."""
    import torch

    tokens = (torch.arange(6) * (step + 3)) % VOCAB  # the same batch on every rank
    optimizer.zero_grad()
    model(tokens).square().mean().backward()
    optimizer.step()


def full_weights(model) -> dict:
    """Every trainer weight in full (collective over the trainer's ranks), detached copies."""
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in model.named_parameters()
    }


def vllm_names(layers: int = LAYERS) -> dict[str, list[str] | str]:
    """The rollout's names → the trainer's, vLLM-style (fused q/k/v and gate/up, tied head)."""
    out: dict[str, list[str] | str] = {
        "model.embed_tokens.weight": "model.embed_tokens.weight",
        "lm_head.weight": "model.embed_tokens.weight",
        "model.norm": "model.norm",
    }
    for i in range(layers):
        p = f"model.layers.{i}"
        out[f"{p}.self_attn.qkv_proj.weight"] = [f"{p}.self_attn.{x}_proj.weight" for x in "qkv"]
        out[f"{p}.mlp.gate_up_proj.weight"] = [f"{p}.mlp.gate_proj.weight", f"{p}.mlp.up_proj.weight"]
        for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight", "input_layernorm"):
            out[f"{p}.{name}"] = f"{p}.{name}"
    return out


def rollout_expected(full: dict, tp_rank: int, tp: int, dtype) -> dict:
    """What a vLLM tp rank must hold, computed straight from the trainer's full weights (an
    oracle independent of the plan): fused weights as its shard of each part one after another,
    o/down column shards, embedding and head row shards (vocab-parallel), norms whole."""
    import torch

    def rows(t, k=tp_rank):
        n = t.shape[0] // tp
        return t[k * n : (k + 1) * n]

    def cols(t):
        n = t.shape[1] // tp
        return t[:, tp_rank * n : (tp_rank + 1) * n]

    out = {"model.embed_tokens.weight": rows(full["model.embed_tokens.weight"])}
    out["lm_head.weight"] = out["model.embed_tokens.weight"]
    out["model.norm"] = full["model.norm"]
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        a, m = f"{p}.self_attn", f"{p}.mlp"
        out[f"{a}.qkv_proj.weight"] = torch.cat([rows(full[f"{a}.{x}_proj.weight"]) for x in "qkv"])
        out[f"{m}.gate_up_proj.weight"] = torch.cat(
            [rows(full[f"{m}.{x}_proj.weight"]) for x in ("gate", "up")]
        )
        out[f"{a}.o_proj.weight"] = cols(full[f"{a}.o_proj.weight"])
        out[f"{m}.down_proj.weight"] = cols(full[f"{m}.down_proj.weight"])
        out[f"{p}.input_layernorm"] = full[f"{p}.input_layernorm"]
    return {n: t.to(dtype) for n, t in out.items()}


def rollout_local(tp: int, dtype) -> dict:
    """NaN-filled local tensors of one vLLM tp rank, shaped as vLLM holds them."""
    import torch

    nan = float("nan")
    shapes = {"model.embed_tokens.weight": (VOCAB // tp, HIDDEN), "lm_head.weight": (VOCAB // tp, HIDDEN)}
    shapes["model.norm"] = (HIDDEN,)
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        shapes[f"{p}.self_attn.qkv_proj.weight"] = ((Q + 2 * KV) // tp, HIDDEN)
        shapes[f"{p}.mlp.gate_up_proj.weight"] = (2 * FFN // tp, HIDDEN)
        shapes[f"{p}.self_attn.o_proj.weight"] = (HIDDEN, Q // tp)
        shapes[f"{p}.mlp.down_proj.weight"] = (HIDDEN, FFN // tp)
        shapes[f"{p}.input_layernorm"] = (HIDDEN,)
    return {n: torch.full(s, nan, dtype=dtype) for n, s in shapes.items()}


def rollout_placements() -> dict:
    """Per rollout weight: the tensor axis tp shards (None: whole on every rank)."""
    out: dict = {"model.embed_tokens.weight": 0, "lm_head.weight": 0, "model.norm": None}
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        out[f"{p}.self_attn.qkv_proj.weight"] = 0
        out[f"{p}.mlp.gate_up_proj.weight"] = 0
        out[f"{p}.self_attn.o_proj.weight"] = 1
        out[f"{p}.mlp.down_proj.weight"] = 1
        out[f"{p}.input_layernorm"] = None
    return out


def rollout_module(tp_mesh, dtype):
    """The rollout as an ``nn.Module`` whose parameters are DTensors over ``tp_mesh`` wrapping
    vLLM-layout local tensors (NaN-filled); names as vLLM's."""
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard

    module = torch.nn.Module()
    for name, local in rollout_local(tp_mesh.size(), dtype).items():
        axis = rollout_placements()[name]
        placement = Replicate() if axis is None else Shard(axis)
        param = torch.nn.Parameter(DTensor.from_local(local, tp_mesh, [placement], run_check=False))
        owner = module
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, torch.nn.Module())
            owner = getattr(owner, part)
        owner.register_parameter(leaf, param)
    return module
