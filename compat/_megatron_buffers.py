"""megatron-core's global memory buffers, kept on ``meshgroups.compat.parallel_state``.

When megatron-core is in use (``megatron.core.utils`` imported, e.g. after
``meshgroups.compat.megatron.install()``), the buffers are megatron-core's own
``GlobalMemoryBuffer`` / ``GlobalSymmetricMemoryBuffer``; otherwise the small equivalents below
(a named, reusable scratch tensor; a symmetric buffer that never has memory), so compat does
not import megatron-core behind the user's back::

    >>> buf = GlobalMemoryBuffer()
    >>> buf.get_tensor((2, 3), torch.float32, "scratch").shape
    torch.Size([2, 3])
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from math import prod
from typing import Any

import torch
from meshgroups.compat._errors import AlreadyInitializedError, NotInitializedError
from meshgroups.compat._megatron_state import SLOTS, lookup

__all__ = [
    "destroy_global_memory_buffer",
    "destroy_global_symmetric_memory_buffer",
    "get_global_memory_buffer",
    "get_global_symmetric_memory_buffer",
]


class GlobalMemoryBuffer:
    """Named scratch tensors reused across calls (grown when a larger one is asked for)."""

    def __init__(self) -> None:
        self.buffer: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def get_tensor(
        self,
        tensor_shape: Sequence[int],
        dtype: torch.dtype,
        name: str,
        mem_alloc_context: Callable[[], Any] | None = None,
    ) -> torch.Tensor:
        """A view of shape ``tensor_shape`` on the buffer ``(name, dtype)``."""
        numel = prod(tensor_shape)
        key = (name, dtype)
        if key not in self.buffer or self.buffer[key].numel() < numel:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
            with (mem_alloc_context or nullcontext)():
                self.buffer[key] = torch.empty(numel, dtype=dtype, device=device, requires_grad=False)
        return self.buffer[key][:numel].view(*tensor_shape)


class GlobalSymmetricMemoryBuffer:
    """A symmetric-memory buffer without symmetric memory: ``maybe_get_tensor`` always answers
    "none available", which megatron-core's inference collectives treat as "fall back"."""

    def __init__(self, size_in_mb: int, process_group: Any) -> None:
        self.symm_buffer = None
        self.symm_mem_hdl = None

    def maybe_get_tensor(self, tensor_shape: Sequence[int], dtype: torch.dtype) -> dict[str, Any]:
        return {"tensor": None, "handle": None}


def _megatron_class(name: str, fallback: type) -> Any:
    utils = sys.modules.get("megatron.core.utils")
    return getattr(utils, name, fallback) if utils is not None else fallback


def _set_global_memory_buffer() -> None:
    if SLOTS.memory_buffer is not None:
        raise AlreadyInitializedError("global memory buffer is already initialized")
    SLOTS.memory_buffer = _megatron_class("GlobalMemoryBuffer", GlobalMemoryBuffer)()


def _set_global_symmetric_memory_buffer() -> None:
    if SLOTS.symmetric_memory_buffer is not None:
        raise AlreadyInitializedError("global symmetric memory buffer is already initialized")
    cls = _megatron_class("GlobalSymmetricMemoryBuffer", GlobalSymmetricMemoryBuffer)
    SLOTS.symmetric_memory_buffer = cls(size_in_mb=256, process_group=lookup("tp"))


def get_global_memory_buffer() -> Any:
    """The global ``GlobalMemoryBuffer`` (made by ``initialize_model_parallel``)."""
    if SLOTS.memory_buffer is None:
        raise NotInitializedError(
            "global memory buffer is not initialized: call initialize_model_parallel first"
        )
    return SLOTS.memory_buffer


def get_global_symmetric_memory_buffer() -> Any:
    """The global ``GlobalSymmetricMemoryBuffer`` (made by ``_set_global_symmetric_memory_buffer``)."""
    if SLOTS.symmetric_memory_buffer is None:
        raise NotInitializedError("global symmetric memory buffer is not initialized")
    return SLOTS.symmetric_memory_buffer


def destroy_global_memory_buffer() -> None:
    """Drop the global memory buffer."""
    SLOTS.memory_buffer = None


def destroy_global_symmetric_memory_buffer() -> None:
    """Drop the global symmetric memory buffer."""
    SLOTS.symmetric_memory_buffer = None
