"""Ready-made name maps for the conventions RL jobs meet most, as data (no vLLM, HF or Megatron
import): a Llama-style (Hugging Face) trainer into vLLM's fused weights, and Megatron-Core's
names to and from Hugging Face's.

A convention's weight names and shapes for a dense Llama-style model (``ModelConfig``) come
from :func:`layer_names`; the maps are built from the config (and, for vLLM, from any list of
names)::

    >>> cfg = ModelConfig(layers=1, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=100)
    >>> m = vllm_map(cfg)
    >>> m["model.layers.0.self_attn.qkv_proj.weight"].sources[1]
    'model.layers.0.self_attn.k_proj.weight'
    >>> q = megatron_to_hf(cfg)["model.layers.0.self_attn.q_proj.weight"]
    >>> [(s.start, s.stop) for s in q.segments]  # per query group: 2 q heads, then its k, v heads
    [(0, 32), (64, 96)]

Megatron's ``linear_qkv`` holds, per query group, the group's q heads, then its k head, then its
v head (a tp rank holds whole groups: ``sharding="whole"``); its GLU ``linear_fc1`` holds gate
then up, and a tp rank holds its shard of gate then its shard of up (``sharding="per_part"``,
as vLLM's ``gate_up_proj``). As a *trainer* weight, ``linear_fc1`` is the tensor whose
``Shard(0)`` over the trainer's tp gives each rank its ``[gate_r; up_r]``: pass ``trainer_tp``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from meshgroups._checks import is_int
from meshgroups.errors import LayoutError
from meshgroups.transfer._names.names import NameMap, Rule, Segment

#: Conventions :func:`layer_names` knows.
CONVENTIONS = ("hf", "vllm", "megatron")


@dataclass(frozen=True)
class ModelConfig:
    """A dense Llama-style transformer's sizes.

    Args:
        layers: transformer blocks.
        hidden: the model width.
        heads: attention heads (they divide ``hidden``).
        kv_heads: key/value heads (they divide ``heads``; fewer: grouped-query attention).
        ffn: the gated MLP's inner width.
        vocab: the vocabulary.

    Raises:
        LayoutError: a size that is not a positive int, or heads that do not divide.

    >>> ModelConfig(layers=2, hidden=8, heads=2, kv_heads=1, ffn=16, vocab=10).head_dim
    4
    """

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int

    def __post_init__(self) -> None:
        for k, v in vars(self).items():
            if not is_int(v) or v < 1:
                raise LayoutError(f"ModelConfig.{k} must be a positive int, got {v!r}")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise LayoutError(
                f"ModelConfig: heads={self.heads} must divide hidden={self.hidden} and kv_heads={self.kv_heads} "
                "must divide heads"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def q_rows(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_rows(self) -> int:
        return self.kv_heads * self.head_dim


def layer_names(
    cfg: ModelConfig, convention: str
) -> list[tuple[str, tuple[int, ...], int | None, int | None]]:
    """Every weight of ``cfg`` in ``convention`` (``"hf"``, ``"vllm"``, ``"megatron"``) in model
    order: ``(name, shape, tp axis (column-parallel 0, row-parallel 1, None: replicated), layer
    (None: embedding/final))``.

    Args:
        cfg: the model's sizes.
        convention: ``"hf"``, ``"vllm"`` or ``"megatron"``.

    Returns:
        One ``(name, shape, tp axis, layer)`` per weight.

    >>> [n for n, *_ in layer_names(ModelConfig(1, 8, 2, 1, 16, 10), "vllm")][2:4]
    ['model.layers.0.self_attn.qkv_proj.weight', 'model.layers.0.self_attn.o_proj.weight']
    """
    if convention not in CONVENTIONS:
        raise LayoutError(f"unknown convention {convention!r}; conventions are {', '.join(CONVENTIONS)}")
    h, q, kv, f = cfg.hidden, cfg.q_rows, cfg.kv_rows, cfg.ffn
    if convention == "megatron":
        first = [("embedding.word_embeddings.weight", (cfg.vocab, h), 0)]
        per = [
            ("self_attention.linear_qkv.layer_norm_weight", (h,), None),
            ("self_attention.linear_qkv.weight", (q + 2 * kv, h), 0),
            ("self_attention.linear_proj.weight", (h, q), 1),
            ("mlp.linear_fc1.layer_norm_weight", (h,), None),
            ("mlp.linear_fc1.weight", (2 * f, h), 0),
            ("mlp.linear_fc2.weight", (h, f), 1),
        ]
        last = [("decoder.final_layernorm.weight", (h,), None), ("output_layer.weight", (cfg.vocab, h), 0)]
        prefix = "decoder.layers.{}."
    else:
        first = [("model.embed_tokens.weight", (cfg.vocab, h), 0)]
        attn = (
            [("self_attn.qkv_proj.weight", (q + 2 * kv, h), 0)]
            if convention == "vllm"
            else [
                ("self_attn.q_proj.weight", (q, h), 0),
                ("self_attn.k_proj.weight", (kv, h), 0),
                ("self_attn.v_proj.weight", (kv, h), 0),
            ]
        )
        mlp = (
            [("mlp.gate_up_proj.weight", (2 * f, h), 0)]
            if convention == "vllm"
            else [("mlp.gate_proj.weight", (f, h), 0), ("mlp.up_proj.weight", (f, h), 0)]
        )
        per = [
            ("input_layernorm.weight", (h,), None),
            *attn,
            ("self_attn.o_proj.weight", (h, q), 1),
            ("post_attention_layernorm.weight", (h,), None),
            *mlp,
            ("mlp.down_proj.weight", (h, f), 1),
        ]
        last = [("model.norm.weight", (h,), None), ("lm_head.weight", (cfg.vocab, h), 0)]
        prefix = "model.layers.{}."
    out: list[tuple[str, tuple[int, ...], int | None, int | None]] = [(n, s, a, None) for n, s, a in first]
    for layer in range(cfg.layers):
        out += [(prefix.format(layer) + n, s, a, layer) for n, s, a in per]
    return out + [(n, s, a, None) for n, s, a in last]


_FUSED = {
    "q_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
    "gate_proj": ("gate_up_proj", ("gate_proj", "up_proj")),
}


def vllm_map(source: ModelConfig | Iterable[str], tied: bool = False) -> NameMap:
    """Trainer weights in Hugging Face Llama names -> vLLM's fused names: ``*.q_proj.*``,
    ``*.k_proj.*``, ``*.v_proj.*`` -> ``*.qkv_proj.*`` (q ‖ k ‖ v along axis 0, sharded per
    part as vLLM's ``QKVParallelLinear``), ``*.gate_proj.*``, ``*.up_proj.*`` ->
    ``*.gate_up_proj.*``; weights and biases alike. Other names stay. ``tied``: the rollout's
    ``lm_head.weight`` reads ``model.embed_tokens.weight``.

    Args:
        source: a ``ModelConfig`` or the trainer's weight names.
        tied: the rollout's ``lm_head.weight`` reads the trainer's embedding.

    Returns:
        The ``NameMap`` (rollout name -> rule).

    Raises:
        LayoutError: a ``q_proj`` without its ``k_proj``/``v_proj`` (or ``gate`` without ``up``).

    >>> sorted(vllm_map(["l.q_proj.weight", "l.k_proj.weight", "l.v_proj.weight"]))
    ['l.qkv_proj.weight']
    """
    names = [n for n, *_ in layer_names(source, "hf")] if isinstance(source, ModelConfig) else list(source)
    have = set(names)
    rules: dict[str, Rule] = {}
    for name in names:
        m = re.fullmatch(r"(.*\.)(q_proj|gate_proj)(\..*)", name)
        if m is None:
            continue
        fused, parts = _FUSED[m.group(2)]
        srcs = [m.group(1) + p + m.group(3) for p in parts]
        missing = [s for s in srcs if s not in have]
        if missing:
            raise LayoutError(f"vllm_map: {name!r} has no {', '.join(map(repr, missing))} to fuse with")
        rules[m.group(1) + fused + m.group(3)] = Rule.fuse(srcs)
    if tied:
        rules["lm_head.weight"] = Rule.rename("model.embed_tokens.weight")
    return NameMap(rules)


#: (Megatron name, HF name) of a layer's weights that are plain renames (after the layer prefix).
_LAYER_RENAMES = [
    ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
    ("self_attention.linear_proj.weight", "self_attn.o_proj.weight"),
    ("mlp.linear_fc1.layer_norm_weight", "post_attention_layernorm.weight"),
    ("mlp.linear_fc2.weight", "mlp.down_proj.weight"),
]


_ENDS = [
    ("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
    ("decoder.final_layernorm.weight", "model.norm.weight"),
    ("output_layer.weight", "lm_head.weight"),
]


def qkv_interleaved(q: str, k: str, v: str, groups: int, q_rows: int, kv_rows: int) -> Rule:
    """Megatron's ``linear_qkv`` (weight or bias) from Hugging Face's ``q``, ``k``, ``v``: per
    query group, its ``q_rows`` rows of ``q``, then its ``kv_rows`` of ``k``, then of ``v`` (a tp
    rank holds whole groups: ``sharding="whole"``).

    >>> [(s.source, s.start, s.stop) for s in qkv_interleaved("q", "k", "v", 2, 4, 2).segments][:4]
    [('q', 0, 4), ('k', 0, 2), ('v', 0, 2), ('q', 4, 8)]
    """
    segs: list[Segment] = []
    for g in range(groups):
        segs += [
            Segment(q, g * q_rows, (g + 1) * q_rows),
            Segment(k, g * kv_rows, (g + 1) * kv_rows),
            Segment(v, g * kv_rows, (g + 1) * kv_rows),
        ]
    return Rule((tuple(segs),), 0, "whole")


def qkv_cut(qkv: str, groups: int, q_rows: int, kv_rows: int) -> tuple[Rule, Rule, Rule]:
    """Hugging Face's q, k, v cut out of Megatron's ``linear_qkv`` ``qkv``, group by group (the
    inverse of :func:`qkv_interleaved`).

    >>> [(s.start, s.stop) for s in qkv_cut("qkv", 2, 4, 2)[1].segments]
    [(4, 6), (12, 14)]
    """
    group = q_rows + 2 * kv_rows
    return tuple(  # type: ignore[return-value]
        Rule((tuple(Segment(qkv, g * group + lo, g * group + lo + n) for g in range(groups)),))
        for lo, n in ((0, q_rows), (q_rows, kv_rows), (q_rows + kv_rows, kv_rows))
    )


def glu_cut(
    fc1: str, ffn: int, tp: int, index: int | None = None
) -> tuple[tuple[Segment, ...], tuple[Segment, ...]]:
    """The segments of gate and of up in Megatron's GLU ``linear_fc1`` ``fc1`` as a trainer with
    ``tp`` ranks holds it (rank ``r``: ``[gate_r; up_r]``, each ``ffn/tp`` rows); ``index``: of
    one entry of a packed ``[n, 2·ffn, ...]`` weight (inside a stack).

    >>> [(s.start, s.stop) for s in glu_cut("fc1", 8, 2)[1]]
    [(4, 8), (12, 16)]
    """
    per = ffn // tp
    return tuple(  # type: ignore[return-value]
        tuple(Segment(fc1, r * 2 * per + lo, r * 2 * per + lo + per, index) for r in range(tp))
        for lo in (0, per)
    )


def hf_to_megatron(cfg: ModelConfig) -> NameMap:
    """Trainer in Hugging Face names -> rollout in Megatron-Core names (``linear_qkv``
    interleaved per query group, ``linear_fc1`` = gate ‖ up sharded per part).

    Args:
        cfg: the model's sizes.

    Returns:
        The ``NameMap`` (Megatron name -> rule over Hugging Face names).

    >>> len(hf_to_megatron(ModelConfig(1, 8, 2, 1, 16, 10)))
    9
    """
    hd, qpg = cfg.head_dim, cfg.heads // cfg.kv_heads
    rules: dict[str, Rule] = {m: Rule.rename(h) for m, h in _ENDS}
    for layer in range(cfg.layers):
        mp, hp = f"decoder.layers.{layer}.", f"model.layers.{layer}."
        for m, h in _LAYER_RENAMES:
            rules[mp + m] = Rule.rename(hp + h)
        q, k, v = (hp + f"self_attn.{x}_proj.weight" for x in "qkv")
        rules[mp + "self_attention.linear_qkv.weight"] = qkv_interleaved(q, k, v, cfg.kv_heads, qpg * hd, hd)
        rules[mp + "mlp.linear_fc1.weight"] = Rule.fuse(
            [hp + "mlp.gate_proj.weight", hp + "mlp.up_proj.weight"]
        )
    return NameMap(rules)


def megatron_to_hf(cfg: ModelConfig, trainer_tp: int = 1) -> NameMap:
    """Trainer in Megatron-Core names -> rollout in Hugging Face names: q/k/v cut out of
    ``linear_qkv`` group by group, gate/up out of ``linear_fc1`` as the trainer's ``trainer_tp``
    ranks hold it (each its ``[gate_r; up_r]``).

    Args:
        cfg: the model's sizes.
        trainer_tp: the trainer's tensor-parallel size (how ``linear_fc1`` is laid out).

    Returns:
        The ``NameMap`` (Hugging Face name -> rule over Megatron names).

    Raises:
        LayoutError: ``trainer_tp`` does not divide ``ffn`` and ``kv_heads``.

    >>> "model.layers.0.self_attn.q_proj.weight" in megatron_to_hf(ModelConfig(1, 8, 2, 1, 16, 10))
    True
    """
    if not is_int(trainer_tp) or trainer_tp < 1 or cfg.ffn % trainer_tp or cfg.kv_heads % trainer_tp:
        raise LayoutError(
            f"megatron_to_hf: trainer_tp={trainer_tp!r} must be a positive int dividing ffn={cfg.ffn} and "
            f"kv_heads={cfg.kv_heads}"
        )
    hd, qpg = cfg.head_dim, cfg.heads // cfg.kv_heads
    rules: dict[str, Rule] = {h: Rule.rename(m) for m, h in _ENDS}
    for layer in range(cfg.layers):
        mp, hp = f"decoder.layers.{layer}.", f"model.layers.{layer}."
        for m, h in _LAYER_RENAMES:
            rules[hp + h] = Rule.rename(mp + m)
        cut = qkv_cut(mp + "self_attention.linear_qkv.weight", cfg.kv_heads, qpg * hd, hd)
        for name, rule in zip(("q_proj", "k_proj", "v_proj"), cut):
            rules[hp + f"self_attn.{name}.weight"] = rule
        gate, up = glu_cut(mp + "mlp.linear_fc1.weight", cfg.ffn, trainer_tp)
        rules[hp + "mlp.gate_proj.weight"], rules[hp + "mlp.up_proj.weight"] = Rule((gate,)), Rule((up,))
    return NameMap(rules)


#: Names accepted by :func:`preset_map` (and ``python -m meshgroups transfer --name-map``).
PRESET_MAPS = ("vllm", "hf-to-megatron", "megatron-to-hf")


def preset_map(name: str, cfg: ModelConfig, trainer_tp: int = 1) -> NameMap:
    """One of :data:`PRESET_MAPS` for ``cfg``.

    Args:
        name: ``"vllm"``, ``"hf-to-megatron"`` or ``"megatron-to-hf"``.
        cfg: the model's sizes.
        trainer_tp: for ``"megatron-to-hf"``: the trainer's tensor-parallel size.

    Returns:
        The ``NameMap``.

    Raises:
        LayoutError: another name (a ``ValueError`` naming the ready-made maps).

    >>> preset_map("vllm", ModelConfig(1, 8, 2, 1, 16, 10))["model.layers.0.mlp.gate_up_proj.weight"].sources
    ('model.layers.0.mlp.gate_proj.weight', 'model.layers.0.mlp.up_proj.weight')
    """
    if name == "vllm":
        return vllm_map(cfg)
    if name == "hf-to-megatron":
        return hf_to_megatron(cfg)
    if name == "megatron-to-hf":
        return megatron_to_hf(cfg, trainer_tp)
    raise LayoutError(f"unknown name map {name!r}; ready-made maps are {', '.join(PRESET_MAPS)}")


__all__ = [
    "CONVENTIONS",
    "PRESET_MAPS",
    "ModelConfig",
    "hf_to_megatron",
    "layer_names",
    "megatron_to_hf",
    "preset_map",
    "vllm_map",
]
