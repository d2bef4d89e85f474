"""Megatron's exception classes, joined to meshgroups' own.

megatron-core signals misuse with ``assert`` (``AssertionError``) and, for sizes that do not
divide the world, ``RuntimeError``. Megatron code and tests catch exactly those classes;
meshgroups code catches ``ValueError`` / ``LayoutError``. Each error here is both, so either
``except`` clause works, and its message names the rule that was broken::

    >>> try:
    ...     raise MegatronAssertionError("vp_stage must be passed if virtual pipeline is enabled")
    ... except AssertionError as exc:
    ...     isinstance(exc, ValueError)
    True
"""

from __future__ import annotations

from meshgroups.errors import LayoutError

__all__ = [
    "AlreadyInitializedError",
    "AmbiguousAttributeError",
    "AmbiguousCallError",
    "MegatronAssertionError",
    "MegatronRuntimeError",
    "NotInitializedError",
]


class MegatronAssertionError(LayoutError, AssertionError):
    """A configuration or argument megatron-core rejects with ``assert``."""


class MegatronRuntimeError(LayoutError, RuntimeError):
    """A configuration megatron-core rejects with ``RuntimeError`` (e.g. sizes that don't divide
    the world)."""


class NotInitializedError(RuntimeError, AssertionError):
    """A group or value asked for before ``initialize_model_parallel`` (or on a rank that is in
    no such group): megatron-core asserts; earlier meshgroups releases raised ``RuntimeError``."""


class AlreadyInitializedError(RuntimeError, AssertionError):
    """``initialize_model_parallel`` called again before ``destroy_model_parallel``."""


class AmbiguousCallError(TypeError, ValueError):
    """A call megatron-core 0.16 and 0.19 read differently, made while compat does not know which
    of them the caller is written for (no served megatron-core installed, no
    ``set_megatron_version``); the message names both readings."""


class AmbiguousAttributeError(AttributeError, AmbiguousCallError):
    """An attribute read that megatron-core 0.16 and 0.19 answer differently (an unset
    ``ProcessGroupCollection`` field: ``AttributeError`` in 0.16, ``None`` in 0.19) while the
    version is unknown; ``hasattr`` reads it as absent, as 0.16 code expects."""
