"""Command-line values, parsed strictly: the argparse types and the ``name=size`` words of
``python -m meshgroups``.

Strict means what a user typed is what is used: integers in ASCII digits only (``int()`` would
also take ``1_000``, `` 8`` and ``٣``), floats in plain decimal or exponent notation (``float()``
would also take ``nan``, ``inf`` and non-ASCII digits), each within a stated range. Every refusal
is an ``argparse.ArgumentTypeError`` or ``parser.error``: exit status 2, the usage line and the
rule, never a traceback::

    >>> bounded_int("--dpi", 1, 400)("120")
    120
"""

from __future__ import annotations

import argparse
import difflib
import re
from collections.abc import Callable, Sequence

from meshgroups._checks import MAX_RANK, did_you_mean, parse_int
from meshgroups.errors import LayoutError

#: Megatron's order tokens (RankGenerator accepts these and no others).
ORDER_TOKENS = ("tp", "cp", "ep", "dp", "pp")
#: Names a dim is usually called; a name close to one of these but not it is probably a typo.
USUAL_NAMES = (
    *ORDER_TOKENS,
    "etp",
    "edp",
    "sp",
    "dp_replicate",
    "dp_shard",
    "fsdp",
    "expt_tp",
    "expt_dp",
    "world",
    "node",
    "local",
)
_FLOAT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?", re.ASCII)


def strict_int(value: str, what: str) -> int:
    """``value`` as an int in ASCII digits (``ArgumentTypeError`` otherwise)."""
    try:
        return parse_int(value, what)
    except LayoutError:
        raise argparse.ArgumentTypeError(f"{what} must be an integer in digits 0-9, got {value!r}") from None


def bounded_int(what: str, low: int, high: int, rule: str = "") -> Callable[[str], int]:
    """An argparse type: an int in ``low..high``; below ``low`` says "must be positive" (or
    ">= 0"), above ``high`` states the cap and ``rule`` (why there is one)."""

    def parse(value: str) -> int:
        number = strict_int(value, what)
        if number < low:
            raise argparse.ArgumentTypeError(
                f"{what} must be {'positive' if low == 1 else f'>= {low}'}, got {value!r}"
            )
        if number > high:
            raise argparse.ArgumentTypeError(f"{what} must be at most {high}{rule}, got {value!r}")
        return number

    return parse


def bounded_float(what: str, high: float, low: float = 0.0, unit: str = "") -> Callable[[str], float]:
    """An argparse type: a float ``> 0``, in ``low..high``, written in decimal digits."""

    def parse(value: str) -> float:
        if not _FLOAT.fullmatch(value):
            raise argparse.ArgumentTypeError(f"{what} must be a number in digits 0-9, got {value!r}")
        number = float(value)
        if not number > 0:
            raise argparse.ArgumentTypeError(f"{what} must be positive, got {value!r}")
        if not low <= number <= high:
            raise argparse.ArgumentTypeError(
                f"{what} must be between {low:g} and {high:g}{unit}, got {value!r}"
            )
        return number

    return parse


def rank_arg(value: str) -> int:
    """An argparse type for ``--rank``: an int in ``0..MAX_RANK``."""
    number = strict_int(value, "--rank")
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value!r}")
    if number > MAX_RANK:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_RANK} (ranks are C ints), got {value!r}")
    return number


def signed_int(what: str) -> Callable[[str], int]:
    """An argparse type: any int in ASCII digits (the layout checks its range)."""
    return lambda value: strict_int(value, what)


def parse_dims(
    parser: argparse.ArgumentParser, words: Sequence[str], any_names: bool
) -> list[tuple[str, int]]:
    """``name=size`` words as ``(name, size)`` pairs; a name close to a usual one is refused
    with a suggestion unless ``any_names``."""
    pairs = []
    for word in words:
        name, sep, size = word.partition("=")
        if not sep or not name:
            parser.error(f"dims are name=size words like tp=4, got {word!r}")
        try:
            pairs.append((name, parse_int(size, f"size of {name!r}")))
        except LayoutError:
            parser.error(f"size of {name!r} must be an integer in digits 0-9, got {size!r}")
        hint = "" if any_names or name in USUAL_NAMES else did_you_mean(name, USUAL_NAMES, ": ")
        if hint:
            parser.error(f"unknown dim {name!r}{hint} (pass --any-names to use it as it is)")
    if not pairs:
        parser.error("give at least one dim, e.g. pp=2 dp=2 tp=4")
    return pairs


def check_order(parser: argparse.ArgumentParser, order: str) -> None:
    """``--order``: Megatron's tokens only, fastest first."""
    if not order.strip():
        parser.error("--order is empty; give Megatron's tokens fastest first, e.g. tp-cp-ep-dp-pp")
    for token in order.lower().split("-"):
        if token not in ORDER_TOKENS:
            close = difflib.get_close_matches(token, ORDER_TOKENS, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            parser.error(
                f"--order token {token!r} is not one of Megatron's ({', '.join(ORDER_TOKENS)}); {hint}"
                "without --order, any dim names may be used"
            )


def key_values(
    parser: argparse.ArgumentParser, option: str, text: str | None, example: str
) -> dict[str, str]:
    """``a=x,b=y`` as a dict; each key once."""
    out: dict[str, str] = {}
    for word in (text or "").split(","):
        if not word:
            continue
        key, sep, value = word.partition("=")
        if not sep or not key or not value:
            parser.error(f"{option} takes name=value pairs like {example}, got {word!r}")
        if key in out:
            parser.error(f"{option} names {key!r} twice; give each once")
        out[key] = value
    return out
