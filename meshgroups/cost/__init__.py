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

from .activations import activation_bytes_per_layer, korthikanti_bytes_per_layer
from .calls import Collective, collectives
from .enumerate import Candidate, enumerate_layouts
from .model import PRESETS, Model, preset
from .peak import Fit, RankMemory, fit, peak_memory, rank_memory
from .report import cost_report, table
from .roles import Parallelism, Precision, bubble_fraction
from .states import States, rank_states
from .traffic import Traffic, traffic

__all__ = [
    "PRESETS",
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
    "bubble_fraction",
    "collectives",
    "cost_report",
    "enumerate_layouts",
    "fit",
    "korthikanti_bytes_per_layer",
    "peak_memory",
    "preset",
    "rank_memory",
    "rank_states",
    "table",
    "traffic",
]
