"""vLLM's weight-transfer contract, checked against meshgroups' classes (no tests here).

Run as ``python tests/support/vllm_contract.py [WHEEL]``: with a wheel, vLLM is imported from
it (zipimport: its pure-Python ``weight_transfer`` package, nothing compiled), else the
installed vLLM. Prints one JSON object, ``{"vllm": version, "checks": {name: "ok" | error}}``,
that ``tests/engines/test_engines_vllm_contract.py`` reads.

    python tests/support/vllm_contract.py .venv-vllm/newest/vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import sys
import traceback
from collections.abc import Callable
from types import SimpleNamespace

CHECKS: dict[str, str] = {}


def check(name: str) -> Callable[[Callable[[], None]], Callable[[], None]]:
    def wrap(fn: Callable[[], None]) -> Callable[[], None]:
        try:
            fn()
            CHECKS[name] = "ok"
        except Exception as exc:
            CHECKS[name] = f"{type(exc).__name__}: {exc} | {traceback.format_exc(limit=3)[-600:]}"
        return fn

    return wrap


def same_parameters(ours: Callable, base: Callable, what: str) -> None:
    """Every parameter of the base method is one of ours, same kind and name, in order."""
    want = list(inspect.signature(base).parameters.values())
    got = inspect.signature(ours).parameters
    for p in want:
        q = got.get(p.name)
        if q is None:
            raise AssertionError(f"{what}: lacks parameter {p.name!r} of vLLM's {inspect.signature(base)}")
        if p.kind != q.kind:
            raise AssertionError(f"{what}: parameter {p.name!r} is {q.kind}, vLLM's is {p.kind}")


def main() -> None:
    if len(sys.argv) > 1:
        sys.path.insert(0, os.path.abspath(sys.argv[1]))
    import torch
    import vllm
    from vllm.distributed.weight_transfer import base, factory

    from meshgroups.engines.vllm import _api as api
    from meshgroups.engines.vllm import _plugin as plugin
    from meshgroups.engines.vllm._clients import HTTPClient, LLMClient
    from meshgroups.engines.vllm._trainer_engine import MeshgroupsTrainerEngine, MeshgroupsTrainerInitInfo
    from meshgroups.engines.vllm._worker import (
        MeshgroupsInitInfo,
        MeshgroupsUpdateInfo,
        MeshgroupsWeightTransferEngine,
    )

    Engine = MeshgroupsWeightTransferEngine

    @check("the adapter imports the vLLM under test")
    def _() -> None:
        assert api.WeightTransferEngine is base.WeightTransferEngine, api.WeightTransferEngine
        assert base.__file__.startswith(os.path.dirname(vllm.__file__)), (vllm.__file__, base.__file__)

    @check("worker engine: a WeightTransferEngine with no abstract method left")
    def _() -> None:
        assert issubclass(Engine, base.WeightTransferEngine)
        assert not inspect.isabstract(Engine), Engine.__abstractmethods__

    @check("worker engine: every method of vLLM's base, with its parameters")
    def _() -> None:
        for name, fn in inspect.getmembers(base.WeightTransferEngine, inspect.isfunction):
            if not name.startswith("_") or name == "__init__":
                same_parameters(getattr(Engine, name), fn, f"MeshgroupsWeightTransferEngine.{name}")

    @check("worker engine: init/update info types, parsed from dicts")
    def _() -> None:
        assert (
            issubclass(Engine.init_info_cls, base.WeightTransferInitInfo)
            and Engine.init_info_cls is MeshgroupsInitInfo
        )
        assert issubclass(Engine.update_info_cls, base.WeightTransferUpdateInfo)
        assert Engine.update_info_cls is MeshgroupsUpdateInfo
        assert {f.name for f in dataclasses.fields(MeshgroupsInitInfo)} == {
            "address",
            "trainer_size",
            "timeout",
        }

    model = torch.nn.Linear(2, 2)
    parallel = SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_size=1)
    vllm_config = SimpleNamespace(parallel_config=parallel, model_config=SimpleNamespace(dtype=torch.float32))
    engine = Engine(SimpleNamespace(backend="meshgroups"), vllm_config, torch.device("cpu"), model)

    @check("worker engine: constructed as vLLM constructs it; parse_init_info / parse_update_info")
    def _() -> None:
        info = engine.parse_init_info({"address": "127.0.0.1:1", "trainer_size": 4})
        assert info.trainer_size == 4 and info.timeout == 300.0
        assert engine.parse_update_info({"version": 3}).version == 3
        assert engine.parse_update_info({}).version is None
        try:
            engine.parse_init_info({"nope": 1})
        except ValueError:
            pass
        else:
            raise AssertionError("a bad init_info dict is not refused")

    @check("worker engine: set_weight_update_target / reset_weight_update_target / drain_pending")
    def _() -> None:
        draft = torch.nn.Linear(2, 2)
        engine.set_weight_update_target(draft, "draft-config")
        assert engine.model is draft and engine.model_config == "draft-config"
        engine.reset_weight_update_target()
        assert engine.model is model
        assert engine.drain_pending() is None
        assert isinstance(engine.supports_draft_weight_update, bool)
        assert engine.defers_processing is False

    @check("worker engine: an update without init returns (recorded), never raises into vLLM's RPC")
    def _() -> None:
        engine.start_weight_update()
        engine.update_weights({"version": 1})
        assert engine.refused and "not initialised" in engine.refused, engine.refused
        engine.finish_weight_update()
        assert engine.version == 0
        engine.shutdown()

    @check("trainer engine: a TrainerWeightTransferEngine with no abstract method left")
    def _() -> None:
        assert issubclass(MeshgroupsTrainerEngine, base.TrainerWeightTransferEngine)
        assert not inspect.isabstract(MeshgroupsTrainerEngine), MeshgroupsTrainerEngine.__abstractmethods__
        for name in ("trainer_init", "send_weights", "shutdown", "__init__"):
            ours = getattr(MeshgroupsTrainerEngine, name)
            same_parameters(
                ours, getattr(base.TrainerWeightTransferEngine, name), f"MeshgroupsTrainerEngine.{name}"
            )

    @check("trainer engine: its init info is vLLM's TrainerInitInfo (backend, keyword-only rank)")
    def _() -> None:
        assert issubclass(MeshgroupsTrainerInitInfo, base.TrainerInitInfo)
        assert MeshgroupsTrainerInitInfo.backend == plugin.BACKEND
        from meshgroups import Layout

        info = MeshgroupsTrainerInitInfo(Layout(tp=2), engine_size=2, rank=1)
        assert info.rank == 1 and not info.is_sender
        engine2 = MeshgroupsTrainerEngine(client=LLMClient(None), source=None, is_sender=False, rank=1)
        assert engine2.rank == 1 and not engine2.is_sender

    @check("clients: vLLM's VLLMWeightSyncClient protocol, finish_weight_update(weight_version)")
    def _() -> None:
        for client in (LLMClient(None), HTTPClient("http://127.0.0.1:1")):
            assert isinstance(client, base.VLLMWeightSyncClient), client
            for name in (
                "init_weight_transfer_engine",
                "start_weight_update",
                "update_weights",
                "finish_weight_update",
            ):
                same_parameters(
                    getattr(client, name), getattr(base.VLLMWeightSyncClient, name).__get__(client), name
                )
        assert inspect.signature(LLMClient.finish_weight_update).parameters["weight_version"].default is None

    @check("factories: the plugin registers the worker and trainer engines")
    def _() -> None:
        plugin.register()
        plugin.register()  # idempotent
        assert factory.WeightTransferEngineFactory._registry[plugin.BACKEND]() is Engine
        trainers = getattr(factory, "WeightTransferTrainerFactory", None)
        assert trainers is not None and trainers._registry[plugin.BACKEND]() is MeshgroupsTrainerEngine

    @check("WeightSource: ModuleSource read through the adapter (metadata, full tensors, module)")
    def _() -> None:
        source = base.ModuleSource(model)
        meta = api.source_metadata(source)
        assert [m.name for m in meta] == ["weight", "bias"] and tuple(meta[0].shape) == (2, 2)
        assert api.source_module(source) is model
        assert [n for n, _ in api.source_full(source)] == ["weight", "bias"]
        assert api.meta_layout(meta[0]) is None  # plain tensors: every rank

    @check("ParamMeta placements (0.33+): owners, mesh shape, Replicate / Shard through the adapter")
    def _() -> None:
        if not api.SOURCE_MODES:
            assert not hasattr(base, "Shard")
            return
        m = base.ParamMeta("w", torch.float32, (4, 8), owners=(0, 1, 2, 3), mesh_shape=(2, 2),
                           placements=(base.Replicate(), base.Shard(0)))  # fmt: skip
        assert api.meta_layout(m) == ((0, 1, 2, 3), (2, 2), (("replicate", -1), ("shard", 0)))

    print(json.dumps({"vllm": vllm.__version__, "source_modes": api.SOURCE_MODES, "checks": CHECKS}))


if __name__ == "__main__":
    main()
