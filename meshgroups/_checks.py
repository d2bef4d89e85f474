"""Input validation shared by the layout core.

Every check raises ``TypeError`` (wrong kind of value) or ``ValueError`` (right kind, breaks a
rule) with a message that names the offending value and the rule, so that a bad layout fails
on the line that built it rather than as a hang or a wrong group later.
"""

from __future__ import annotations

import keyword
from collections.abc import Iterable, Sequence
from typing import cast

import numpy as np

# Keyword arguments of ``Layout(...)`` that are options, not dim names.
RESERVED_NAMES = frozenset({"rank_offset", "world_size"})


def is_int(value: object) -> bool:
    """True for Python and numpy integers, False for bools and everything else."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_int(value: object, what: str) -> int:
    if not is_int(value):
        raise TypeError(f"{what} must be an int, got {value!r} ({type(value).__name__})")
    return int(cast(int, value))


def check_size(name: str, size: object) -> int:
    size = check_int(size, f"size of dim {name!r}")
    if size < 1:
        raise ValueError(f"{name}={size}: dim sizes must be positive integers")
    return size


def check_name(name: object) -> str:
    if not isinstance(name, str):
        raise TypeError(f"dim names must be str, got {name!r} ({type(name).__name__})")
    if not name.isidentifier() or keyword.iskeyword(name):
        raise ValueError(f"dim name {name!r} is not a Python identifier")
    if name in RESERVED_NAMES:
        raise ValueError(f"dim name {name!r} is reserved for the Layout option of that name")
    return name


def check_names(names: Iterable[object]) -> tuple[str, ...]:
    checked = tuple(check_name(n) for n in names)
    seen: set[str] = set()
    for name in checked:
        if name in seen:
            raise ValueError(f"duplicate dim name {name!r} in {checked}; dim names must be unique")
        seen.add(name)
    return checked


def check_dims(requested: Sequence[object], names: Sequence[str], where: str = "") -> tuple[str, ...]:
    """Validate dims asked of a layout: known, str, not repeated. Keeps the caller's order."""
    suffix = f" of {where}" if where else ""
    out: list[str] = []
    for dim in requested:
        if not isinstance(dim, str):
            raise TypeError(f"dims are named by str, got {dim!r} ({type(dim).__name__})")
        if dim not in names:
            raise ValueError(f"unknown dim {dim!r}; dims{suffix} are {', '.join(names)}")
        if dim in out:
            raise ValueError(f"dim {dim!r} given twice in {tuple(requested)}")
        out.append(dim)
    return tuple(out)


def product(values: Iterable[int]) -> int:
    result = 1
    for v in values:
        result *= int(v)
    return result


def formula(names: Sequence[str], sizes: Sequence[int]) -> str:
    """``pp=2 × dp=2 × tp=4 = 16``: the product spelled out for error messages."""
    terms = " × ".join(f"{n}={s}" for n, s in zip(names, sizes))
    return terms if len(sizes) == 1 else f"{terms} = {product(sizes)}"
