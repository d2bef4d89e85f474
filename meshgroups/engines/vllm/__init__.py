"""The vLLM backend of weight sync: ``weight_transfer_config={"backend": "meshgroups"}``.

- :mod:`~meshgroups.engines.vllm.plugin` — ``register()``, vLLM's ``vllm.general_plugins``
  entry point (imports vLLM only when called).
- :mod:`~meshgroups.engines.vllm.destination` — a worker's parameters as global weights and a
  name map, checked against a family map (vLLM-free).
- :mod:`~meshgroups.engines.vllm.read` — a worker's model read as data (layers, routed
  experts and their expert map) and its post-load processing run again after a commit (imports
  vLLM when called).
- :mod:`~meshgroups.engines.vllm.worker` — the worker side, a ``WeightTransferEngine``
  (imports vLLM; vLLM imports it in its workers).
- :mod:`~meshgroups.engines.vllm.trainer` — the trainer side, ``VLLMWeightSync`` and
  ``LLMClient`` (imports no vLLM).

Importing this package imports none of them::

    >>> import meshgroups.engines.vllm
    >>> meshgroups.engines.vllm.BACKEND
    'meshgroups'
"""

from __future__ import annotations

from meshgroups.engines.vllm.plugin import BACKEND

__all__ = ["BACKEND"]
