"""Griffe extension: doctest lines in docstrings (``>>> ...`` and their output) shown as code.

Without it the API reference renders them as prose, where ``['a', 'b']`` reads as a link.
"""

from __future__ import annotations

from typing import Any

import griffe


def fence_doctests(text: str) -> str:
    """``text`` with each run of doctest lines (a ``>>>`` line up to the next blank line) fenced.

    >>> fence_doctests("Example:\\n>>> 1 + 1\\n2").splitlines()
    ['Example:', '```pycon', '>>> 1 + 1', '2', '```']
    """
    out: list[str] = []
    inside = ""  # the indent of the open fence, or "" when none is open
    in_fence = False
    for line in text.split("\n"):
        stripped = line.lstrip()
        indent = line[: len(line) - len(stripped)]
        if stripped.startswith("```"):
            in_fence = not in_fence
        if not in_fence and not inside and stripped.startswith(">>>"):
            out.append(f"{indent}```pycon")
            inside = indent + "\0"  # marks "open" even at indent ""
        elif inside and not stripped:
            out.append(inside[:-1] + "```")
            inside = ""
        out.append(line)
    if inside:
        out.append(inside[:-1] + "```")
    return "\n".join(out)


class DoctestFences(griffe.Extension):
    """Fence the doctest lines of every docstring griffe loads."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = fence_doctests(obj.docstring.value)
