"""Which role sizes a model admits: heads and kv heads divide over tp, the layers fill the
pipeline's chunks (evenly or as ``layers_per_stage`` says), experts divide over ep, the sequence
over cp. One list of rules, used by the accounting (which
refuses a layout that breaks one) and by the enumeration (which skips it)::

    >>> from meshgroups.cost._model import preset
    >>> problems(preset("tiny"), {"tp": 3})
    ['tp=3 does not divide heads=8', 'tp=3 does not divide kv_heads=4']
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from meshgroups.cost._model import Model
from meshgroups.errors import LayoutError

__all__ = ["check", "problems"]


def problems(
    model: Model,
    sizes: Mapping[str, int],
    virtual_stages: int = 1,
    layers_per_stage: Sequence[int] | None = None,
) -> list[str]:
    """Every rule ``sizes`` (``{role: size}``, missing roles 1) breaks for ``model``.

    Args:
        model: the model.
        sizes: role sizes.
        virtual_stages: the pipeline's chunks per stage.
        layers_per_stage: the layers of each chunk (``None``: split as evenly as they allow,
            which needs at least one layer per chunk).

    Returns:
        one sentence per broken rule (empty: the sizes fit the model).

    >>> problems(preset("tiny"), {"tp": 2, "pp": 2})
    []
    """
    tp, pp, cp, ep = (int(sizes.get(r, 1)) for r in ("tp", "pp", "cp", "ep"))
    out = []
    for what, value in (("heads", model.heads), ("kv_heads", model.kv_heads or model.heads)):
        if value % tp:
            out.append(f"tp={tp} does not divide {what}={value}")
    chunks = pp * virtual_stages
    if layers_per_stage is None:
        if model.layers < chunks:
            out.append(
                f"pp={pp} × virtual_stages={virtual_stages} = {chunks} chunks is more than layers={model.layers}"
            )
    elif len(layers_per_stage) != chunks or sum(layers_per_stage) != model.layers:
        out.append(
            f"layers_per_stage={list(layers_per_stage)} must have pp × virtual_stages = {chunks} entries "
            f"adding up to layers={model.layers}"
        )
    if model.seq_len % cp:
        out.append(f"cp={cp} does not divide seq_len={model.seq_len}")
    if ep > 1 and not model.is_moe:
        out.append(f"ep={ep} needs experts (this model is dense)")
    elif model.is_moe and model.experts % ep:
        out.append(f"ep={ep} does not divide experts={model.experts}")
    return out


def check(
    model: Model,
    sizes: Mapping[str, int],
    virtual_stages: int = 1,
    layers_per_stage: Sequence[int] | None = None,
) -> None:
    """Raise on the first rule of :func:`problems` that ``sizes`` breaks.

    Args:
        model, sizes, virtual_stages, layers_per_stage: as :func:`problems`.

    Raises:
        LayoutError: naming the value and the rule.

    >>> check(preset("tiny"), {"tp": 16})
    Traceback (most recent call last):
    ...
    meshgroups.errors.LayoutError: tp=16 does not divide heads=8
    """
    found = problems(model, sizes, virtual_stages, layers_per_stage)
    if found:
        raise LayoutError(found[0])
