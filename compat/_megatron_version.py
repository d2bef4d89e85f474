"""Which megatron-core the caller's code is written for: 0.16 or 0.19.

Some of megatron-core's arguments changed meaning between the two releases compat serves: in
0.19 ``get_data_parallel_group``'s second positional argument is ``with_gtp_remat`` (in 0.16,
``partial_data_parallel``), ``initialize_model_parallel`` gained two positional sizes in the
middle, and ``get_all_ranks`` joins six ranks instead of five. compat reads every call as the
version it is written for, taken from

1. an installed megatron-core, when it is one of the served versions (its distribution's
   version, read without importing it); else
2. the one explicit switch, ``set_megatron_version("0.16" | "0.19")`` (also offered as
   ``meshgroups.compat.parallel_state.set_megatron_version``).

With neither, the version is unknown: a call is served when both versions read it alike on the
current state (the same group, the same number), and raises ``AmbiguousCallError`` naming both
readings otherwise — never a silently different group::

    >>> megatron_version() in SERVED + (None,)   # "0.16", "0.19", or None: unknown
    True
    >>> set_megatron_version("0.17")
    Traceback (most recent call last):
    ...
    ValueError: megatron-core version '0.17' is not served by meshgroups.compat; served: 0.16, 0.19
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable

from meshgroups.compat._errors import AmbiguousCallError

__all__ = [
    "SERVED",
    "AmbiguousCallError",
    "installed_megatron_core",
    "megatron_version",
    "on_version_change",
    "set_megatron_version",
]

#: The megatron-core releases whose surface compat serves (major.minor).
SERVED: tuple[str, ...] = ("0.16", "0.19")

_explicit: list[str | None] = [None]
_installed: list[tuple[str | None, str | None] | None] = [None]  # (full version, served minor)
_listeners: list[Callable[[], None]] = []


def _minor(version: str) -> str:
    parts = version.split(".")
    return ".".join(parts[:2])


def installed_megatron_core() -> tuple[str | None, str | None]:
    """The installed megatron-core's version and the served version it maps to.

    Read from the distribution's metadata (megatron-core is not imported: ``install()`` must
    run before it is). Cached: call ``installed_megatron_core.cache_clear()`` after installing
    or removing megatron-core in a running process.

    Returns:
        ``(version, served)``: ``("0.19.1", "0.19")``, ``("0.17.1", None)`` (not served), or
        ``(None, None)`` without megatron-core.
    """
    if _installed[0] is None:
        try:
            full: str | None = importlib.metadata.version("megatron-core")
        except importlib.metadata.PackageNotFoundError:
            full = None
        served = _minor(full) if full is not None and _minor(full) in SERVED else None
        _installed[0] = (full, served)
        return full, served
    return _installed[0]


def _clear() -> None:
    _installed[0] = None
    for listener in _listeners:
        listener()


installed_megatron_core.cache_clear = _clear  # type: ignore[attr-defined]


def megatron_version() -> str | None:
    """The megatron-core version calls are read as: ``"0.16"``, ``"0.19"``, or ``None`` (unknown).

    Returns:
        The installed served version, else the one set by ``set_megatron_version``, else None.
    """
    return installed_megatron_core()[1] or _explicit[0]


def set_megatron_version(version: str | None) -> None:
    """Say which megatron-core your code is written for (when no served megatron-core is installed).

    Args:
        version: ``"0.16"`` or ``"0.19"`` (a full version such as ``"0.19.1"`` is read as its
            minor), or ``None`` to make it unknown again.

    Raises:
        ValueError: a version compat does not serve, or one that differs from the installed
            megatron-core's (which decides: megatron-core's own code calls compat with its
            meanings).
    """
    if version is not None:
        if not isinstance(version, str) or _minor(version) not in SERVED:
            raise ValueError(
                f"megatron-core version {version!r} is not served by meshgroups.compat; served: "
                f"{', '.join(SERVED)}"
            )
        version = _minor(version)
        full, served = installed_megatron_core()
        if served is not None and served != version:
            raise ValueError(
                f"set_megatron_version({version!r}) contradicts the installed megatron-core {full}: "
                f"the installed megatron-core decides (its own code calls compat with {served}'s meanings)"
            )
    _explicit[0] = version
    for listener in _listeners:
        listener()


def on_version_change(listener: Callable[[], None]) -> None:
    """Call ``listener()`` whenever the version may have changed (signatures follow it).

    Args:
        listener: a function of no arguments.
    """
    _listeners.append(listener)
