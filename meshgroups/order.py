"""Megatron-Core order strings (``"tp-cp-ep-dp-pp"``): the first token varies fastest.

A ``Layout`` lists dims outermost first, so an order string is read backwards. Kept apart from
``layout.py`` because it is the one place that speaks Megatron's convention.
"""

from __future__ import annotations

from collections.abc import Mapping

from .checks import check_name, check_size
from .errors import LayoutError


def parse_order(order: str, sizes: Mapping[str, object]) -> list[tuple[str, int]]:
    """``(name, size)`` pairs, outermost first, for ``Layout.from_order``.

    Rules (each broken one is a ``LayoutError`` naming the token):
    every token needs a size; no token repeats; a size given for a dim missing from ``order``
    must be 1, and such a dim is added as the outermost (Megatron appends it to the order).
    """
    if not isinstance(order, str):
        raise TypeError(f"order must be a str like 'tp-cp-ep-dp-pp', got {order!r}")
    tokens = [t.strip() for t in order.lower().split("-")]
    if any(not t for t in tokens):
        raise LayoutError(f"order {order!r} has an empty token; tokens are separated by single '-'")
    seen: list[str] = []
    for token in tokens:
        check_name(token)
        if token in seen:
            raise LayoutError(f"token {token!r} appears twice in order {order!r}")
        if token not in sizes:
            given = ", ".join(sizes) or "none"
            raise LayoutError(f"token {token!r} of order {order!r} has no size; sizes were given for {given}")
        seen.append(token)
    checked = {name: check_size(name, size) for name, size in sizes.items()}
    appended = []
    for name, size in checked.items():
        if name not in tokens:
            if size != 1:
                raise LayoutError(f"{name}={size} but {name!r} is missing from order {order!r}")
            appended.append(name)
    fastest_first = tokens + appended
    return [(name, checked[name]) for name in reversed(fastest_first)]
