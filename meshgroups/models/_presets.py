"""The package's one set of preset models: published dims (each model's paper or released
config) and a few small ones for tests and notebooks, under one set of names that the cost
model, the transfer presets and every CLI command share. Older spellings (``llama-8b``) are
:data:`ALIASES` of the same models::

    >>> preset("llama-8b") is preset("llama3-8b")
    True
    >>> preset("llama3.1-405b").layers
    126
"""

from __future__ import annotations

from meshgroups.errors import LayoutError

from ._model import Model

__all__ = ["ALIASES", "PRESETS", "preset", "preset_names"]


def _llama(name: str, layers: int, hidden: int, heads: int, kv: int, ffn: int, vocab: int, seq: int) -> Model:
    return Model(
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv,
        ffn=ffn,
        vocab=vocab,
        gated_mlp=True,
        seq_len=seq,
        name=name,
    )


#: Preset models by name (small ones first).
PRESETS: dict[str, Model] = {
    "tiny": Model(
        layers=4,
        hidden=64,
        heads=8,
        kv_heads=4,
        ffn=128,
        vocab=256,
        gated_mlp=True,
        seq_len=32,
        dtype="float32",
        name="tiny",
    ),
    "tiny-moe": Model(
        layers=4,
        hidden=64,
        heads=8,
        kv_heads=4,
        ffn=128,
        vocab=256,
        experts=8,
        top_k=2,
        gated_mlp=True,
        seq_len=32,
        dtype="float32",
        name="tiny-moe",
    ),
    "small": _llama("small", 4, 1024, 16, 4, 4096, 32000, 2048),
    "moe-small": Model(
        layers=4,
        hidden=1024,
        heads=16,
        kv_heads=4,
        ffn=1024,
        vocab=32000,
        experts=8,
        top_k=2,
        seq_len=2048,
        name="moe-small",
    ),
    # Llama 2 (Touvron et al. 2023, Table 1; the released configs)
    "llama2-7b": _llama("llama2-7b", 32, 4096, 32, 32, 11008, 32000, 4096),
    "llama2-13b": _llama("llama2-13b", 40, 5120, 40, 40, 13824, 32000, 4096),
    "llama2-70b": _llama("llama2-70b", 80, 8192, 64, 8, 28672, 32000, 4096),
    # Llama 3 / 3.1 (Llama Team 2024, Table 3; the released configs)
    "llama3-8b": _llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192),
    "llama3-70b": _llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192),
    "llama3.1-405b": _llama("llama3.1-405b", 126, 16384, 128, 8, 53248, 128256, 8192),
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

#: Other spellings of preset names (the transfer presets' older names, Llama 3.1's 8B and 70B,
#: whose dims are Llama 3's).
ALIASES: dict[str, str] = {
    "llama-8b": "llama3-8b",
    "llama-70b": "llama3-70b",
    "llama3.1-8b": "llama3-8b",
    "llama3.1-70b": "llama3-70b",
}


def preset_names(aliases: bool = False) -> list[str]:
    """The preset names, in :data:`PRESETS` order (then the aliases, with ``aliases``).

    Args:
        aliases: include the other spellings of :data:`ALIASES`.

    Returns:
        the names.

    >>> preset_names()[:3]
    ['tiny', 'tiny-moe', 'small']
    """
    return [*PRESETS, *(ALIASES if aliases else ())]


def preset(name: str) -> Model:
    """The preset model ``name`` (a key of :data:`PRESETS` or :data:`ALIASES`).

    Args:
        name: e.g. ``"llama3-8b"``.

    Returns:
        the model.

    Raises:
        LayoutError: an unknown name (the message lists the presets).

    >>> preset("gpt3-175b").heads
    96
    """
    if not isinstance(name, str):
        raise TypeError(f"a preset name is a str, got {type(name).__name__}")
    key = ALIASES.get(name, name)
    if key not in PRESETS:
        raise LayoutError(
            f"unknown model preset {name!r}; presets are {', '.join(preset_names(aliases=True))}"
        )
    return PRESETS[key]
