"""What ``init_mesh`` will build, decided without torch: group families and the argument digests
that every rank must agree on.

A ``BuildPlan`` is pure data: the main layout, one ``GroupSpec`` per family (every dim of the layout
and its views, the flattened dim sets, the named subsets), and the options. ``BuildPlan.digests()``
gives one short digest per argument, so the cross-rank check can say *which* argument differs.
``make_plan`` makes a mesh's plan once; ``BuildPlan.more`` derives a later build's (``flatten``,
torch's ``_flatten``/``_unflatten``) from it, with the same options.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from meshgroups.errors import BackendOverrideError, MeshConfigError, torch_says
from meshgroups.layout import Layout
from meshgroups.mesh._options import DEFAULT_HEARTBEAT, DEFAULT_LEASE, DEFAULT_REPORT_EVERY

SubsetSpec = tuple[Layout, "str | Sequence[str]"]
#: A family's backend as torch's ``backend_override`` gives it: (backend name, backend options);
#: either may be ``None`` (the default). Options are opaque here (no torch import).
BackendConfig = tuple["str | None", "object | None"]
#: The longest timeout accepted (torch passes timeouts to C++ as milliseconds).
MAX_TIMEOUT = timedelta(days=7)


@dataclass(frozen=True)
class GroupSpec:
    """One family of groups: the groups of ``layout`` varying ``dims`` (in layout order).

    Attributes:
        key: the family's name (a dim tuple, or a subset's name).
        layout: the layout whose groups these are.
        dims: the dims varying within a group.
        desc: the group description torch shows (``mesh_tp``, ``mesh_dp_cp``, ``mesh_embd``).
        backend: this family's ``backend_override``, or None for the call's ``backend``.
    """

    key: Hashable
    layout: Layout
    dims: tuple[str, ...]
    #: the group description torch shows (logs, flight recorder): ``mesh_<name>`` as torch names
    #: a mesh dim's groups; flattened dims by their name (``mesh_dp_cp``), subsets by theirs.
    desc: str = ""
    #: ``backend_override`` for this family, ``None`` for the call's ``backend``
    backend: BackendConfig | None = None

    @property
    def size(self) -> int:
        return self.layout.size(*self.dims) if self.dims else 1


@dataclass(frozen=True)
class BuildPlan:
    """Everything every rank must agree on before the first group is created."""

    layout: Layout
    specs: tuple[GroupSpec, ...]
    subsets: Mapping[str, GroupSpec]
    device_type: str
    backend: str | None
    strategy: str
    gloo_twins: bool
    timeout: timedelta
    flatten: tuple[tuple[str, ...], ...] = ()
    only: tuple[tuple[str, ...], ...] | None = None
    _subset_digest: str = field(default="", repr=False)
    #: ``{family label: (backend, options)}`` as resolved from ``init_mesh(backend_override=)``
    backend_override: Mapping[str, BackendConfig] = field(default_factory=dict)
    #: whether the layout may leave ranks out (``MeshOptions.partial``); not compared
    partial: bool = False
    #: ``(heartbeat, lease, report_every)`` of the waits (``MeshOptions``); not compared: a
    #: rank's own settings (an observer never judges a rank before 2.5 of its own beats)
    liveness: tuple[float, float, float] = (DEFAULT_HEARTBEAT, DEFAULT_LEASE, DEFAULT_REPORT_EVERY)

    def digests(self) -> dict[str, str]:
        """``{argument: digest}`` in the order arguments are reported when they differ."""
        return {
            "layout": self.layout.fingerprint(),
            "flatten": _digest(self.flatten),
            "subsets": self._subset_digest,
            "only": _digest(self.only),
            "strategy": self.strategy,
            "device_type": self.device_type,
            "backend": str(self.backend),
            "backend_override": _digest(_shown_overrides(self.backend_override)),
            "gloo_twins": str(self.gloo_twins),
            "timeout": f"{self.timeout.total_seconds():g}s",
        }

    def shown(self) -> dict[str, str]:
        """``{argument: short readable value}`` for error messages (same keys as ``digests``)."""
        subsets = {name: f"{spec.layout!r} over {spec.dims}" for name, spec in self.subsets.items()}
        return {
            "layout": f"{_cut(repr(self.layout))} (fingerprint {self.layout.fingerprint()})",
            "flatten": _cut(str(list(self.flatten))),
            "subsets": _cut(str(subsets)),
            "only": _cut(str(None if self.only is None else list(self.only))),
            "strategy": repr(self.strategy),
            "device_type": repr(self.device_type),
            "backend": repr(self.backend),
            "backend_override": _cut(str(_shown_overrides(self.backend_override))),
            "gloo_twins": str(self.gloo_twins),
            "timeout": f"{self.timeout.total_seconds():g}s",
        }

    def more(
        self,
        layout: Layout,
        only: Iterable[Sequence[str]],
        labels: Mapping[Hashable, str] | None = None,
        backend_override: Mapping[int | str, BackendConfig] | None = None,
    ) -> BuildPlan:
        """The plan of a later build of exactly the families ``only`` over ``layout`` (one the
        mesh holds, or torch's rows as a layout), with this plan's options: device type,
        backend, strategy, gloo twins, timeout and liveness carry over, never re-given.
        ``labels`` name the families, ``backend_override`` (normalised) is keyed by those
        names; ``partial``: the mesh's coverage was settled when it was built.

        >>> first = make_plan(Layout(dp=2, tp=2), device_type="cpu", flatten=(), subsets=None, only=None,
        ...     backend="gloo", strategy="global", gloo_twins=False, timeout=timedelta(seconds=30))
        >>> later = first.more(first.layout, [("dp", "tp")], {("dp", "tp"): "dt"})
        >>> [spec.desc for spec in later.specs], later.backend, later.timeout.total_seconds()
        (['mesh_dt'], 'gloo', 30.0)
        """
        what = _what_to_build(layout, (), None, only, backend_override, labels)
        return dataclasses.replace(self, partial=True, **what)


def options_tag(options: object) -> str:
    """Backend options as a value (class and timeout), for digests and group-cache keys: two
    options objects with equal tags give the same groups."""
    timeout = getattr(options, "_timeout", None)
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    return (
        f"{type(options).__name__}(timeout={seconds:g}s)" if seconds is not None else type(options).__name__
    )


def _shown_overrides(overrides: Mapping[str, BackendConfig]) -> dict[str, str]:
    return {
        label: f"{backend}" + ("" if options is None else f" + {options_tag(options)}")
        for label, (backend, options) in sorted(overrides.items())
    }


def _cut(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _digest(value: object) -> str:
    return hashlib.sha256(json.dumps(value, default=str).encode()).hexdigest()[:12]


def as_timedelta(timeout: timedelta | float | None, default: timedelta) -> timedelta:
    """A positive, finite timeout of at most ``MAX_TIMEOUT``; ``None`` means ``default``."""
    if timeout is None:
        return default
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float, timedelta)):
        raise TypeError(f"timeout must be seconds (int/float) or a timedelta, got {timeout!r}")
    if isinstance(timeout, timedelta):
        value = timeout
    else:
        if timeout != timeout or not 0 < timeout <= MAX_TIMEOUT.total_seconds():  # NaN, <= 0, inf, huge
            raise MeshConfigError(
                f"timeout={timeout!r} must be a positive number of seconds up to {MAX_TIMEOUT.total_seconds():g}"
            )
        value = timedelta(seconds=timeout)
    if not timedelta(0) < value <= MAX_TIMEOUT:
        raise MeshConfigError(f"timeout={timeout!r} must be positive and at most {MAX_TIMEOUT}")
    return value


def _refuse_unordered(value: object, what: str, wanted: str) -> None:
    """Sets (and mappings) have no defined order, and their iteration order differs between
    processes (string hashing is salted per process): ranks would build in different orders."""
    if isinstance(value, (set, frozenset, Mapping)):
        raise TypeError(f"{what} takes {wanted}, not a {type(value).__name__} (no defined order): {value!r}")


def _dim_sets(value: Iterable[Sequence[str]] | None, what: str) -> tuple[tuple[str, ...], ...] | None:
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(f"{what} takes a list of dim sets like [('dp', 'cp')], got {value!r}")
    _refuse_unordered(value, what, "a list of dim sets like [('dp', 'cp')]")
    out = []
    for dims in value:
        _refuse_unordered(dims, what, "dim sets in order, like ('dp', 'cp')")
        if isinstance(dims, str):
            raise TypeError(f"flatten/only take dim sets like [('dp', 'cp')], got the string {dims!r}")
        if not isinstance(dims, Iterable):
            raise TypeError(f"{what} takes dim sets like ('dp', 'cp'), got {dims!r}")
        dims_t = tuple(dims)
        if not dims_t:
            raise MeshConfigError(
                f"{what} holds an empty dim set (); name at least one dim, e.g. ('dp', 'cp')"
            )
        out.append(dims_t)
    return tuple(out)


def make_plan(
    layout: Layout,
    *,
    device_type: str,
    flatten: Iterable[Sequence[str]],
    subsets: Mapping[str, SubsetSpec] | None,
    only: Iterable[Sequence[str]] | None,
    backend: str | None,
    strategy: str,
    gloo_twins: bool,
    timeout: timedelta,
    backend_override: Mapping[int | str, BackendConfig] | None = None,
    labels: Mapping[Hashable, str] | None = None,
    partial: bool = False,
    liveness: tuple[float, float, float] = (DEFAULT_HEARTBEAT, DEFAULT_LEASE, DEFAULT_REPORT_EVERY),
) -> BuildPlan:
    """Validate the torch-free arguments of ``init_mesh`` and list the families to build.

    ``backend_override`` (normalised to ``(backend, options)`` pairs) is keyed as torch keys it,
    by dim name or index of the main layout, and also by a view's dim, a declared flattened
    dim's name (``"dp_cp"``) or a subset's name. ``labels`` renames families (torch's
    ``_flatten(name)``), which sets their group description and override key. The options
    (``device_type`` ... ``liveness``) were checked by the caller (``mesh/_planning.py``).

    >>> plan = make_plan(Layout(dp=2, tp=2), device_type="cpu", flatten=[("dp", "tp")], subsets=None,
    ...     only=None, backend=None, strategy="global", gloo_twins=False, timeout=timedelta(seconds=60))
    >>> [spec.key for spec in plan.specs]
    [('dp',), ('tp',), ('dp', 'tp')]
    """
    return BuildPlan(
        device_type=device_type,
        backend=backend,
        strategy=strategy,
        gloo_twins=gloo_twins,
        timeout=timeout,
        partial=partial,
        liveness=liveness,
        **_what_to_build(layout, flatten, subsets, only, backend_override, labels),
    )


def _what_to_build(
    layout: Layout,
    flatten: Iterable[Sequence[str]],
    subsets: Mapping[str, SubsetSpec] | None,
    only: Iterable[Sequence[str]] | None,
    backend_override: Mapping[int | str, BackendConfig] | None,
    labels: Mapping[Hashable, str] | None,
) -> dict[str, Any]:
    """A plan's fields that say what one build builds (``make_plan``'s checks, in their order):
    the layout, its families and their overrides."""
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be a meshgroups.Layout, got {type(layout).__name__}")
    flatten_t = _dim_sets(flatten, "flatten") or ()
    only_t = _dim_sets(only, "only")
    if only_t is not None and flatten_t:
        raise MeshConfigError("give either only= (exactly these groups) or flatten= (extra groups), not both")
    if subsets is not None and not isinstance(subsets, Mapping):
        raise TypeError(
            f"subsets must map names to (Layout, dims), e.g. {{'embd': (lay.select('pp', [0, -1]), 'pp')}}; "
            f"got {type(subsets).__name__}"
        )
    specs: list[GroupSpec] = []
    if only_t is None:
        specs = [GroupSpec((d,), layout, (d,)) for d in layout.names]
        for view in layout.views.values():
            specs += [GroupSpec((d,), view, (d,)) for d in view.names if d not in layout.names]
    keys = {spec.key for spec in specs}
    for dims in only_t if only_t is not None else flatten_t:
        owner = layout.resolve(*dims)
        key = tuple(d for d in owner.names if d in dims)
        if key not in keys:
            keys.add(key)
            specs.append(GroupSpec(key, owner, key))
    subset_specs: dict[str, GroupSpec] = {}
    subset_state = []
    all_dims = set(layout.names).union(*(v.names for v in layout.views.values()))
    for name, value in (subsets or {}).items():
        if not isinstance(name, str) or not name.isidentifier() or name in all_dims:
            raise MeshConfigError(f"subset name {name!r} must be an identifier that is not a dim name")
        if not (isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], Layout)):
            raise TypeError(
                f"subset {name!r} must be (Layout, dims), e.g. (layout.select('pp', [0, -1]), 'pp')"
            )
        sub, sub_dims = value
        _refuse_unordered(sub_dims, f"subset {name!r}", "its dims in order, like ('dp', 'cp')")
        dims_t = (sub_dims,) if isinstance(sub_dims, str) else tuple(sub_dims)
        sub.resolve(*dims_t)  # validates
        spec = GroupSpec(name, sub, tuple(d for d in sub.names if d in dims_t))
        subset_specs[name] = spec
        specs.append(spec)
        subset_state.append((name, sub.fingerprint(), spec.dims))
    names = {spec.key: _label(spec.key, labels) for spec in specs}
    resolved = _resolve_overrides(layout, names, backend_override or {})
    specs = [
        GroupSpec(s.key, s.layout, s.dims, f"mesh_{names[s.key]}", resolved.get(names[s.key])) for s in specs
    ]
    subset_specs = {name: next(s for s in specs if s.key == name) for name in subset_specs}
    return {
        "layout": layout,
        "specs": tuple(specs),
        "subsets": subset_specs,
        "flatten": flatten_t,
        "only": only_t,
        "_subset_digest": _digest(subset_state),
        "backend_override": resolved,
    }


def _label(key: Hashable, labels: Mapping[Hashable, str] | None) -> str:
    if labels and key in labels:
        return labels[key]
    return "_".join(key) if isinstance(key, tuple) else str(key)


def _resolve_overrides(
    layout: Layout, names: Mapping[Hashable, str], overrides: Mapping[int | str, BackendConfig]
) -> dict[str, BackendConfig]:
    """torch's ``backend_override`` keys (dim index or name) as family labels; torch's rules:
    a dim given by name *and* index, or a key naming nothing, is an error (its ``RuntimeError``)."""
    known = set(names.values())
    for key in overrides:
        if isinstance(key, bool) or not isinstance(key, (int, str)):
            raise TypeError(f"backend_override keys are dim names or indices, got {key!r}")
    for index, dim in enumerate(layout.names):  # torch's order: a dim given twice, then bad keys
        if index in overrides and dim in overrides:
            raise BackendOverrideError(
                torch_says(
                    f"backend_override gives dim {dim!r} twice (by name and by index {index})",
                    f"Found redundant dim index {index} and name {dim} in backend_override",
                )
            )

    def names_a_family(key: int | str) -> bool:  # an index must name a dim that is built (``only=``)
        if isinstance(key, str):
            return key in known
        return 0 <= key < layout.ndim and layout.names[key] in known

    invalid = [k for k in overrides if not names_a_family(k)]

    if invalid:
        raise BackendOverrideError(
            torch_says(
                f"backend_override keys {invalid} name no dim, declared flattened dim or subset "
                f"(those are {', '.join(sorted(known))}; dim indices are 0..{layout.ndim - 1})",
                f"Found invalid keys in backend_override: got {invalid}, "
                f"expected integers in range [0, {layout.ndim}) or one of {layout.names}",
            )
        )
    return {layout.names[k] if isinstance(k, int) else k: config for k, config in overrides.items()}
