"""``MeshOptions``: how a mesh's groups are created, one frozen value shared by every caller.

``init_mesh`` takes these options as keywords or as ``options=``; ``Elastic`` keeps one value
for every mesh it rebuilds; ``rebuild`` reads them back from the old mesh
(``MeshGroups.options``); ``init_job`` builds every layout of a job and its transfer groups with
one. *What* to build (``flatten``, ``subsets``, ``only``) belongs to a layout and is not part of it.

Nothing is checked when the value is made: the collective call that uses it checks every field
on every rank alike (a bad value on one rank is an error on all of them, never a hang)::

    >>> opts = MeshOptions(strategy="local", timeout=30)
    >>> opts.replace(backend="gloo").kwargs()["backend"]
    'gloo'
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from types import MappingProxyType
from typing import Any

from meshgroups.errors import MeshConfigError

#: Seconds between two heartbeats of a rank (``MeshOptions.heartbeat``).
DEFAULT_HEARTBEAT = 1.0
#: Seconds without a heartbeat after which a rank stopped responding (``MeshOptions.lease``).
DEFAULT_LEASE = 5.0
#: Seconds between two "still waiting" lines of one wait (``MeshOptions.report_every``).
DEFAULT_REPORT_EVERY = 10.0


@dataclass(frozen=True)
class MeshOptions:
    """The ``init_mesh`` options that say how groups are created, one frozen value (``options=``
    of ``init_mesh``, ``init_job``, ``Elastic``, ``WeightSync``, ``TransferWorld``). Nothing is
    checked when it is made: the collective call that uses it checks every field on every rank.

    Args:
        device_type: ``"cpu"``, ``"cuda"``, ... (as for ``DeviceMesh``).
        backend: backend of the new groups; default: the default group's.
        timeout: bound on every wait of a call (seconds or timedelta); default: the default
            group's timeout.
        gloo_twins: also build a gloo twin of every group.
        strategy: ``"auto"`` (default), ``"global"``, ``"local"`` or ``"split"`` (``init_mesh``
            says which fits where).
        check: ``None``/``True``: the cross-rank check runs; ``False`` only on the fake backend.
        backend_override: torch's per-dim backend choice (``init_mesh``'s argument); stored
            read-only.
        partial: allow a layout over part of the world (or of the live ranks): ranks outside
            it get torch's ``GroupMember.NON_GROUP_MEMBER`` from ``group()``. Off by default, so
            a layout that leaves ranks out by mistake is refused instead of built.
        heartbeat: seconds between two heartbeats of this rank in the store (1 s: a lease of a
            few beats is then a few seconds, at one store ``add`` a second).
        lease: a rank whose heartbeat did not change for this long *stopped responding*; every
            wait then raises ``RanksGoneError`` naming it (5 s: five missed beats, which a
            loaded host does not miss in a row; at least two heartbeats). A rank that exits is
            seen at once, without the lease.
        report_every: seconds between two "still waiting for ranks ..." log lines of a wait on
            ranks that are alive but late (10 s).

    Example::

        >>> MeshOptions(strategy="local") == MeshOptions().replace(strategy="local")
        True
    """

    device_type: str = "cpu"
    backend: str | None = None
    timeout: timedelta | float | None = None
    gloo_twins: bool = False
    strategy: str = "auto"
    check: bool | None = None
    backend_override: Mapping[Any, object] | None = None
    partial: bool = False
    heartbeat: float = DEFAULT_HEARTBEAT
    lease: float = DEFAULT_LEASE
    report_every: float = DEFAULT_REPORT_EVERY

    def __post_init__(self) -> None:
        # A caller's dict must not change the value afterwards (it is compared across ranks).
        if isinstance(self.backend_override, Mapping):
            object.__setattr__(self, "backend_override", MappingProxyType(dict(self.backend_override)))

    def replace(self, **changes: Any) -> MeshOptions:
        """A copy with ``changes`` applied (``dataclasses.replace``).

        Args:
            changes: field names and their new values.

        Returns:
            The new ``MeshOptions``.

        Raises:
            TypeError: a name that is not a field.

        Example::

            >>> MeshOptions().replace(strategy="local").strategy
            'local'
        """
        return dataclasses.replace(self, **changes)

    def kwargs(self) -> dict[str, Any]:
        """The fields as ``init_mesh`` keywords (``backend_override`` as a plain dict).

        Returns:
            A new dict, one entry per field.

        Example::

            >>> sorted(MeshOptions().kwargs())[:3]
            ['backend', 'backend_override', 'check']
        """
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if out["backend_override"] is not None:
            out["backend_override"] = dict(out["backend_override"])
        return out


def check_settings(heartbeat: object, lease: object, report_every: object) -> tuple[float, float, float]:
    """The liveness options as floats, refused unless each is a positive, finite number of
    seconds and ``lease`` is at least two heartbeats.

    Raises:
        TypeError: not a number. ValueError (``MeshConfigError``): out of range.

    >>> check_settings(1, 5, 10)
    (1.0, 5.0, 10.0)
    """
    out = []
    for name, value in (("heartbeat", heartbeat), ("lease", lease), ("report_every", report_every)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a number of seconds, got {value!r}")
        if not 0 < value < float("inf"):
            raise MeshConfigError(f"{name}={value!r} must be a positive, finite number of seconds")
        out.append(float(value))
    if out[1] < 2 * out[0]:
        raise MeshConfigError(
            f"lease={lease!r} must be at least twice heartbeat={heartbeat!r}: a rank is judged to have "
            "stopped responding only after it missed at least two heartbeats"
        )
    return out[0], out[1], out[2]


def merge_options(options: object, keywords: MeshOptions) -> tuple[MeshOptions, str | None]:
    """``options=`` and the option keywords of one call, as one value, and the complaint when
    both were given (raised by the caller inside its collective call, so every rank sees it).

    Args:
        options: the ``options=`` argument (``None`` or a ``MeshOptions``).
        keywords: the value the option keywords make.

    Returns:
        ``(options, error)``: ``error`` is ``None`` or the ``TypeError`` message.

    Example::

        >>> merge_options(None, MeshOptions(strategy="local"))[0].strategy
        'local'
    """
    if options is None:
        return keywords, None
    if not isinstance(options, MeshOptions):
        return keywords, f"options must be a meshgroups.MeshOptions, got {type(options).__name__}"
    default = MeshOptions()
    if keywords != default:
        changed = [
            f.name
            for f in dataclasses.fields(keywords)
            if getattr(keywords, f.name) != getattr(default, f.name)
        ]
        return options, (
            f"give the options either as options=MeshOptions(...) or as keywords, not both "
            f"(keywords given: {', '.join(changed)})"
        )
    return options, None


__all__ = ["MeshOptions", "check_settings", "merge_options"]
