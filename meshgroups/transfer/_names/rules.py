"""Name maps: which trainer weights each rollout weight is made of (data; JSON round-trip).

A :class:`NameMap` maps a rollout weight's name to a :class:`Rule`. A rule concatenates
*parts* along one ``axis``; a part is one or more :class:`Segment` s, each a range
``[start, stop)`` of one trainer weight along that axis. That one form says every case:

- rename / tie: ``"lm_head.weight": "model.embed_tokens.weight"`` (one trainer weight may feed
  several rollout weights);
- fusion: ``"qkv_proj": ["q_proj", "k_proj", "v_proj"]`` (q ‖ k ‖ v along axis 0, each part's
  size read from the trainer weight's shape);
- split: ``{"source": "linear_fc1", "start": 0, "stop": 4096}`` (a slice of one trainer weight);
- interleave: a part made of many segments, e.g. Megatron's ``linear_qkv`` (per query group:
  its q heads, its k head, its v head) as segments of HF's ``q_proj``, ``k_proj``, ``v_proj``.

Where the rollout shards the fused axis, ``sharding`` says how: ``"per_part"`` (vLLM's
``QKVParallelLinear`` / ``MergedColumnParallelLinear``, Megatron's GLU ``linear_fc1``: each
part is sharded on its own, and a rank's buffer is its shard of part 0, then of part 1, ...)
or ``"whole"`` (a DTensor ``Shard`` of the concatenated tensor). Rollout names the map lacks
mean the trainer weight of the same name (``NameMap``'s docstring shows one).

numpy-free and torch-free: sizes are checked when a plan is made against real shapes
(:mod:`~meshgroups.transfer._names.mapped`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from meshgroups._checks import is_int
from meshgroups.errors import LayoutError

#: How a rule's parts are sharded where the rollout shards the fused axis.
SHARDINGS = ("per_part", "whole")


@dataclass(frozen=True)
class Segment:
    """Indices ``[start, stop)`` of trainer weight ``source`` along the rule's axis
    (``stop=None``: to its end), read through an optional *view* of the source.

    Args:
        source: the trainer weight's name.
        start, stop: the range along the rule's axis, counted in the view.
        index: inside a :class:`~meshgroups.transfer.Stack` only: the entry is
            ``source[index]`` (one expert of a packed ``[E, ...]`` tensor, e.g. Transformers 5's
            ``mlp.experts.gate_up_proj``); the view drops axis 0.
        transpose: read the source (after ``index``) with its last two axes swapped, where the
            two sides store a matrix the other way round (``[H, I]`` against ``[I, H]``).

    Raises:
        TypeError / LayoutError: a non-str source, a negative start, ``stop <= start``, a
            negative index.

    >>> Segment("mlp.experts.gate_up_proj", 0, 64, index=3).to_json()
    {'source': 'mlp.experts.gate_up_proj', 'start': 0, 'stop': 64, 'index': 3}
    """

    source: str
    start: int = 0
    stop: int | None = None
    index: int | None = None
    transpose: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.source, str) or not self.source:
            raise TypeError(f"a segment's source must be a trainer weight name, got {self.source!r}")
        if not is_int(self.start) or (self.stop is not None and not is_int(self.stop)):
            raise TypeError(
                f"segment of {self.source!r}: start and stop must be ints, got {self.start!r}, {self.stop!r}"
            )
        if self.start < 0 or (self.stop is not None and self.stop <= self.start):
            raise LayoutError(
                f"segment of {self.source!r}: [{self.start}, {self.stop}) must have 0 <= start < stop"
            )
        if self.index is not None and (not is_int(self.index) or self.index < 0):
            raise LayoutError(f"segment of {self.source!r}: index={self.index!r} must be an int >= 0")
        if not isinstance(self.transpose, bool):
            raise TypeError(f"segment of {self.source!r}: transpose must be a bool, got {self.transpose!r}")

    @property
    def viewed(self) -> bool:
        """The source is read through a view (``index`` or ``transpose``)."""
        return self.index is not None or self.transpose

    @property
    def full(self) -> bool:
        """The whole source along the axis, as it is (no view)."""
        return self.start == 0 and self.stop is None and not self.viewed

    def to_json(self) -> str | list[object] | dict[str, object]:
        if self.full:
            return self.source
        if not self.viewed:
            return [self.source, self.start, self.stop]
        out: dict[str, object] = {"source": self.source, "start": self.start, "stop": self.stop}
        if self.index is not None:
            out["index"] = self.index
        if self.transpose:
            out["transpose"] = True
        return out

    @classmethod
    def of(cls, spec: object) -> Segment:
        """From ``"name"``, ``[name, start, stop]`` or ``{"source", "start", "stop", "index",
        "transpose"}``."""
        if isinstance(spec, Segment):
            return spec
        if isinstance(spec, str):
            return cls(spec)
        if isinstance(spec, (list, tuple)) and len(spec) == 3 and isinstance(spec[0], str):
            return cls(spec[0], spec[1], spec[2])
        if isinstance(spec, Mapping) and "source" in spec:
            unknown = set(spec) - {"source", "start", "stop", "index", "transpose"}
            if unknown:
                raise LayoutError(f"segment {dict(spec)!r}: unknown keys {sorted(unknown)}")
            return cls(
                spec["source"],
                spec.get("start", 0),
                spec.get("stop"),
                spec.get("index"),
                spec.get("transpose", False),
            )
        raise TypeError(
            f"a segment is 'name', [name, start, stop] or {{'source', 'start', 'stop'}}, got {spec!r}"
        )


@dataclass(frozen=True)
class Rule:
    """One rollout weight = ``parts`` concatenated along ``axis``, each part its segments
    concatenated: a rename, a tie, a fusion, a split or an interleave (``NameMap``)::

        >>> from meshgroups.transfer import Rule
        >>> fused = Rule.fuse(["q_proj", "k_proj", "v_proj"])  # q ‖ k ‖ v along axis 0
        >>> fused.sources, fused.axis, fused.sharding
        (('q_proj', 'k_proj', 'v_proj'), 0, 'per_part')
        >>> Rule.of({"source": "linear_fc1", "start": 0, "stop": 4096}).to_json()  # a split
        {'axis': 0, 'sharding': 'per_part', 'parts': [['linear_fc1', 0, 4096]]}

    Args:
        parts: a tuple of parts, each a non-empty tuple of segments.
        axis: the axis the parts and segments are concatenated along (ignored by a rule of one
            whole segment: a rename).
        sharding: ``"per_part"`` (each part sharded on its own, vLLM) or ``"whole"`` (the
            concatenation sharded, DTensor); the same where the axis is not sharded.

    Raises:
        TypeError / LayoutError: empty parts, a bad axis or sharding.
    """

    parts: tuple[tuple[Segment, ...], ...]
    axis: int = 0
    sharding: str = "per_part"

    def __post_init__(self) -> None:
        if not isinstance(self.parts, tuple) or not self.parts:
            raise LayoutError(f"a rule needs at least one part, got {self.parts!r}")
        for part in self.parts:
            if not isinstance(part, tuple) or not part or not all(isinstance(s, Segment) for s in part):
                raise TypeError(f"each part of a rule is a non-empty tuple of Segment, got {part!r}")
        if not is_int(self.axis) or self.axis < 0:
            raise LayoutError(f"a rule's axis must be an int >= 0, got {self.axis!r}")
        if self.sharding not in SHARDINGS:
            raise LayoutError(f"sharding must be one of {SHARDINGS}, got {self.sharding!r}")

    @classmethod
    def rename(cls, source: str) -> Rule:
        """The whole trainer weight ``source`` (a rename, or a tie when several rules name it)."""
        return cls(((Segment(source),),))

    @classmethod
    def fuse(cls, sources: tuple[str, ...] | list[str], axis: int = 0, sharding: str = "per_part") -> Rule:
        """Whole trainer weights concatenated along ``axis``, one part each."""
        return cls(tuple((Segment(s),) for s in sources), axis, sharding)

    @property
    def is_rename(self) -> bool:
        """One whole segment: the planner moves the trainer weight as it is."""
        return len(self.parts) == 1 and len(self.parts[0]) == 1 and self.parts[0][0].full

    @property
    def segments(self) -> tuple[Segment, ...]:
        """Every segment in order along the axis."""
        return tuple(s for part in self.parts for s in part)

    @property
    def sources(self) -> tuple[str, ...]:
        """The trainer weights used, in first-use order."""
        return tuple(dict.fromkeys(s.source for s in self.segments))

    def to_json(self) -> object:
        """The shortest JSON form that reads back to this rule."""
        if self.is_rename:
            return self.parts[0][0].source
        parts = [p[0].to_json() if len(p) == 1 else [s.to_json() for s in p] for p in self.parts]
        if self.axis == 0 and self.sharding == "per_part" and all(isinstance(p, str) for p in parts):
            return parts
        return {"axis": self.axis, "sharding": self.sharding, "parts": parts}

    @classmethod
    def of(cls, spec: object) -> Rule:
        """From a JSON form: ``"name"``; a list of parts (axis 0, per part); ``{"parts": [...],
        "axis": 0, "sharding": "per_part"}``; ``{"segments": [...], ...}`` (one part); or one
        segment dict ``{"source", "start", "stop", "axis"}`` (a split). A part is a segment or a
        list of segments."""
        if isinstance(spec, Rule):
            return spec
        if isinstance(spec, str):
            return cls.rename(spec)
        if isinstance(spec, (list, tuple)):
            return cls(tuple(_part(p) for p in spec))
        if isinstance(spec, Mapping):
            axis, sharding = spec.get("axis", 0), spec.get("sharding", "per_part")
            if "source" in spec:
                seg = {k: v for k, v in spec.items() if k not in ("axis", "sharding")}
                return cls(((Segment.of(seg),),), axis, sharding)
            unknown = set(spec) - {"parts", "segments", "axis", "sharding"}
            if unknown or ("parts" in spec) == ("segments" in spec):
                raise LayoutError(
                    f"rule {dict(spec)!r}: give exactly one of 'parts' or 'segments' (and optionally "
                    "'axis', 'sharding')"
                )
            if "segments" in spec:
                return cls((_part(list(spec["segments"])),), axis, sharding)
            return cls(tuple(_part(p) for p in spec["parts"]), axis, sharding)
        raise TypeError(f"a rule is a name, a list of parts or a dict, got {spec!r}")


def _part(spec: object) -> tuple[Segment, ...]:
    if isinstance(spec, list) and not (len(spec) == 3 and isinstance(spec[0], str) and is_int(spec[1])):
        return tuple(Segment.of(s) for s in spec)
    return (Segment.of(spec),)


__all__ = ["SHARDINGS", "Rule", "Segment"]
