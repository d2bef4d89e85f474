"""A name map as a whole: :class:`NameMap` (rollout weight name -> its :class:`Rule` or
:class:`~meshgroups.transfer.Stack`, JSON round-trip) and :func:`read_rule` (a rule or a stack
from any of their forms). The rule forms themselves: :mod:`~meshgroups.transfer._names.rules`;
stacks: :mod:`~meshgroups.transfer._names.stacking` (a stack is made of rules, a map of both).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from meshgroups.errors import LayoutError
from meshgroups.transfer._names.rules import SHARDINGS, Rule, Segment
from meshgroups.transfer._names.stacking import Stack


def read_rule(spec: object) -> Rule | Stack:
    """A rule from any JSON form: ``{"stack": [...]}`` is a
    :class:`~meshgroups.transfer.Stack`, anything else a :class:`Rule`.

    Args:
        spec: a Rule, a Stack or a JSON form of either.

    Returns:
        The Rule or Stack.

    Raises:
        TypeError / LayoutError: a form that cannot be read.

    >>> type(read_rule({"stack": ["e0", "e1"]})).__name__
    'Stack'
    """
    if isinstance(spec, Stack) or (isinstance(spec, Mapping) and "stack" in spec):
        return Stack.of(spec)
    return Rule.of(spec)


class NameMap(Mapping[str, "Rule | Stack"]):
    """Rollout weight name -> :class:`Rule` (or :class:`~meshgroups.transfer.Stack`), as data
    with a JSON form; names it lacks map to the trainer weight of the same name. A fusion, a
    tie and a same-named weight::

        >>> from meshgroups.transfer import NameMap
        >>> m = NameMap({"qkv": ["q", "k", "v"], "head": "embed"})
        >>> m.rule("qkv").sources, m.rule("head").sources, m.rule("norm").sources
        (('q', 'k', 'v'), ('embed',), ('norm',))
        >>> NameMap.loads(m.dumps()) == m
        True

    Args:
        rules: ``{rollout name: Rule or a JSON form of one}``.

    Raises:
        TypeError / LayoutError: a rule that cannot be read, naming the rollout weight.
    """

    def __init__(self, rules: Mapping[str, object] | None = None) -> None:
        if rules is not None and not isinstance(rules, Mapping):
            raise TypeError(f"a NameMap is built from a mapping rollout name -> rule, got {rules!r}")
        self._rules: dict[str, Rule | Stack] = {}
        for name, spec in (rules or {}).items():
            if not isinstance(name, str) or not name:
                raise TypeError(f"rollout weight names must be non-empty str, got {name!r}")
            try:
                self._rules[name] = read_rule(spec)
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"name map, rollout weight {name!r}: {exc}") from None

    def __getitem__(self, name: str) -> Rule | Stack:
        return self._rules[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._rules)

    def __len__(self) -> int:
        return len(self._rules)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NameMap) and self._rules == other._rules

    __hash__ = None  # type: ignore[assignment]

    def __or__(self, other: Mapping[str, object]) -> NameMap:
        """This map with ``other``'s rules added (``other`` wins on a name in both)."""
        return NameMap({**self._rules, **NameMap.of(other)._rules})

    def __repr__(self) -> str:
        return f"NameMap({len(self)} rules)"

    def rule(self, name: str) -> Rule | Stack:
        """The rule for rollout weight ``name``: its own, or the same-named trainer weight."""
        return self._rules.get(name) or Rule.rename(name)

    @classmethod
    def of(cls, value: object) -> NameMap:
        """``value`` as a NameMap: a NameMap, a mapping of rules, or ``None`` (empty)."""
        if isinstance(value, NameMap):
            return value
        if value is None or isinstance(value, Mapping):
            return cls(value)
        raise TypeError(f"name_map must be a NameMap, a mapping rollout name -> rule, or None, got {value!r}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``{rollout name: rule's JSON form}``."""
        return {name: rule.to_json() for name, rule in self._rules.items()}

    def dumps(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def loads(cls, text: str) -> NameMap:
        """From JSON text (an object rollout name -> rule)."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise LayoutError(
                f"a name map's JSON must be an object rollout name -> rule, got {type(data).__name__}"
            )
        return cls(data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.dumps(indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> NameMap:
        """Read a JSON file written by :meth:`save` (or by hand)."""
        return cls.loads(Path(path).read_text())


__all__ = ["SHARDINGS", "NameMap", "Rule", "Segment", "read_rule"]
