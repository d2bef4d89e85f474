"""The package's one Hugging Face config reader: a ``config.json`` dict or a ``transformers``
config object (read by attribute; nothing is imported), its keys under their several spellings.

:func:`hf_value` reads one value (the first of several key spellings that is set);
:func:`from_hf_config` reads a whole :class:`~meshgroups.models.Model`. The cost model, the
CLI's ``--hf-config`` and the transfer families' name maps (`meshgroups.transfer.hf_to_vllm`)
all read configs through these two::

    >>> hf_value({"n_routed_experts": 8}, *EXPERT_KEYS)
    8
    >>> from_hf_config({"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 8,
    ...                 "intermediate_size": 128, "vocab_size": 256}).kv_heads
    8
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from meshgroups.errors import LayoutError

from ._model import DTYPES, Model

__all__ = ["EXPERT_KEYS", "from_hf_config", "hf_value"]

#: The keys families give their routed-expert count under (Mixtral, Qwen-MoE, DeepSeek).
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
# Model field -> the config keys that give it, first found wins
_REQUIRED: dict[str, tuple[str, ...]] = {
    "layers": ("num_hidden_layers",),
    "hidden": ("hidden_size",),
    "heads": ("num_attention_heads",),
    "ffn": ("intermediate_size",),
    "vocab": ("vocab_size",),
}
_OPTIONAL: dict[str, tuple[str, ...]] = {
    "kv_heads": ("num_key_value_heads",),
    "head_dim": ("head_dim",),
    "experts": EXPERT_KEYS,
    "top_k": ("num_experts_per_tok",),
    "expert_ffn": ("moe_intermediate_size",),
    "tied_embeddings": ("tie_word_embeddings",),
}
_MISSING = object()


def hf_value(config: object, *keys: str, default: Any = None) -> Any:
    """The value of the first of ``keys`` that ``config`` sets (a key missing or ``None`` is
    not set).

    Args:
        config: a dict, or any object with the keys as attributes (a ``transformers`` config).
        keys: the spellings to try, in order. default: what an unset value reads as.

    Returns:
        the value, or ``default``.

    >>> class Config:
    ...     num_key_value_heads = None
    ...     num_attention_heads = 4
    >>> hf_value(Config(), "num_key_value_heads", "num_attention_heads")
    4
    """
    for key in keys:
        if isinstance(config, Mapping):
            value = config.get(key, _MISSING)
        else:
            value = getattr(config, key, _MISSING)
        if value is not _MISSING and value is not None:
            return value
    return default


def from_hf_config(config: object, /, **overrides: Any) -> Model:
    """A :class:`~meshgroups.models.Model` from a Hugging Face config (Llama, Mistral, Mixtral,
    Qwen, DeepSeek-style keys); ``overrides`` set fields the config does not hold
    (``seq_len``, ``micro_batch``) or replace what it says.

    Args:
        config: a dict (``num_hidden_layers``, ``hidden_size``, ``num_attention_heads``,
            ``intermediate_size``, ``vocab_size``; optional ``num_key_value_heads``,
            ``head_dim``, ``num_local_experts``/``num_experts``/``n_routed_experts``,
            ``num_experts_per_tok``, ``moe_intermediate_size``, ``tie_word_embeddings``,
            ``torch_dtype``, ``hidden_act``: ``silu`` makes a gated MLP), or an object with
            those attributes.
        overrides: fields of :class:`~meshgroups.models.Model` set after reading the config.

    Returns:
        the model.

    Raises:
        TypeError: ``config`` is a string, a number or a list (not a config).
        LayoutError: a required key is missing, an unknown override, or a value that breaks a
            rule of :class:`~meshgroups.models.Model`.

    >>> from_hf_config({"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 8,
    ...                 "intermediate_size": 128, "vocab_size": 256, "num_local_experts": 4,
    ...                 "num_experts_per_tok": 2}, seq_len=32).experts
    4
    """
    if isinstance(config, str | bytes | int | float | list | tuple) or config is None:
        raise TypeError(f"a Hugging Face config is a dict or a config object, got {type(config).__name__}")
    values: dict[str, Any] = {}
    for f, keys in _REQUIRED.items():
        value = hf_value(config, *keys)
        if value is None:
            raise LayoutError(f"the config has no {keys[0]!r} (needed for {f})")
        values[f] = value
    for f, keys in _OPTIONAL.items():
        value = hf_value(config, *keys)
        if value is not None:
            values[f] = value
    values["gated_mlp"] = str(hf_value(config, "hidden_act", default="silu")).lower() in (
        "silu",
        "swiglu",
        "swish",
    )
    dtype = str(hf_value(config, "torch_dtype", "dtype", default="bfloat16")).removeprefix("torch.")
    if dtype in DTYPES:
        values["dtype"] = dtype
    values["name"] = str(hf_value(config, "_name_or_path", "model_type", default=""))
    if not values.get("experts"):
        values.pop("top_k", None)
    known = {f.name for f in fields(Model)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise LayoutError(f"unknown Model field {unknown[0]!r}; fields are {', '.join(sorted(known))}")
    return Model(**{**values, **overrides})
