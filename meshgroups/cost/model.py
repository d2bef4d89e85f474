"""What a transformer is, for the cost model: its dims, and the parameter tensors they make.

A :class:`Model` is a frozen value (layers, hidden size, heads, key/value heads, head dim, FFN
size, vocabulary, experts and top-k, sequence length, micro-batch), from keywords, a preset
(:data:`PRESETS`) or a Hugging Face ``config.json`` dict (:meth:`Model.from_hf_config`). Its
:meth:`Model.tensors` lists the parameter tensors one layer and the ends of the network hold,
with the axis tensor parallelism cuts and, for experts, the expert axis: the memory and traffic
accounting works on these shapes, the way FSDP2 and DTensor cut them (``torch.chunk`` rows)::

    >>> m = Model(layers=2, hidden=64, heads=8, ffn=128, vocab=256)
    >>> m.head_dim, m.kv_heads, m.parameters()
    (8, 8, 98624)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

from meshgroups.errors import LayoutError

__all__ = ["PRESETS", "Model", "ParamTensor", "preset"]

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
        seq_len: tokens per sample s. micro_batch: samples per micro-batch b.
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
    seq_len: int = 2048
    micro_batch: int = 1
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

    @property
    def is_moe(self) -> bool:
        """Whether the layers' MLPs are routed experts."""
        return self.experts > 0

    def with_(self, **changes: Any) -> Model:
        """A copy with some fields changed (validated again)::

        >>> preset("tiny").with_(seq_len=64).seq_len
        64
        """
        return replace(self, **changes)

    def tensors(self) -> tuple[ParamTensor, ...]:
        """The parameter tensors: one layer's (``where="layer"``), then the embedding, the final
        norm and the output head (absent when ``tied_embeddings`` and one stage holds both ends:
        see :func:`meshgroups.cost.memory.stage_tensors`).

        Returns:
            the tensors, biases-free (as Llama-style models are), norms as RMSNorm weights.

        >>> [t.name for t in preset("tiny").tensors()]
        ['attn_norm', 'qkv', 'o', 'mlp_norm', 'fc1', 'fc2', 'embedding', 'final_norm', 'head']
        """
        h, hd = self.hidden, self.head_dim
        if hd is None or self.kv_heads is None or self.expert_ffn is None:  # filled in __post_init__
            raise RuntimeError("meshgroups internal error: a Model without head_dim, kv_heads or expert_ffn")
        gate = 2 if self.gated_mlp else 1
        layer = [
            ParamTensor("attn_norm", (h,), None),
            ParamTensor("qkv", ((self.heads + 2 * self.kv_heads) * hd, h), 0),
            ParamTensor("o", (h, self.heads * hd), 1),
            ParamTensor("mlp_norm", (h,), None),
        ]
        if self.is_moe:
            e, f = self.experts, self.expert_ffn
            layer += [
                ParamTensor("router", (e, h), None),
                ParamTensor("experts_fc1", (e, gate * f, h), 1, expert=True),
                ParamTensor("experts_fc2", (e, h, f), 2, expert=True),
            ]
        else:
            layer += [ParamTensor("fc1", (gate * self.ffn, h), 0), ParamTensor("fc2", (h, self.ffn), 1)]
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

        >>> preset("llama3-8b").parameters()
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
    def from_hf_config(cls, config: Mapping[str, Any], /, **overrides: Any) -> Model:
        """A model from a Hugging Face ``config.json`` dict (Llama, Mistral, Mixtral, Qwen,
        DeepSeek-style keys); ``overrides`` set fields the config does not hold (``seq_len``,
        ``micro_batch``) or replace what it says.

        Args:
            config: the dict (``num_hidden_layers``, ``hidden_size``, ``num_attention_heads``,
                ``intermediate_size``, ``vocab_size``; optional ``num_key_value_heads``,
                ``head_dim``, ``num_local_experts``/``num_experts``/``n_routed_experts``,
                ``num_experts_per_tok``, ``moe_intermediate_size``, ``tie_word_embeddings``,
                ``hidden_act``: ``silu`` makes a gated MLP).
            overrides: fields of :class:`Model` set after reading the config.

        Returns:
            the model.

        Raises:
            TypeError: ``config`` is not a mapping.
            LayoutError: a required key is missing, or a value breaks a rule of :class:`Model`.

        >>> Model.from_hf_config({"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 8,
        ...                       "intermediate_size": 128, "vocab_size": 256}, seq_len=32).seq_len
        32
        """
        if not isinstance(config, Mapping):
            raise TypeError(f"a Hugging Face config is a dict, got {type(config).__name__}")
        required = {
            "layers": "num_hidden_layers",
            "hidden": "hidden_size",
            "heads": "num_attention_heads",
            "ffn": "intermediate_size",
            "vocab": "vocab_size",
        }
        values: dict[str, Any] = {}
        for f, key in required.items():
            if key not in config:
                raise LayoutError(f"the config has no {key!r} (needed for {f})")
            values[f] = config[key]
        optional = {
            "kv_heads": ("num_key_value_heads",),
            "head_dim": ("head_dim",),
            "experts": ("num_local_experts", "num_experts", "n_routed_experts"),
            "top_k": ("num_experts_per_tok",),
            "expert_ffn": ("moe_intermediate_size",),
            "tied_embeddings": ("tie_word_embeddings",),
        }
        for f, keys in optional.items():
            for key in keys:
                if config.get(key) is not None:
                    values[f] = config[key]
                    break
        values["gated_mlp"] = str(config.get("hidden_act", "silu")).lower() in ("silu", "swiglu", "swish")
        values["name"] = str(config.get("_name_or_path", config.get("model_type", "")))
        if not values.get("experts"):
            values.pop("top_k", None)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise LayoutError(f"unknown Model field {unknown[0]!r}; fields are {', '.join(sorted(known))}")
        return cls(**{**values, **overrides})


#: Published model dims (from each model's paper or released config), keyed by name.
PRESETS: dict[str, Model] = {
    "tiny": Model(layers=4, hidden=64, heads=8, kv_heads=4, ffn=128, vocab=256, seq_len=32, name="tiny"),
    "tiny-moe": Model(
        layers=4,
        hidden=64,
        heads=8,
        kv_heads=4,
        ffn=128,
        vocab=256,
        experts=8,
        top_k=2,
        seq_len=32,
        gated_mlp=True,
        name="tiny-moe",
    ),
    "llama3-8b": Model(
        layers=32,
        hidden=4096,
        heads=32,
        kv_heads=8,
        ffn=14336,
        vocab=128256,
        gated_mlp=True,
        seq_len=8192,
        name="llama3-8b",
    ),
    "llama3-70b": Model(
        layers=80,
        hidden=8192,
        heads=64,
        kv_heads=8,
        ffn=28672,
        vocab=128256,
        gated_mlp=True,
        seq_len=8192,
        name="llama3-70b",
    ),
    # GPT-3 175B as Korthikanti et al. 2022 (Table 3) train it: a=96, h=12288, L=96, s=2048
    "gpt3-175b": Model(
        layers=96, hidden=12288, heads=96, ffn=4 * 12288, vocab=51200, seq_len=2048, name="gpt3-175b"
    ),
    "mixtral-8x7b": Model(
        layers=32,
        hidden=4096,
        heads=32,
        kv_heads=8,
        ffn=14336,
        vocab=32000,
        experts=8,
        top_k=2,
        gated_mlp=True,
        seq_len=4096,
        name="mixtral-8x7b",
    ),
}


def preset(name: str) -> Model:
    """The preset model ``name`` (a key of :data:`PRESETS`).

    Args:
        name: e.g. ``"llama3-8b"``.

    Returns:
        the model.

    Raises:
        LayoutError: an unknown name (the message lists the presets).

    >>> preset("gpt3-175b").heads
    96
    """
    if name not in PRESETS:
        raise LayoutError(f"unknown model preset {name!r}; presets are {', '.join(PRESETS)}")
    return PRESETS[name]
