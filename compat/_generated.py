"""The regular rows of ``megatron_api.API`` turned into functions of ``parallel_state``.

``make_function(name, ps)`` builds megatron-core's ``name`` — a group getter
``(check_initialized=True)``, a size or rank (override first, megatron-core's fallbacks), a
source rank, or a setter ``(world_size)`` / ``(rank)`` — with megatron-core's exact signature,
reading groups through ``state.lookup`` / ``state.ranks_of`` and overrides through
``state.override`` / ``state.set_override`` (``state``: ``megatron_state``)::

    >>> make_function("get_tensor_model_parallel_group", megatron_state, "ps")   # doctest: +SKIP
    <function get_tensor_model_parallel_group at ...>
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch.distributed as dist
from meshgroups.compat._megatron_api import API, FIELD_WHAT

__all__ = ["make_function"]


def make_function(api_name: str, ps: ModuleType, module_name: str) -> Callable[..., Any]:
    """megatron-core's ``api_name`` for a ``custom``-free row of the table, bound to the state
    module ``ps``; ``module_name`` is the module it is offered from (its ``__module__``)."""
    api = API[api_name]
    name, over = api.field or "", api.override

    def override() -> Any:
        return None if over is None else ps.override(over)

    if api.kind == "group":

        def getter(check_initialized: bool = True) -> Any:
            return ps.lookup(name, check_initialized)

        fn: Callable[..., Any] = getter
    elif api.kind in ("size", "size0"):

        def fn() -> int:
            value = override()
            if value is not None:
                return value
            if api.kind == "size0" and not dist.is_initialized():
                return 0
            return len(ps.ranks_of(name))

    elif api.kind in ("rank", "rank0"):

        def fn() -> int:
            value = override()
            if value is not None:
                return value
            if api.kind == "rank0" and not dist.is_initialized():
                return 0
            return int(ps.local_rank_of(name))

    elif api.kind in ("size_or0", "rank_or0"):

        def fn() -> int:
            if not dist.is_available() or not dist.is_initialized():
                return 0
            group = ps.lookup(name, check_initialized=False)
            if group is None:
                return 0
            return len(ps.ranks_of(name)) if api.kind == "size_or0" else int(ps.local_rank_of(name))

    elif api.kind == "ranks":

        def fn(check_initialized: bool = True) -> list[int] | None:
            if ps.lookup(name, check_initialized) is None:
                return None
            return list(ps.ranks_of(name))

    elif api.kind == "src":

        def fn() -> int:
            return int(ps.ranks_of(name)[0])

    elif api.kind == "set" and over is not None and over.endswith("WORLD_SIZE"):

        def fn(world_size: int | None) -> None:
            ps.set_override(over, world_size)

    elif api.kind == "set" and over is not None:

        def fn(rank: int | None) -> None:
            ps.set_override(over, rank)

    else:
        raise ValueError(f"{api_name}: kind {api.kind!r} is written out by hand, not generated")
    fn.__name__ = fn.__qualname__ = api_name
    fn.__module__ = module_name
    fn.__doc__ = (
        f"megatron-core's ``{api_name}`` ({api.kind} of the {FIELD_WHAT.get(name, name) or 'state'})."
    )
    return fn
