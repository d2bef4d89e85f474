"""What a layout costs: memory per rank and bytes per group family, per topology level.

numpy only, like the layout core (``import meshgroups.cost`` imports no torch). Describe the
model (:class:`Model`, a preset or a Hugging Face config) and what each dim does (:class:`Parallelism`);
then :func:`rank_memory` / :func:`peak_memory` give the bytes a rank holds, :func:`traffic` the
bytes each collective moves on each level of a :class:`meshgroups.Topology`, and
:func:`enumerate_layouts` every layout of a world that the model admits, which fit a memory
budget, ordered by the bytes over the slowest level they cross (not a predicted step time)::

    >>> from meshgroups import Layout, Topology
    >>> from meshgroups.cost import peak_memory, preset, traffic
    >>> lay = Layout(dp_shard=4, tp=2)
    >>> peak_memory(preset("tiny"), lay).params
    45344
    >>> traffic(preset("tiny"), lay, Topology(node=2)).slowest_level
    'world'
"""

from __future__ import annotations

from meshgroups.cost._activations import activation_bytes_per_layer, korthikanti_bytes_per_layer
from meshgroups.cost._calls import Collective, collectives
from meshgroups.cost._enumerate import Candidate, enumerate_layouts
from meshgroups.cost._model import PRESETS, Model, preset
from meshgroups.cost._peak import Fit, RankMemory, fit, peak_memory, rank_memory

# SORT_KEYS, SORT_WORDS, ATTENTION, DTYPE_BYTES, RECOMPUTE: not in __all__, for the CLI's cost command.
from meshgroups.cost._report import (
    SORT_KEYS,
    SORT_WORDS,
    breakdown,
    breakdown_html,
    cost_report,
    format_bytes,
    html_table,
    sort_candidates,
    table,
)
from meshgroups.cost._roles import (
    ATTENTION,
    DTYPE_BYTES,
    RECOMPUTE,
    ROLES,
    Parallelism,
    Precision,
    bubble_fraction,
)
from meshgroups.cost._states import States, rank_states
from meshgroups.cost._traffic import Traffic, traffic

__all__ = [
    "PRESETS",
    "ROLES",
    "Candidate",
    "Collective",
    "Fit",
    "Model",
    "Parallelism",
    "Precision",
    "RankMemory",
    "States",
    "Traffic",
    "activation_bytes_per_layer",
    "breakdown",
    "breakdown_html",
    "bubble_fraction",
    "collectives",
    "cost_report",
    "enumerate_layouts",
    "fit",
    "format_bytes",
    "html_table",
    "korthikanti_bytes_per_layer",
    "peak_memory",
    "preset",
    "rank_memory",
    "rank_states",
    "sort_candidates",
    "table",
    "traffic",
]
