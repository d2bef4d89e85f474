"""The model the cost accounting reads: :mod:`meshgroups.models`' one description (the same
objects, re-exported here so ``meshgroups.cost.Model`` and ``meshgroups.cost._model.preset`` keep
working)::

    >>> from meshgroups.models import Model as Same
    >>> Model is Same, preset("tiny").layers
    (True, 4)
"""

from __future__ import annotations

from meshgroups.models import ALIASES, PRESETS, Model, ParamTensor, from_hf_config, preset

__all__ = ["ALIASES", "PRESETS", "Model", "ParamTensor", "from_hf_config", "preset"]
