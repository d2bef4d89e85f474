"""One megatron-core function whose signature or answer differs between 0.16 and 0.19.

``versioned(name, {"0.16": f16, "0.19": f19})`` is a function that calls the implementation of
the version the caller is written for (``megatron_version.megatron_version()``), so its
positional arguments mean what that version defines, and an argument that version lacks is a
``TypeError`` as in megatron-core. Its ``inspect.signature`` is that version's (0.19's while the
version is unknown). While the version is unknown, a call is bound to both signatures: one that
fits only one of them is that version's call; one that fits both runs both readings (each is a
local lookup) and returns their answer when they agree — the same group object, an equal
number — and raises ``AmbiguousCallError`` naming both readings when they do not::

    >>> f = versioned("f", {"0.16": lambda a=0, b=0: a, "0.19": lambda a=0, c=0: a + c}, __name__)
    >>> f(1)            # both read it as a=1, and answer 1
    1
    >>> f(1, b=2)       # only 0.16 has b (with the version unknown)  # doctest: +SKIP
    1
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from meshgroups.compat._errors import AmbiguousCallError
from meshgroups.compat._megatron_version import SERVED, megatron_version, on_version_change

__all__ = ["describe_outcome", "versioned"]

_NEWEST = SERVED[-1]
_VERSIONED: list[Any] = []


def _refresh() -> None:
    version = megatron_version() or _NEWEST
    for fn in _VERSIONED:
        fn.__signature__ = fn._signatures[version]


on_version_change(_refresh)


def _binding(sig: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError:
        return None
    return ", ".join(f"{k}={v!r}" for k, v in bound.arguments.items() if k != "self")


def describe_outcome(outcome: tuple[bool, Any]) -> str:
    """A reading's outcome for a message: a group's ranks, a value, or the error it raised.

    Args:
        outcome: ``(raised, value_or_exception)``.

    Returns:
        The words.
    """
    raised, value = outcome
    if raised:
        return f"raises {type(value).__name__}: {value}"
    try:
        import torch.distributed as dist

        if isinstance(value, dist.ProcessGroup):
            return f"the group of ranks {dist.get_process_group_ranks(value)}"
    except (ImportError, RuntimeError, ValueError, KeyError):
        pass
    return f"answers {value!r}"


def _same(a: tuple[bool, Any], b: tuple[bool, Any]) -> bool:
    if a[0] or b[0]:
        return a[0] and b[0] and type(a[1]) is type(b[1])
    x, y = a[1], b[1]
    if x is y:
        return True
    if isinstance(x, (int, str, float, type(None), list, tuple, dict)) and type(x) is type(y):
        return bool(x == y)
    return False


def _run(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[bool, Any]:
    try:
        return False, fn(*args, **kwargs)
    except Exception as exc:  # a reading's error is part of its answer, compared below
        return True, exc


def versioned(
    name: str,
    impls: Mapping[str, Callable[..., Any]],
    module_name: str,
    *,
    call: str | None = None,
    then: Callable[[Any], Any] | None = None,
    wrap: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None,
) -> Callable[..., Any]:
    """megatron-core's ``name``, read per version (see the module docstring).

    Args:
        name: the function's name (for messages and ``__name__``).
        impls: one implementation per served version, each with that version's exact signature
            (pure: a reading may be run twice).
        module_name: the module the function is offered from (its ``__module__``).
        call: how a call is shown in messages (default ``name``).
        then: applied once to the agreed reading's result (what has effects: e.g. building the
            groups from the options both readings agree on).
        wrap: a decorator for the dispatching function (e.g. ``collective_entry``).

    Returns:
        The dispatching function.
    """
    signatures = {v: inspect.signature(impls[v]) for v in SERVED}
    shown = call or name

    def dispatch(*args: Any, **kwargs: Any) -> Any:
        result = read(*args, **kwargs)
        return result if then is None else then(result)

    def read(*args: Any, **kwargs: Any) -> Any:
        version = megatron_version()
        if version is not None:
            try:
                signatures[version].bind(*args, **kwargs)
            except TypeError as exc:  # megatron-core's TypeError, saying which version's signature
                raise TypeError(
                    f"{shown}(): {exc} — megatron-core {version}'s signature {signatures[version]} "
                    "(the version your code is read as: meshgroups.compat.parallel_state.megatron_version())"
                ) from None
            return impls[version](*args, **kwargs)
        readings = {v: _binding(signatures[v], args, kwargs) for v in SERVED}
        fitting = [v for v in SERVED if readings[v] is not None]
        if len(fitting) == 1:
            return impls[fitting[0]](*args, **kwargs)
        if not fitting:
            impls[_NEWEST](*args, **kwargs)  # raises the TypeError Python words for 0.19
        outcomes = {v: _run(impls[v], args, kwargs) for v in SERVED}
        first, *rest = (outcomes[v] for v in SERVED)
        if all(_same(first, other) for other in rest):
            if outcomes[_NEWEST][0]:
                raise outcomes[_NEWEST][1]
            return outcomes[_NEWEST][1]
        shown_args = ", ".join(
            [*map(repr, args[1:] if _is_method(impls) else args)] + [f"{k}={v!r}" for k, v in kwargs.items()]
        )
        words = "; ".join(
            f"megatron-core {v} reads it as ({readings[v]}) and {describe_outcome(outcomes[v])}"
            for v in SERVED
        )
        raise AmbiguousCallError(
            f"{shown}({shown_args}) means different things in the megatron-core versions compat serves, "
            f"and which one your code is written for is not known: {words}. Install the megatron-core "
            "your code is written for, or call meshgroups.compat.parallel_state.set_megatron_version("
            f"{' or '.join(repr(v) for v in SERVED)}), or pass the arguments by keyword"
        )

    dispatch.__name__ = dispatch.__qualname__ = name
    dispatch.__module__ = module_name
    dispatch.__doc__ = impls[_NEWEST].__doc__
    fn = dispatch if wrap is None else wrap(dispatch)
    if then is not None:  # the signatures' return annotation is the reading's, not the call's
        signatures = {
            v: sig.replace(return_annotation=inspect.Signature.empty) for v, sig in signatures.items()
        }
    fn._signatures = signatures  # type: ignore[attr-defined]
    fn.__signature__ = signatures[megatron_version() or _NEWEST]  # type: ignore[attr-defined]
    _VERSIONED.append(fn)
    return fn


def _is_method(impls: Mapping[str, Callable[..., Any]]) -> bool:
    first = next(iter(inspect.signature(impls[_NEWEST]).parameters), "")
    return first == "self"
