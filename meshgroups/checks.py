"""Input validation shared by the layout core and ``compat``.

Every check raises ``TypeError`` (wrong kind of value) or ``LayoutError`` (a ``ValueError``:
right kind, breaks a rule) with a message that names the offending value and the rule, so that
a bad layout fails on the line that built it rather than as a hang or a wrong group later.

Bounds: a layout holds at most :data:`MAX_WORLD_SIZE` ranks and no rank exceeds
:data:`MAX_RANK` (torch stores ranks as C ``int``), so every number derived from a layout fits
int64 and every grid can be materialised.
"""

from __future__ import annotations

import keyword
from collections.abc import Iterable, Sequence
from typing import cast

import numpy as np

from .errors import DuplicateNameError, LayoutError, UnknownDimError

#: Keyword arguments of ``Layout(...)``/``Layout.from_order`` that are options, not dim names.
#: Every other parameter of a method taking ``**dims`` is positional-only, so it cannot clash.
RESERVED_NAMES = frozenset({"rank_offset", "world_size"})
#: Largest global rank a layout may hold (``torch.distributed`` ranks are C ints).
MAX_RANK = 2**31 - 1
#: Most ranks one layout may hold: 16,777,216, far beyond any job today, small enough that the
#: grid of the largest layout (128 MiB) can always be built.
MAX_WORLD_SIZE = 2**24


def is_int(value: object) -> bool:
    """True for Python and numpy integers, False for bools and everything else."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_int(value: object, what: str) -> int:
    """``value`` as an int; ``TypeError`` naming ``what`` for anything else (bools included)."""
    if not is_int(value):
        raise TypeError(f"{what} must be an int, got {value!r} ({type(value).__name__})")
    return int(cast(int, value))


def check_positive(value: object, what: str, limit: int = MAX_WORLD_SIZE) -> int:
    """An int in ``1..limit``."""
    n = check_int(value, what)
    if not 1 <= n <= limit:
        raise LayoutError(f"{what}={n} must be between 1 and {limit}")
    return n


def check_size(name: str, size: object) -> int:
    size = check_int(size, f"size of dim {name!r}")
    if size < 1:
        raise LayoutError(f"{name}={size}: dim sizes must be positive integers")
    if size > MAX_WORLD_SIZE:
        raise LayoutError(f"{name}={size} exceeds the {MAX_WORLD_SIZE} ranks a layout may hold")
    return size


def check_world(names: Sequence[str], sizes: Sequence[int]) -> int:
    """The product of ``sizes``, refused if above :data:`MAX_WORLD_SIZE`."""
    world = product(sizes)
    if world > MAX_WORLD_SIZE:
        raise LayoutError(
            f"{formula(names, sizes)} ranks exceeds the {MAX_WORLD_SIZE} (2**24) a layout may hold"
        )
    return world


def check_name(name: object, what: str = "dim name") -> str:
    """A dim (or view) name: an identifier that is not a keyword nor a ``Layout`` option."""
    if not isinstance(name, str):
        raise TypeError(f"{what}s must be str, got {name!r} ({type(name).__name__})")
    if not name.isidentifier() or keyword.iskeyword(name):
        raise LayoutError(f"{what} {name!r} is not a Python identifier (or is a keyword)")
    if name in RESERVED_NAMES:
        raise LayoutError(f"{what} {name!r} is reserved for the Layout option of that name")
    return name


def check_names(names: object, what: str = "dim name") -> tuple[str, ...]:
    """An ordered sequence of distinct names (a str or a set is refused: no defined order)."""
    if isinstance(names, (str, bytes)):
        raise TypeError(f"{what}s must be a sequence of str such as ('dp', 'tp'), got the string {names!r}")
    if isinstance(names, (set, frozenset)) or not isinstance(names, Iterable):
        raise TypeError(f"{what}s must be an ordered sequence (list or tuple), got {type(names).__name__}")
    checked = tuple(check_name(n, what) for n in names)
    seen: set[str] = set()
    for name in checked:
        if name in seen:
            raise DuplicateNameError(f"duplicate {what} {name!r} in {checked}; {what}s must be unique")
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
            raise UnknownDimError(f"unknown dim {dim!r}; dims{suffix} are {', '.join(names)}")
        if dim in out:
            raise DuplicateNameError(f"dim {dim!r} given twice in {tuple(requested)}")
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
