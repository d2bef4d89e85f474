"""Input validation shared by the layout core and ``compat``.

Every check raises ``TypeError`` (wrong kind of value) or ``LayoutError`` (a ``ValueError``:
right kind, breaks a rule) with a message that names the offending value and the rule, so that
a bad layout fails on the line that built it rather than as a hang or a wrong group later.

Bounds: a layout holds at most :data:`MAX_WORLD_SIZE` ranks and no rank exceeds
:data:`MAX_RANK` (torch stores ranks as C ``int``), so every number derived from a layout fits
int64 and every grid can be materialised.
"""

from __future__ import annotations

import difflib
import itertools
import keyword
import reprlib
from collections.abc import Iterable, Sequence, Sized
from typing import cast

import numpy as np

from meshgroups.errors import DuplicateNameError, LayoutError, UnknownDimError, torch_says

#: Keyword arguments of ``Layout(...)``/``Layout.from_order`` that are options, not dim names.
#: Every other parameter of a method taking ``**dims`` is positional-only, so it cannot clash.
RESERVED_NAMES = frozenset({"rank_offset", "world_size"})
#: Largest global rank a layout may hold (``torch.distributed`` ranks are C ints).
MAX_RANK = 2**31 - 1
#: Most ranks one layout may hold: 16,777,216, far beyond any job today, small enough that the
#: grid of the largest layout (128 MiB) can always be built.
MAX_WORLD_SIZE = 2**24
#: Most dims one layout may have: numpy's limit on array dimensions (64 in numpy 2, 32 before),
#: checked up front so a long list of size-1 dims is refused before any work, not deep in numpy.
MAX_NDIM = 64 if int(np.__version__.split(".")[0]) >= 2 else 32
#: Longest digit string :func:`parse_int` reads (a rank or size never needs more).
MAX_DIGITS = 19


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 8


def short_repr(value: object) -> str:
    """``repr`` for messages about arbitrary input: bounded in length and nesting depth (a list
    nested 5,000 deep or a 10 MB string cannot blow up the error that names it)::

        >>> short_repr(list(range(100)))
        '[0, 1, 2, 3, 4, 5, 6, 7, ...]'
    """
    try:
        return _REPR.repr(value)
    except Exception:  # a hostile __repr__
        return f"<{type(value).__name__} object>"


def is_int(value: object) -> bool:
    """True for Python and numpy integers, False for bools and everything else."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_int(value: object, what: str) -> int:
    """``value`` as an int; ``TypeError`` naming ``what`` for anything else (bools included)::

    >>> check_int(4, "tp")
    4
    >>> check_int(True, "tp")
    Traceback (most recent call last):
    TypeError: tp must be an int, got True (bool)
    """
    if not is_int(value):
        raise TypeError(f"{what} must be an int, got {short_repr(value)} ({type(value).__name__})")
    return int(cast(int, value))


def check_positive(value: object, what: str, limit: int = MAX_WORLD_SIZE) -> int:
    """An int in ``1..limit``."""
    n = check_int(value, what)
    if not 1 <= n <= limit:
        raise LayoutError(f"{what}={n} must be between 1 and {limit}")
    return n


def parse_int(text: object, what: str) -> int:
    """An int written in ASCII digits with an optional leading ``-``: what a command line or a
    ``name=size`` string may say. ``int()`` alone would also take ``1_000``, ``" 8"`` and
    non-ASCII digits such as ``٣``; those are refused (``ValueError`` naming ``what``)::

        >>> parse_int("16", "size of 'tp'")
        16
    """
    if not isinstance(text, str):
        raise TypeError(
            f"{what} must be given as a str of digits, got {short_repr(text)} ({type(text).__name__})"
        )
    digits = text[1:] if text.startswith("-") else text
    if not digits or not digits.isascii() or not digits.isdigit():
        raise LayoutError(f"{what} must be an integer written in digits 0-9, got {short_repr(text)}")
    if len(digits) > MAX_DIGITS:
        raise LayoutError(f"{what} has more than {MAX_DIGITS} digits, got {text[:24]!r}…")
    return int(text)


def check_size(name: str, size: object) -> int:
    """A dim size checked: a positive integer no larger than a layout may hold.

    Args:
        name: the dim, for the message.
        size: the value given.

    Returns:
        ``size`` as an ``int``.

    Raises:
        TypeError: not an integer.
        LayoutError: below 1 or above ``MAX_WORLD_SIZE``.

    >>> check_size("tp", 4)
    4
    """
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
        raise TypeError(f"{what}s must be str, got {short_repr(name)} ({type(name).__name__})")
    if not name.isidentifier() or keyword.iskeyword(name):
        raise LayoutError(f"{what} {short_repr(name)} is not a Python identifier (or is a keyword)")
    if name in RESERVED_NAMES:
        raise LayoutError(f"{what} {name!r} is reserved for the Layout option of that name")
    return name


def check_names(names: object, what: str = "dim name", limit: int = MAX_NDIM) -> tuple[str, ...]:
    """An ordered sequence of at most ``limit`` (:data:`MAX_NDIM`) distinct names (a str or a
    set is refused: no defined order). The count is checked before any name, so a list of
    thousands of names costs nothing."""
    if isinstance(names, (str, bytes)):
        raise TypeError(
            f"{what}s must be a sequence of str such as ('dp', 'tp'), got the string {short_repr(names)}"
        )
    if isinstance(names, (set, frozenset)) or not isinstance(names, Iterable):
        raise TypeError(f"{what}s must be an ordered sequence (list or tuple), got {type(names).__name__}")
    items = list(itertools.islice(names, limit + 1))
    if len(items) > limit:
        count = len(names) if isinstance(names, Sized) else f"more than {limit}"
        raise LayoutError(f"{count} {what}s given; a layout has at most {limit} dims (numpy's limit)")
    checked = tuple(check_name(n, what) for n in items)
    seen: set[str] = set()
    for name in checked:
        if name in seen:
            message = f"duplicate {what} {name!r} in {checked}; {what}s must be unique"
            if what == "dim name":  # what init_device_mesh says of repeated mesh_dim_names
                message = torch_says(
                    message,
                    f"Each mesh_dim_name must be unique. Found repeated mesh_dim_name in mesh_dim_names {checked}",
                )
            raise DuplicateNameError(message)
        seen.add(name)
    return checked


def check_dims(requested: Sequence[object], names: Sequence[str], where: str = "") -> tuple[str, ...]:
    """Validate dims asked of a layout: known, str, not repeated. Keeps the caller's order."""
    suffix = f" of {where}" if where else ""
    out: list[str] = []
    for dim in requested:
        if not isinstance(dim, str):
            raise TypeError(f"dims are named by str, got {short_repr(dim)} ({type(dim).__name__})")
        if dim not in names:
            raise UnknownDimError(
                f"unknown dim {dim!r}; dims{suffix} are {', '.join(names)}{did_you_mean(dim, names, '; ')}"
            )
        if dim in out:
            raise DuplicateNameError(f"dim {dim!r} given twice in {tuple(requested)}")
        out.append(dim)
    return tuple(out)


def did_you_mean(name: str, known: Iterable[str], before: str = " ") -> str:
    """A suggestion for a mistyped name: ``before + "did you mean 'tp'?"``, or ``""`` when no
    known name is close (difflib's ratio of at least 0.6; the command line and the Python API
    suggest alike)::

        >>> did_you_mean("tpp", ["dp", "tp"])
        " did you mean 'tp'?"
        >>> did_you_mean("xp", ["dp", "tp"])
        ''
    """
    close = difflib.get_close_matches(name, list(known), n=2, cutoff=0.6)
    return f"{before}did you mean {' or '.join(map(repr, close))}?" if close else ""


def product(values: Iterable[int]) -> int:
    """The product of ``values`` as a Python ``int`` (1 for none; no numpy overflow).

    Args:
        values: integers.

    Returns:
        Their product.

    >>> product([2, 3, 4])
    24
    """
    result = 1
    for v in values:
        result *= int(v)
    return result


def formula(names: Sequence[str], sizes: Sequence[int]) -> str:
    """The product of ``sizes`` spelled out with their ``names``, for error messages::

    >>> formula(("pp", "dp", "tp"), (2, 2, 4))
    'pp=2 × dp=2 × tp=4 = 16'
    """
    terms = " × ".join(f"{n}={s}" for n, s in zip(names, sizes))
    return terms if len(sizes) == 1 else f"{terms} = {product(sizes)}"


__all__ = [
    "MAX_DIGITS",
    "MAX_NDIM",
    "MAX_RANK",
    "MAX_WORLD_SIZE",
    "RESERVED_NAMES",
    "check_dims",
    "check_int",
    "check_name",
    "check_names",
    "check_positive",
    "check_size",
    "check_world",
    "did_you_mean",
    "formula",
    "is_int",
    "parse_int",
    "product",
    "short_repr",
]
