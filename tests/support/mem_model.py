"""A small Llama-style transformer built from a ``meshgroups.cost.Model``, for measuring what
training holds: grouped-query attention with rotary embeddings, SDPA (``"flash"``) or an explicit
softmax (``"eager"``), RMSNorm, a gated (SwiGLU) MLP, an untied head, and the loss as a module of
its own (``Loss``: the logits upcast to fp32 and ``cross_entropy``, as torchtitan computes it) so
a tracker can tell its bytes apart.

The parameter names and shapes are :meth:`meshgroups.cost.Model.tensors`' exactly: fused
``qkv``/``fc1`` (Megatron's) or separate ``q``/``k``/``v``/``gate``/``up`` (torchtitan's and
Hugging Face's), as ``spec.fused_projections`` says; so the accounting's shards and the real ones
compare tensor by tensor.

With ``cp_group`` the sequence is cut over the group (each rank passes its own slice of the ids
and sets ``net.positions`` to its first position) and the attention core keeps for backward what
ring attention keeps (torch's ``context_parallel``, which does not run on CPU): this rank's q, k,
v, the output and the log-sum-exp. Keys and values are exchanged by all-gather here (forward, and
again in backward), which moves more bytes than a ring but holds the same for backward.
"""

from __future__ import annotations

from typing import Any

__all__ = ["POLICIES", "build", "recompute"]

#: Recomputation policies :func:`recompute` applies (the cost model's names).
POLICIES = ("none", "selective", "op", "layer", "full")
SLICE = 16  # rows the norm works on at a time (a fused kernel's temporaries are as small)


def _norm_function() -> Any:
    import torch
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    class Norm(torch.autograd.Function):
        """RMSNorm that keeps what torch's fused CUDA kernel (and Transformer Engine's) keeps for
        backward, the input and the fp32 reciprocal RMS per token, and like a fused kernel makes
        no full-size fp32 temporaries (it works on slices of rows). torch's CPU ``rms_norm`` is a
        composite of ops that also keeps the fp32 upcast and the normalised fp32 tensor, and
        makes several fp32 temporaries, which no GPU run holds."""

        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
            # under sequence parallelism x is a DTensor (a slice of the sequence) and w a
            # replicated one: the kernel runs on the local tensors, as a fused kernel would
            ctx.dist = (x.device_mesh, x.placements) if isinstance(x, DTensor) else None
            if ctx.dist is not None:
                x, w = x.to_local(), w.to_local()
            rows = x.reshape(-1, x.shape[-1])
            out = torch.empty_like(rows)
            rstd = torch.empty(rows.shape[0], 1, dtype=torch.float32, device=x.device)
            for i in range(0, rows.shape[0], SLICE):
                xf = rows[i : i + SLICE].float()
                r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
                rstd[i : i + SLICE] = r
                out[i : i + SLICE] = (xf * r).to(x.dtype) * w
            ctx.save_for_backward(x, rstd, w)
            out = out.view(x.shape)
            if ctx.dist is not None:
                out = DTensor.from_local(out, *ctx.dist, run_check=False)
            return out

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> Any:
            x, rstd, w = ctx.saved_tensors
            if ctx.dist is not None:
                g = g.to_local()
            rows, grows = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
            dx = torch.empty_like(rows)
            dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
            for i in range(0, rows.shape[0], SLICE):
                r = rstd[i : i + SLICE]
                n = rows[i : i + SLICE].float() * r
                gf = grows[i : i + SLICE].float()
                gn = gf * w.float()
                dx[i : i + SLICE] = r * (gn - n * (gn * n).mean(-1, keepdim=True))
                dw += (gf * n).sum(0)
            dx, dw = dx.view(x.shape), dw.to(w.dtype)
            if ctx.dist is not None:
                mesh, placements = ctx.dist
                dx = DTensor.from_local(dx, mesh, placements, run_check=False)
                # the weight saw a slice of the tokens: its gradient is a partial sum, summed
                # over tp as torch's SequenceParallel sums it
                part = any(isinstance(p, Shard) for p in placements)
                dw = DTensor.from_local(dw, mesh, [Partial() if part else Replicate()], run_check=False)
                dw = dw.redistribute(mesh, [Replicate()])
            return dx, dw, None

    return Norm


def _ring_function(group: Any) -> Any:
    import torch
    import torch.distributed as dist

    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    flash_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    n, me = dist.get_world_size(group), dist.get_rank(group)

    def gather(t: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(t) for _ in range(n)]
        dist.all_gather(out, t.contiguous(), group=group)
        return out

    class Ring(torch.autograd.Function):
        """Causal attention over a sequence cut in ``n`` consecutive slices: this rank's queries
        see the slices before its own whole and its own causally."""

        @staticmethod
        def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            ks, vs = gather(k), gather(v)
            out = lse = None
            for src in range(me + 1):
                o, s = flash(q, ks[src], vs[src], 0.0, src == me)
                if out is None:
                    out, lse = o.float(), s
                    continue
                both = torch.logaddexp(lse, s)
                out = out * (lse - both).exp().unsqueeze(-1) + o.float() * (s - both).exp().unsqueeze(-1)
                lse = both
            out = out.to(q.dtype)
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx: Any, dout: torch.Tensor) -> Any:
            q, k, v, out, lse = ctx.saved_tensors
            ks, vs = gather(k), gather(v)
            dq = torch.zeros_like(q, dtype=torch.float32)
            dks = [torch.zeros_like(k) for _ in range(n)]
            dvs = [torch.zeros_like(v) for _ in range(n)]
            for src in range(me + 1):
                a, b, c = flash_bwd(dout.contiguous(), q, ks[src], vs[src], out, lse, 0.0, src == me)
                dq += a.float()
                dks[src], dvs[src] = b, c
            dk, dv = torch.empty_like(k), torch.empty_like(v)
            dist.reduce_scatter(dk, dks, group=group)
            dist.reduce_scatter(dv, dvs, group=group)
            return dq.to(q.dtype), dk, dv

    return Ring


def build(spec: Any, attention: str = "flash", seed: int = 0, cp_group: Any = None) -> Any:
    """The network for ``spec`` (a ``meshgroups.cost.Model``), on CPU in fp32."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    h, hd, heads, kv = spec.hidden, spec.head_dim, spec.heads, spec.kv_heads
    fused, gated = spec.fused_projections, spec.gated_mlp
    Norm = _norm_function()
    Ring = _ring_function(cp_group) if cp_group is not None else None

    class RMSNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(h))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return Norm.apply(x, self.weight, 1e-6)

    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        a, b = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-b, a), dim=-1) * sin

    class Attention(nn.Module):
        """The attention core: a module so recomputation policies can name it."""

        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if Ring is not None:
                return Ring.apply(q, k, v)
            if attention == "flash":
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            s = q.shape[2]
            scores = (q @ k.transpose(-2, -1)) * hd**-0.5
            mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
            return scores.masked_fill(mask, float("-inf")).softmax(dim=-1) @ v

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn_norm = RMSNorm()
            if fused:
                self.qkv = nn.Linear(h, (heads + 2 * kv) * hd, bias=False)
            else:
                self.q = nn.Linear(h, heads * hd, bias=False)
                self.k = nn.Linear(h, kv * hd, bias=False)
                self.v = nn.Linear(h, kv * hd, bias=False)
            self.core = Attention()
            self.o = nn.Linear(heads * hd, h, bias=False)
            self.mlp_norm = RMSNorm()
            if fused or not gated:
                self.fc1 = nn.Linear(h, (2 if gated else 1) * spec.ffn, bias=False)
            else:
                self.gate = nn.Linear(h, spec.ffn, bias=False)
                self.up = nn.Linear(h, spec.ffn, bias=False)
            self.fc2 = nn.Linear(spec.ffn, h, bias=False)

        def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            xn = self.attn_norm(x)
            if fused:
                qkv = self.qkv(xn)
                b, s, width = qkv.shape  # this rank's heads (tp) over the whole sequence
                local_q = width * heads // (heads + 2 * kv)
                q, k, v = qkv.split([local_q, (width - local_q) // 2, (width - local_q) // 2], dim=-1)
            else:
                q, k, v = self.q(xn), self.k(xn), self.v(xn)
                b, s, _ = q.shape
            q = rotate(q.view(b, s, -1, hd).transpose(1, 2), cos, sin)
            k = rotate(k.view(b, s, -1, hd).transpose(1, 2), cos, sin)
            v = v.view(b, s, -1, hd).transpose(1, 2)
            att = self.core(q, k, v).transpose(1, 2).reshape(b, s, -1)
            x = x + self.o(att)
            xn = self.mlp_norm(x)
            if not gated:
                return x + self.fc2(F.gelu(self.fc1(xn)))
            if fused:
                g, u = self.fc1(xn).chunk(2, dim=-1)
            else:
                g, u = self.gate(xn), self.up(xn)
            return x + self.fc2(F.silu(g) * u)

    class Loss(nn.Module):
        """Cross-entropy on fp32 logits (the upcast torchtitan makes)."""

        def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten(0, 1))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embedding = nn.Embedding(spec.vocab, h)
            self.layers = nn.ModuleList([Block() for _ in range(spec.layers)])
            self.final_norm = RMSNorm()
            self.head = nn.Linear(h, spec.vocab, bias=False)
            self.loss = Loss()
            self.positions = 0  # the first position of this rank's slice (context parallelism)
            pos = torch.arange(spec.seq_len, dtype=torch.float32)
            freq = 1.0 / (10000 ** (torch.arange(0, hd // 2, dtype=torch.float32) / (hd // 2)))
            angles = torch.outer(pos, freq).repeat(1, 2)
            self.register_buffer("cos", angles.cos().to(torch.bfloat16), persistent=False)
            self.register_buffer("sin", angles.sin().to(torch.bfloat16), persistent=False)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            x = self.embedding(ids)
            span = slice(self.positions, self.positions + ids.shape[1])
            for layer in self.layers:
                x = layer(x, self.cos[span], self.sin[span])
            return self.head(self.final_norm(x))

    torch.manual_seed(seed)
    return Net()


def recompute(net: Any, policy: str, every: int = 2) -> None:
    """Apply a recomputation policy to ``net``'s blocks in place, with torch's own APIs
    (``checkpoint_wrapper``, non-reentrant, as torchtitan applies them):

    - ``"selective"``: Megatron's: the attention core (``core``) recomputed;
    - ``"op"``: torchtitan's op-level selective policy (``create_selective_checkpoint_contexts``):
      the attention op's outputs and every other matmul's output (the 1st, 3rd, ...) saved, the
      rest recomputed;
    - ``"layer"``: torchtitan's per-layer policy: every ``every``-th block fully recomputed;
    - ``"full"``: every block recomputed from its input.
    """
    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    if policy == "none":
        return
    if policy not in POLICIES:
        raise ValueError(f"unknown recomputation policy {policy!r}; policies are {POLICIES}")
    save = {
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
        torch.ops.aten._scaled_dot_product_flash_attention.default,
        torch.ops.aten._scaled_dot_product_efficient_attention.default,
        torch.ops._c10d_functional.reduce_scatter_tensor.default,
    }

    def op_policy() -> Any:
        count = {"forward": 0, "recompute": 0}

        def decide(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
            mode = "recompute" if ctx.is_recompute else "forward"
            if func == torch.ops.aten.mm.default:
                count[mode] += 1
                keep = count[mode] % 2 == 1
            else:
                keep = func in save
            return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(decide)

    for i, block in enumerate(net.layers):
        if policy == "selective":
            block.core = checkpoint_wrapper(block.core, preserve_rng_state=False)
        elif policy == "op":
            net.layers[i] = checkpoint_wrapper(block, context_fn=op_policy, preserve_rng_state=False)
        elif policy == "full" or (policy == "layer" and (i + 1) % every == 0):
            net.layers[i] = checkpoint_wrapper(block, preserve_rng_state=False)
