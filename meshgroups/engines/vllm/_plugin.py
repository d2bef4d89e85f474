"""vLLM's plugin entry point (``vllm.general_plugins``): registers the ``meshgroups`` backend.

vLLM loads every ``vllm.general_plugins`` entry point in each of its processes (the front end,
the engine core and every worker), so the backend's name is known where vLLM looks it up
(``WeightTransferEngineFactory`` in the workers). The class itself is imported lazily, by vLLM,
when an engine selects ``weight_transfer_config={"backend": "meshgroups"}``.

    >>> register()        # what vLLM calls; idempotent
"""

from __future__ import annotations

#: The backend's name in ``weight_transfer_config={"backend": ...}``.
BACKEND = "meshgroups"


def register() -> None:
    """Register the ``meshgroups`` weight-transfer engines with vLLM — the worker side and,
    where vLLM has a trainer factory, the trainer side (idempotent; a no-op when vLLM is not
    importable, so the entry point never breaks a process without it).

    Returns:
        None.

    >>> from meshgroups.engines.vllm import register
    >>> register()  # vLLM calls it in each of its processes; here also without vLLM: a no-op
    """
    try:
        from vllm.distributed.weight_transfer import factory
    except ImportError:
        return
    engines = factory.WeightTransferEngineFactory
    if BACKEND not in getattr(engines, "_registry", {}):
        engines.register_engine(BACKEND, "meshgroups.engines.vllm._worker", "MeshgroupsWeightTransferEngine")
    trainers = getattr(factory, "WeightTransferTrainerFactory", None)
    if trainers is not None and BACKEND not in getattr(trainers, "_registry", {}):
        trainers.register_engine(
            BACKEND, "meshgroups.engines.vllm._trainer_engine", "MeshgroupsTrainerEngine"
        )


__all__ = ["BACKEND", "register"]
