"""Megatron-Core order strings (``"tp-cp-ep-dp-pp"``): the first token varies fastest.

A ``Layout`` lists dims outermost first, so an order string is read backwards. Kept apart from
``layout.py`` because it is the one place that speaks Megatron's convention.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from meshgroups._checks import check_name, check_size, short_repr
from meshgroups.errors import LayoutError

if TYPE_CHECKING:
    from meshgroups.layout._core import Layout


def parse_order(order: str, sizes: Mapping[str, object]) -> list[tuple[str, int]]:
    """``(name, size)`` pairs, outermost first, for ``Layout.from_order``.

    Rules (each broken one is a ``LayoutError`` naming the token):
    every token needs a size; no token repeats; a size given for a dim missing from ``order``
    must be 1, and such a dim is added as the outermost (Megatron appends it to the order)::

        >>> parse_order("tp-dp", {"tp": 2, "dp": 4, "pp": 1})
        [('pp', 1), ('dp', 4), ('tp', 2)]
    """
    if not isinstance(order, str):
        raise TypeError(f"order must be a str like 'tp-cp-ep-dp-pp', got {short_repr(order)}")
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


#: The dim names Megatron's ``RankGenerator`` knows (an order string may use no others).
MEGATRON_TOKENS = ("tp", "cp", "ep", "dp", "pp")


def megatron_order(layout: Layout) -> tuple[str | None, str]:
    """``(order, why)``: the Megatron order string whose groups equal ``layout``'s for every dim
    (fastest first; size-1 dims last), or ``None`` and the reason there is none::

        >>> from meshgroups import Layout
        >>> megatron_order(Layout.from_strides(("pp", "dp", "tp"), (2, 4, 2), (8, 1, 4)))
        ('dp-tp-pp', 'the groups of every dim equal those of this Megatron order string')
    """
    from meshgroups.layout._core import Layout  # at call time: layout.py imports this module lazily too

    if not isinstance(layout, Layout):
        raise TypeError(f"megatron_order takes a meshgroups.Layout, got {type(layout).__name__}")
    others = [n for n in layout.names if n not in MEGATRON_TOKENS]
    if others:
        return None, (
            f"dims {', '.join(others)} are not Megatron's tokens ({', '.join(MEGATRON_TOKENS)}); "
            "an order string names only those"
        )
    if layout.views:
        return None, "the layout has views; an order string states one factorisation"
    if layout.strides is None:
        for name in layout.names:
            rows = layout.groups(name)
            steps = rows[:, 1:] - rows[:, :-1]
            if steps.size and not (steps == steps[0, 0]).all():
                first = rows[0].tolist()
                shown = str(first) if len(first) <= 8 else f"{first[:8]}…"
                return None, (
                    f"the members of dim {name} are not evenly spaced ({name} group {shown}: its factors "
                    "sit on different levels), which no order string can state"
                )
    if layout.strides is None or not layout.is_contiguous or layout.rank_offset:
        return None, "its ranks are not one evenly strided block from rank 0, which no order string can state"
    live = sorted((s, n) for n, s in zip(layout.names, layout.strides) if s)
    order = [n for _, n in live] + [n for n in reversed(layout.names) if n not in {m for _, m in live}]
    sizes = dict(zip(layout.names, layout.shape))
    candidate = Layout.from_order("-".join(order), **sizes)
    for name in layout.names:
        if candidate.strides[candidate.names.index(name)] != layout.strides[layout.names.index(name)]:  # type: ignore[index]
            return (
                None,
                f"dim {name} is not evenly strided over the ranks (its factors sit on several levels)",
            )
    return "-".join(order), "the groups of every dim equal those of this Megatron order string"
