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
- :mod:`~meshgroups.engines.vllm.trainer` — the trainer side, ``VLLMWeightSync`` (imports no
  vLLM).
- :mod:`~meshgroups.engines.vllm.protocol` — the protocol between trainer ranks and workers:
  init offers, the version preflight, commit reports; versions (vLLM-free).
- :mod:`~meshgroups.engines.vllm.clients` — ``LLMClient`` (an in-process ``LLM``) and
  ``HTTPClient`` (a ``vllm serve``) (imports no vLLM).
- :mod:`~meshgroups.engines.vllm.api` — the one adapter over vLLM's weight-transfer API,
  release by release (imports vLLM's ``weight_transfer`` package).
- :mod:`~meshgroups.engines.vllm.trainer_engine` — the trainer side as vLLM's
  ``TrainerWeightTransferEngine`` (imports vLLM).

Importing this package imports none of them::

    >>> import meshgroups.engines.vllm
    >>> meshgroups.engines.vllm.BACKEND
    'meshgroups'
"""

from __future__ import annotations

from meshgroups.engines.vllm.plugin import BACKEND

__all__ = ["BACKEND"]
