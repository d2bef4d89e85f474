"""Preset models for planning without a real module: a transformer's weights placed on a layout.

``model_weights(model, layout)`` lists a preset model's weights (names, shapes, dtype) with the
placements a Megatron/torchtitan-style job gives them on ``layout``, so a plan can be drawn or
summarised from layouts alone (``python -m meshgroups transfer``, the weight-transfer notebook,
a capacity estimate). Placement rules, by layout dim name:

- ``tp``: Megatron's tensor parallelism: q/k/v/gate/up and the vocabulary (embedding, head)
  split on rows (``Shard(0)``), o/down on columns (``Shard(1)``); norms replicated.
- ``pp``: pipeline stages: layers split evenly in order, the embedding on the first stage, the
  final norm and the head on the last.
- ``ep`` / ``etp``: experts (``moe-*`` presets): the experts axis on ``ep``, each expert's ffn
  axis on ``etp``; the router replicated.
- ``dp_shard`` / ``fsdp``: FSDP2: every matrix's rows split again, after ``tp``/``ep`` where
  they already split rows (``shard_order``), as torch's ``fully_shard`` over a TP module does.
- any other dim (``dp``, ``cp``, ...): replicated.

::

    >>> from meshgroups import Layout
    >>> from meshgroups.transfer.presets import MODELS, model_weights
    >>> ws = model_weights("tiny", Layout(pp=2, tp=2))
    >>> [(w.name, w.shape, w.placements["tp"], w.stage) for w in ws[:2]]
    [('embed', (1000, 64), Shard(axis=0), ('pp', 0)), ('layers.0.q', (64, 64), Shard(axis=0), ('pp', 0))]
    >>> ws[-1].name, ws[-1].stage, sorted(MODELS)[:2]
    ('lm_head', ('pp', 1), ['llama-70b', 'llama-8b'])

numpy only (no torch), like the rest of ``meshgroups.transfer``'s planning side.
"""

from __future__ import annotations

from ..layout import Layout
from .spec import Placement, Shard, Weight

#: name: (hidden, ffn, kv width, vocab, layers, experts (0: dense), dtype)
MODELS: dict[str, tuple[int, int, int, int, int, int, str]] = {
    "tiny": (64, 256, 64, 1000, 2, 0, "float32"),
    "small": (1024, 4096, 256, 32000, 4, 0, "bfloat16"),
    "moe-small": (1024, 1024, 256, 32000, 4, 8, "bfloat16"),
    "llama-8b": (4096, 14336, 1024, 128256, 32, 0, "bfloat16"),
    "llama-70b": (8192, 28672, 1024, 128256, 80, 0, "bfloat16"),
}
#: Layout dims read as FSDP2's sharding dim (the first one present is used).
FSDP_DIMS = ("dp_shard", "fsdp")


def model_weights(model: str, layout: Layout) -> list[Weight]:
    """The preset ``model``'s weights placed on ``layout`` (rules: the module docstring).

    Returns a list of ``Weight`` (names, shapes, dtypes and placements). Raises ``ValueError``
    for a name not in ``MODELS``, naming the presets, and ``TypeError`` for a ``layout`` that is
    not a ``Layout``.

    >>> names = [w.name for w in model_weights("tiny", Layout(tp=2))]
    >>> names[:3]
    ['embed', 'layers.0.q', 'layers.0.k']
    """
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; models are {', '.join(MODELS)}")
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be a meshgroups.Layout, got {type(layout).__name__}")
    hidden, ffn, kv, vocab, layers, experts, dtype = MODELS[model]
    names = layout.names
    pp = layout.size("pp") if "pp" in names else 1
    fsdp = next((d for d in FSDP_DIMS if d in names), None)
    out: list[Weight] = []

    def add(name: str, shape: tuple[int, ...], tp_axis: int | None, stage: int, expert: bool = False) -> None:
        pl: dict[str, Placement] = {}
        if "tp" in names and tp_axis is not None and not expert:
            pl["tp"] = Shard(tp_axis)
        if expert:
            if "ep" in names:
                pl["ep"] = Shard(0)
            if "etp" in names and tp_axis is not None:
                pl["etp"] = Shard(tp_axis)
        order = None
        if fsdp is not None and len(shape) > 1:
            pl[fsdp] = Shard(0)
            sharing_rows = [d for d, p in pl.items() if d != fsdp and p == Shard(0)]
            if sharing_rows:  # FSDP2 splits what TP/EP already split: its dim nests last
                order = (*sharing_rows, fsdp)
        out.append(Weight(name, shape, dtype, pl, ("pp", stage) if "pp" in names else None, order))

    add("embed", (vocab, hidden), 0, 0)
    for layer in range(layers):
        s = layer * pp // layers
        for part, shape, axis in (
            ("q", (hidden, hidden), 0), ("k", (kv, hidden), 0), ("v", (kv, hidden), 0),
            ("o", (hidden, hidden), 1), ("ln1", (hidden,), None), ("ln2", (hidden,), None),
        ):  # fmt: skip
            add(f"layers.{layer}.{part}", shape, axis, s)
        if experts:
            add(f"layers.{layer}.router", (experts, hidden), None, s)
            add(f"layers.{layer}.experts.w1", (experts, ffn, hidden), 1, s, expert=True)
            add(f"layers.{layer}.experts.w2", (experts, hidden, ffn), 2, s, expert=True)
        else:
            for part, shape, axis in (
                ("gate", (ffn, hidden), 0),
                ("up", (ffn, hidden), 0),
                ("down", (hidden, ffn), 1),
            ):
                add(f"layers.{layer}.{part}", shape, axis, s)
    add("norm", (hidden,), None, pp - 1)
    add("lm_head", (vocab, hidden), 0, pp - 1)
    return out


__all__ = ["FSDP_DIMS", "MODELS", "model_weights"]
