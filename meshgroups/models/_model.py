"""A transformer, described once for the whole package: :class:`Model` (its dims) and the
parameter tensors they make (:class:`ParamTensor`), the way tensor parallelism and FSDP2 cut
them. The cost model (:mod:`meshgroups.cost`), the transfer presets
(`meshgroups.transfer.model_weights`) and the CLI read this one description::

    >>> m = Model(layers=2, hidden=64, heads=8, ffn=128, vocab=256)
    >>> m.head_dim, m.kv_heads, m.parameters()
    (8, 8, 98624)
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

from meshgroups.errors import LayoutError

__all__ = ["DTYPES", "Model", "ParamTensor"]

#: The dtypes a model's weights may be stored in (``Model.dtype``).
DTYPES = ("float32", "bfloat16", "float16")

Where = Literal["layer", "embedding", "final_norm", "head"]


@dataclass(frozen=True)
class ParamTensor:
    """One parameter tensor of a model, as the accounting cuts it.

    Args:
        name: e.g. ``"qkv"``, ``"experts_fc1"``.
        shape: the full (unsharded) shape, torch's ``Linear.weight`` convention ``(out, in)``.
        tp_axis: the axis tensor parallelism cuts (``None``: replicated over tp, e.g. a norm).
        expert: whether it holds experts stacked on axis 0 (cut over ep, sharded over the
            expert data-parallel dims).
        where: ``"layer"`` (once per layer), ``"embedding"`` (first stage), ``"final_norm"`` or
            ``"head"`` (last stage).

    >>> ParamTensor("o", (64, 64), 1).numel
    4096
    """

    name: str
    shape: tuple[int, ...]
    tp_axis: int | None
    expert: bool = False
    where: Where = "layer"

    @property
    def numel(self) -> int:
        """Elements of the full tensor."""
        n = 1
        for d in self.shape:
            n *= d
        return n


def _positive(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, got {value!r}")
    if value < 1:
        raise LayoutError(f"{what}={value} must be positive")
    return value


@dataclass(frozen=True)
class Model:
    """A decoder-only transformer's dims (validated on construction).

    Args:
        layers: transformer layers. hidden: model width h. heads: attention heads a.
        ffn: the dense MLP's inner size (the per-expert size is ``expert_ffn``).
        vocab: vocabulary size.
        kv_heads: key/value heads (grouped-query attention); ``None``: ``heads``.
        head_dim: ``None``: ``hidden // heads``.
        experts: routed experts per layer (0: a dense model; every layer is an MoE layer
            otherwise). top_k: experts each token visits. expert_ffn: ``None``: ``ffn``.
        gated_mlp: a gated MLP (SwiGLU: the first projection is ``2 × ffn`` wide, fused).
        tied_embeddings: the output head is the embedding matrix.
        fused_projections: q, k and v one matrix (``qkv``) and the gated MLP's gate and up one
            (``fc1``), as Megatron-Core holds them; ``False``: separate matrices (``q``, ``k``,
            ``v``, ``gate``, ``up``), as Hugging Face and torchtitan do. It changes which
            tensors FSDP2 pads and what a layer keeps for backward (a fused ``qkv``'s output is
            kept whole while attention keeps ``v``, a view of it).
        seq_len: tokens per sample s. micro_batch: samples per micro-batch b.
        dtype: the dtype its weights are kept in (a checkpoint's ``torch_dtype``; what the
            transfer presets list). Training dtypes are the cost model's
            (:class:`meshgroups.cost.Precision`).
        name: a label.

    Raises:
        TypeError: a size that is not an int.
        LayoutError: a size below 1, ``heads`` not a multiple of ``kv_heads``, ``top_k`` without
            experts or above them, ``hidden`` not divisible by ``heads`` without a ``head_dim``.

    >>> Model(layers=2, hidden=64, heads=8, kv_heads=3, ffn=128, vocab=256)
    Traceback (most recent call last):
    ...
    meshgroups.errors.LayoutError: heads=8 is not a multiple of kv_heads=3 (each key/value head serves a whole group of query heads)
    """

    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    kv_heads: int | None = None
    head_dim: int | None = None
    experts: int = 0
    top_k: int = 0
    expert_ffn: int | None = None
    gated_mlp: bool = False
    tied_embeddings: bool = False
    fused_projections: bool = True
    seq_len: int = 2048
    micro_batch: int = 1
    dtype: str = "bfloat16"
    name: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        for f in ("layers", "hidden", "heads", "ffn", "vocab", "seq_len", "micro_batch"):
            _positive(getattr(self, f), f)
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        kv = _positive(self.kv_heads, "kv_heads")
        if self.heads % kv:
            raise LayoutError(
                f"heads={self.heads} is not a multiple of kv_heads={kv} "
                "(each key/value head serves a whole group of query heads)"
            )
        if self.head_dim is None:
            if self.hidden % self.heads:
                raise LayoutError(
                    f"hidden={self.hidden} is not divisible by heads={self.heads}; give head_dim"
                )
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        _positive(self.head_dim, "head_dim")
        for f in ("experts", "top_k"):
            value = getattr(self, f)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise LayoutError(f"{f}={value!r} must be an int >= 0")
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise LayoutError(f"top_k={self.top_k} must be in 1..experts={self.experts}")
        if not self.experts and self.top_k:
            raise LayoutError(f"top_k={self.top_k} needs experts > 0 (this model is dense)")
        if self.expert_ffn is None:
            object.__setattr__(self, "expert_ffn", self.ffn)
        _positive(self.expert_ffn, "expert_ffn")
        if self.dtype not in DTYPES:
            raise LayoutError(f"dtype={self.dtype!r} must be one of {', '.join(DTYPES)}")

    @property
    def is_moe(self) -> bool:
        """Whether the layers' MLPs are routed experts."""
        return self.experts > 0

    def with_(self, **changes: Any) -> Model:
        """A copy with some fields changed (validated again)::

        >>> Model(layers=2, hidden=64, heads=8, ffn=128, vocab=256).with_(seq_len=64).seq_len
        64
        """
        return replace(self, **changes)

    def tensors(self) -> tuple[ParamTensor, ...]:
        """The parameter tensors: one layer's (``where="layer"``), then the embedding, the final
        norm and the output head (absent when ``tied_embeddings`` and one stage holds both ends:
        see :func:`meshgroups.cost._memory.stage_tensors`).

        Returns:
            the tensors, biases-free (as Llama-style models are), norms as RMSNorm weights.

        >>> [t.name for t in Model(layers=2, hidden=64, heads=8, ffn=128, vocab=256).tensors()]
        ['attn_norm', 'qkv', 'o', 'mlp_norm', 'fc1', 'fc2', 'embedding', 'final_norm', 'head']
        """
        h, hd = self.hidden, self.head_dim
        if hd is None or self.kv_heads is None or self.expert_ffn is None:  # filled in __post_init__
            raise RuntimeError("meshgroups internal error: a Model without head_dim, kv_heads or expert_ffn")
        gate = 2 if self.gated_mlp else 1
        layer = [ParamTensor("attn_norm", (h,), None)]
        if self.fused_projections:
            layer.append(ParamTensor("qkv", ((self.heads + 2 * self.kv_heads) * hd, h), 0))
        else:
            layer += [
                ParamTensor("q", (self.heads * hd, h), 0),
                ParamTensor("k", (self.kv_heads * hd, h), 0),
                ParamTensor("v", (self.kv_heads * hd, h), 0),
            ]
        layer += [ParamTensor("o", (h, self.heads * hd), 1), ParamTensor("mlp_norm", (h,), None)]
        if self.is_moe:
            e, f = self.experts, self.expert_ffn
            layer += [
                ParamTensor("router", (e, h), None),
                ParamTensor("experts_fc1", (e, gate * f, h), 1, expert=True),
                ParamTensor("experts_fc2", (e, h, f), 2, expert=True),
            ]
        elif self.fused_projections or not self.gated_mlp:
            layer += [ParamTensor("fc1", (gate * self.ffn, h), 0), ParamTensor("fc2", (h, self.ffn), 1)]
        else:
            layer += [
                ParamTensor("gate", (self.ffn, h), 0),
                ParamTensor("up", (self.ffn, h), 0),
                ParamTensor("fc2", (h, self.ffn), 1),
            ]
        ends = [
            ParamTensor("embedding", (self.vocab, h), 0, where="embedding"),
            ParamTensor("final_norm", (h,), None, where="final_norm"),
            ParamTensor("head", (self.vocab, h), 0, where="head"),
        ]
        return (*layer, *ends)

    def parameters(self) -> int:
        """Parameters of the whole model (a tied head counted once).

        Returns:
            the count.

        >>> Model(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256, gated_mlp=True).parameters()
        8030261248
        """
        total = 0
        for t in self.tensors():
            if t.where == "layer":
                total += t.numel * self.layers
            elif not (t.where == "head" and self.tied_embeddings):
                total += t.numel
        return total

    @classmethod
    def from_hf_config(cls, config: Any, /, **overrides: Any) -> Model:
        """A model from a Hugging Face config (a ``config.json`` dict or a ``transformers``
        config object): :func:`meshgroups.models.from_hf_config`, the package's one reader.

        Args:
            config: the config. overrides: fields of :class:`Model` set after reading it
                (``seq_len``, ``micro_batch``, or any it says).

        Returns:
            the model.

        >>> Model.from_hf_config({"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 8,
        ...                       "intermediate_size": 128, "vocab_size": 256}, seq_len=32).seq_len
        32
        """
        from ._hf import from_hf_config

        return from_hf_config(config, **overrides)
