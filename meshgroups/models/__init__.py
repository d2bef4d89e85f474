"""One description of a transformer for the whole package (numpy side: no torch).

:class:`Model` holds a decoder-only transformer's dims and lists its parameter tensors
(:class:`ParamTensor`); :data:`PRESETS` / :func:`preset` are the published and test models by one
set of names (older spellings in :data:`ALIASES`); :func:`from_hf_config` and :func:`hf_value`
are the one reader of Hugging Face configs. :mod:`meshgroups.cost`, the transfer presets
(`meshgroups.transfer.model_weights`, and through them the CLI and the notebooks) and the transfer
families' name maps use these::

    >>> from meshgroups.models import preset
    >>> m = preset("llama3-8b")
    >>> m.parameters(), m.kv_heads, m.head_dim
    (8030261248, 8, 128)
"""

from __future__ import annotations

from ._hf import EXPERT_KEYS, from_hf_config, hf_value
from ._model import DTYPES, Model, ParamTensor
from ._presets import ALIASES, PRESETS, preset, preset_names

__all__ = [
    "ALIASES",
    "DTYPES",
    "EXPERT_KEYS",
    "PRESETS",
    "Model",
    "ParamTensor",
    "from_hf_config",
    "hf_value",
    "preset",
    "preset_names",
]
