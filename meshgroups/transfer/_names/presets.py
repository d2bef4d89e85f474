"""Preset models for planning without a real module: a transformer's weights placed on a layout.

``model_weights(model, layout)`` lists a preset model's weights (names, shapes, dtype) with the
placements a Megatron/torchtitan-style job gives them on ``layout``, so a plan can be drawn or
summarised from layouts alone (``python -m meshgroups transfer``, the weight-transfer notebook,
a capacity estimate). The presets are the package's one set (:data:`meshgroups.models.PRESETS`,
the names the cost model and every CLI command use; older names in ``ALIASES``). Placement
rules, by layout dim name:

- ``tp``: Megatron's tensor parallelism: q/k/v/gate/up and the vocabulary (embedding, head)
  split on rows (``Shard(0)``), o/down on columns (``Shard(1)``); norms replicated.
- ``pp``: pipeline stages: layers split evenly in order, the embedding on the first stage, the
  final norm and the head on the last.
- ``ep`` / ``etp``: experts (``moe-small``, ``tiny-moe``, ``mixtral-8x7b``): the experts axis
  on ``ep``, each expert's ffn axis on ``etp``; the router replicated.
- ``dp_shard`` / ``fsdp``: FSDP2: every matrix's rows split again, after ``tp``/``ep`` where
  they already split rows (``shard_order``), as torch's ``fully_shard`` over a TP module does.
- any other dim (``dp``, ``cp``, ...): replicated.

``names=`` gives a dense preset's weights in a real convention's names instead
(``"hf"``, ``"vllm"`` with fused ``qkv_proj``/``gate_up_proj``, ``"megatron"``; see
:mod:`~meshgroups.transfer._names.conventions`), e.g. a rollout side for a name map; fused weights are
placed as one tensor (``Shard(0)`` on ``tp``), the map's rule says how its parts are sharded.

::

    >>> from meshgroups import Layout
    >>> from meshgroups.transfer import MODELS, model_weights
    >>> ws = model_weights("tiny", Layout(pp=2, tp=2))
    >>> [(w.name, w.shape, w.placements["tp"], w.stage) for w in ws[:2]]
    [('embed', (256, 64), Shard(axis=0), ('pp', 0)), ('layers.0.q', (64, 64), Shard(axis=0), ('pp', 0))]
    >>> ws[-1].name, ws[-1].stage, list(MODELS)[:2]
    ('lm_head', ('pp', 1), ['tiny', 'tiny-moe'])

numpy only (no torch), like the rest of ``meshgroups.transfer``'s planning side.
"""

from __future__ import annotations

from meshgroups.layout import Layout
from meshgroups.models import ALIASES, PRESETS, Model, preset
from meshgroups.transfer._names.conventions import CONVENTIONS, ModelConfig, layer_names
from meshgroups.transfer._spec import Placement, Shard, Weight

#: name: (hidden, ffn, kv width, vocab, layers, experts (0: dense), dtype), read from the package's
#: one set of presets (:data:`meshgroups.models.PRESETS`); older names are :data:`ALIASES`.
MODELS: dict[str, tuple[int, int, int, int, int, int, str]] = {
    name: (m.hidden, (m.expert_ffn or m.ffn) if m.is_moe else m.ffn, (m.kv_heads or 0) * (m.head_dim or 0), m.vocab,
           m.layers, m.experts, m.dtype)
    for name, m in PRESETS.items()
}  # fmt: skip
#: Attention heads per preset (kv heads = kv width / head dim).
HEADS = {name: m.heads for name, m in PRESETS.items()}
#: Layout dims read as FSDP2's sharding dim (the first one present is used).
FSDP_DIMS = ("dp_shard", "fsdp")


def _preset(model: str) -> Model:
    if not isinstance(model, str) or ALIASES.get(model, model) not in PRESETS:
        raise ValueError(f"unknown model {model!r}; models are {', '.join([*MODELS, *ALIASES])}")
    return preset(model)


def model_config(model: str) -> ModelConfig:
    """A dense preset's sizes as a :class:`~meshgroups.transfer.ModelConfig`.

    Args:
        model: a dense, gated (Llama-style) preset's name in ``MODELS`` (or an older spelling,
            ``ALIASES``).

    Returns:
        Its ``ModelConfig`` (layers, hidden, heads, kv heads, ffn, vocab).

    Raises:
        ValueError: an unknown name, or a preset with experts or without a gated MLP.

    >>> model_config("llama-70b").kv_heads
    8
    """
    m = _preset(model)
    if m.is_moe:
        raise ValueError(f"model {model!r} has experts; the named conventions describe dense models only")
    if not m.gated_mlp or m.head_dim != m.hidden // m.heads:
        raise ValueError(f"model {model!r} is not Llama-style (a gated MLP, head_dim = hidden / heads)")
    return ModelConfig(m.layers, m.hidden, m.heads, m.kv_heads or m.heads, m.ffn, m.vocab)


def model_weights(
    model: str | ModelConfig, layout: Layout, names: str = "preset", dtype: str | None = None
) -> list[Weight]:
    """The preset ``model``'s weights placed on ``layout`` as a Megatron/torchtitan job places
    them, by dim name: ``tp`` Megatron's, ``pp`` stages, ``ep``/``etp`` experts, ``dp_shard`` /
    ``fsdp`` FSDP2's rows after ``tp``; any other dim replicated.

    Args:
        model: a name in ``MODELS`` (or an older spelling, ``ALIASES``), or a ``ModelConfig``
            (dense; needs a convention's ``names``; dtype default float32).
        layout: the layout the weights are placed on.
        names: ``"preset"`` (short names), or a convention: ``"hf"``, ``"vllm"``, ``"megatron"``.
        dtype: every weight's dtype (default: the preset's).

    Returns:
        A list of ``Weight`` (names, shapes, dtypes and placements).

    Raises:
        ValueError: a name not in ``MODELS`` or an unknown convention, naming the choices.
        TypeError: a ``layout`` that is not a ``Layout``.

    >>> names = [w.name for w in model_weights("tiny", Layout(tp=2))]
    >>> names[:3]
    ['embed', 'layers.0.q', 'layers.0.k']
    """
    if isinstance(model, ModelConfig):
        cfg = model
        if names == "preset":
            raise ValueError("a ModelConfig needs names= one of " + ", ".join(CONVENTIONS))
        hidden, ffn, kv, vocab, layers, experts, preset_dtype = (0, 0, 0, 0, cfg.layers, 0, "float32")
        heads_rows, gated = 0, True
    else:
        spec = _preset(model)
        hidden, ffn, kv, vocab, layers, experts, preset_dtype = MODELS[spec.name]
        heads_rows, gated = spec.heads * (spec.head_dim or 0), spec.gated_mlp
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be a meshgroups.Layout, got {type(layout).__name__}")
    if names != "preset" and names not in CONVENTIONS:
        raise ValueError(f"unknown names {names!r}; use 'preset' or one of {', '.join(CONVENTIONS)}")
    dtype = dtype or preset_dtype
    convention, dims = names, layout.names
    pp = layout.size("pp") if "pp" in dims else 1
    fsdp = next((d for d in FSDP_DIMS if d in dims), None)
    out: list[Weight] = []

    def add(name: str, shape: tuple[int, ...], tp_axis: int | None, stage: int, expert: bool = False) -> None:
        pl: dict[str, Placement] = {}
        if "tp" in dims and tp_axis is not None and not expert:
            pl["tp"] = Shard(tp_axis)
        if expert:
            if "ep" in dims:
                pl["ep"] = Shard(0)
            if "etp" in dims and tp_axis is not None:
                pl["etp"] = Shard(tp_axis)
        order = None
        if fsdp is not None and len(shape) > 1:
            pl[fsdp] = Shard(0)
            sharing_rows = [d for d, p in pl.items() if d != fsdp and p == Shard(0)]
            if sharing_rows:  # FSDP2 splits what TP/EP already split: its dim nests last
                order = (*sharing_rows, fsdp)
        out.append(Weight(name, shape, dtype, pl, ("pp", stage) if "pp" in dims else None, order))

    if convention != "preset":
        cfg = model if isinstance(model, ModelConfig) else model_config(model)
        for name, shape, axis, at in layer_names(cfg, convention):
            stage = (at * pp // layers) if at is not None else (0 if "embed" in name else pp - 1)
            add(name, shape, axis, stage)
        return out
    add("embed", (vocab, hidden), 0, 0)
    for layer in range(layers):
        s = layer * pp // layers
        for part, shape, axis in (
            ("q", (heads_rows, hidden), 0), ("k", (kv, hidden), 0), ("v", (kv, hidden), 0),
            ("o", (hidden, heads_rows), 1), ("ln1", (hidden,), None), ("ln2", (hidden,), None),
        ):  # fmt: skip
            add(f"layers.{layer}.{part}", shape, axis, s)
        if experts:
            add(f"layers.{layer}.router", (experts, hidden), None, s)
            add(f"layers.{layer}.experts.w1", (experts, (2 if gated else 1) * ffn, hidden), 1, s, expert=True)
            add(f"layers.{layer}.experts.w2", (experts, hidden, ffn), 2, s, expert=True)
        else:
            parts = [("gate", (ffn, hidden), 0)] if gated else []
            parts += [("up", (ffn, hidden), 0), ("down", (hidden, ffn), 1)]
            for part, shape, axis in parts:
                add(f"layers.{layer}.{part}", shape, axis, s)
    add("norm", (hidden,), None, pp - 1)
    add("lm_head", (vocab, hidden), 0, pp - 1)
    return out


__all__ = ["ALIASES", "FSDP_DIMS", "HEADS", "MODELS", "model_config", "model_weights"]
