"""meshgroups.compat's Megatron surface against megatron-core 0.16.1's and 0.19.1's: signatures
(positional order, names, kinds, defaults) of every public function and class under each version,
the API table's coverage, the error classes, and the pure rank helpers — without processes.
Compared with megatron-core itself when that version is installed, else with the committed tables
tests/data/megatron_core_<version>_signatures.json."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from meshgroups.compat import hyper_comm_grid as hcg
from meshgroups.compat import parallel_state as ps
from meshgroups.compat import process_groups_config as pgc
from meshgroups.compat._errors import MegatronAssertionError, MegatronRuntimeError, NotInitializedError
from meshgroups.compat._megatron_api import API, CLASSES, GLOBALS, PGC_API, SINCE
from meshgroups.compat._megatron_version import installed_megatron_core, set_megatron_version

from meshgroups import LayoutError

from ..support.megatron_signatures import TABLES, collect, live

HAVE_MCORE = (
    importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None
)
INSTALLED = installed_megatron_core()[1]  # the served version of an installed megatron-core
COMMITTED = {v: json.loads((Path(__file__).parents[1] / "data" / t).read_text()) for v, t in TABLES.items()}


@pytest.fixture
def served(request):
    """Read calls as megatron-core ``request.param`` (skipped where another one is installed)."""
    version = request.param
    if INSTALLED not in (None, version):
        pytest.skip(f"megatron-core {INSTALLED} is installed, which decides the version")
    set_megatron_version(version)
    yield version
    set_megatron_version(None)


def reference(version: str) -> dict[str, dict[str, list[list[str]]]]:
    return live() if INSTALLED == version else COMMITTED[version]


def _without_our_keywords(theirs: list[list[str]], ours: list[list[str]]) -> list[list[str]]:
    """meshgroups may add keyword-only parameters with defaults after megatron-core's."""
    extra = ours[len(theirs) :]
    assert all(kind == "KEYWORD_ONLY" and default != "<required>" for _, kind, default in extra), extra
    return ours[: len(theirs)]


MODULES = {
    "megatron.core.parallel_state": ps,
    "megatron.core.process_groups_config": pgc,
    "megatron.core.hyper_comm_grid": hcg,
}


@pytest.mark.parametrize("served", ["0.16", "0.19"], indirect=True)
def test_every_public_signature_equals_megatron_core(served):
    compared = 0
    for module_name, theirs in reference(served).items():
        ours = collect(MODULES[module_name], list(theirs))
        for name, params in theirs.items():
            assert name in ours, f"{module_name}.{name} is missing from meshgroups.compat"
            assert _without_our_keywords(params, ours[name]) == params, (served, name)
            compared += 1
    assert compared > 90


@pytest.mark.parametrize("version", ["0.16", "0.19"])
def test_the_committed_table_is_megatron_core(version):
    if INSTALLED != version:
        pytest.skip(f"optional: megatron-core {version} installed (docs/megatron-tests.md)")
    assert live() == COMMITTED[version]


def test_the_api_table_is_the_whole_surface():
    tables = {v: t["megatron.core.parallel_state"] for v, t in COMMITTED.items()}
    functions = {v: {n for n in t if "." not in n} for v, t in tables.items()}
    assert set(API) | set(CLASSES) == functions["0.16"] | functions["0.19"]
    assert {n for n, since in SINCE.items() if since == "0.16 only"} == functions["0.16"] - functions["0.19"]
    assert {n for n, since in SINCE.items() if since == "0.19"} == functions["0.19"] - functions["0.16"]
    classes = {n for t in COMMITTED.values() for n in t["megatron.core.process_groups_config"]}
    constructors = {n for n in classes if n.endswith(("__init__", "__setattr__"))}
    assert set(PGC_API) == classes - constructors
    for name in API:
        assert callable(getattr(ps, name)) and name in ps.__all__, name


def test_module_state_before_initialisation():
    for name, (family, _) in GLOBALS.items():
        assert getattr(ps, name) == ({} if family == "hybrid" else None), name
    assert ps._global_process_group_list is None and ps._MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE is None
    with pytest.raises(AttributeError, match="_NOT_A_GLOBAL"):
        _ = ps._NOT_A_GLOBAL
    # megatron-core's answers before initialisation
    assert not ps.is_initialized() and not ps.model_parallel_is_initialized()
    with pytest.warns(DeprecationWarning):
        assert ps.is_unitialized()
    assert ps.get_virtual_pipeline_model_parallel_world_size() is None
    assert ps.get_expert_tensor_parallel_world_size() is None  # tp's override, unset
    assert ps.get_tensor_model_parallel_group(check_initialized=False) is None
    for name, api in API.items():
        if api.kind == "group":
            with pytest.raises(AssertionError, match="not initialized"):
                getattr(ps, name)()
        if api.kind in ("size", "rank", "src"):
            with pytest.raises(AssertionError):
                getattr(ps, name)()
        if api.kind in ("size0", "rank0"):  # no torch.distributed here: megatron-core answers 0
            assert getattr(ps, name)() == 0, name
    with pytest.raises(KeyError):
        ps.get_hybrid_data_context_parallel_groups(group_size=2)


def test_error_classes_are_megatron_and_meshgroups_alike():
    for cls, builtin in [
        (MegatronAssertionError, AssertionError),
        (MegatronRuntimeError, RuntimeError),
        (NotInitializedError, AssertionError),
    ]:
        assert issubclass(cls, builtin)
    assert issubclass(MegatronAssertionError, LayoutError) and issubclass(MegatronRuntimeError, ValueError)
    with pytest.raises(AssertionError, match="both > 1"):
        ps.RankGenerator(tp=1, ep=2, dp=2, pp=1, cp=2, order="tp-cp-ep-dp-pp")
    with pytest.raises(RuntimeError, match="'pp' is missing from order"):
        ps.RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="tp-dp")


ORDERS = [
    "tp-cp-ep-dp-pp",
    "tp-cp-pp-ep-dp",
    "tp-ep-dp-pp",
    "tp-pp-ep-dp",
    "tp-cp-ep-pp-dp",
    "tp-dp-pp",
    "tp-pp-dp",
]
TOKENS = [
    "tp",
    "cp",
    "dp",
    "pp",
    "tp-dp",
    "tp-pp",
    "dp-cp",
    "tp-cp",
    "tp-dp-cp",
    "tp-ep",
    "tp-ep-pp",
    "ep",
    "cp-pp",
]


def _loops(world, sizes, order, token):
    """Megatron's group enumeration written as plain loops (an independent oracle)."""
    tokens = order.split("-") + [t for t in ("tp", "pp", "dp", "ep", "cp") if t not in order.split("-")]
    shape = [sizes[t] for t in tokens]
    stride = [1]
    for s in shape:
        stride.append(stride[-1] * s)
    masked = [i for i, t in enumerate(tokens) if t in token.split("-")]
    free = [i for i in range(len(tokens)) if i not in masked]
    groups = []
    n_groups = world // eval("*".join(str(shape[i]) for i in masked) or "1")
    for g in range(n_groups):
        base, rest = 0, g
        for i in free:
            base += (rest % shape[i]) * stride[i]
            rest //= shape[i]
        row = []
        for k in range(world // n_groups):
            r, rest = base, k
            for i in masked:
                r += (rest % shape[i]) * stride[i]
                rest //= shape[i]
            row.append(r)
        groups.append(row)
    return groups


@pytest.mark.parametrize("served", ["0.16"], indirect=True)
@pytest.mark.parametrize("order", ORDERS)
def test_rank_generator_over_masks(order, served):
    checked = 0
    for tp, cp, ep, pp in [(2, 1, 1, 2), (2, 2, 1, 2), (1, 1, 2, 2), (4, 2, 1, 1), (2, 1, 4, 1)]:
        sizes_in = {"cp": cp, "ep": ep, "pp": pp}
        if any(s > 1 and t not in order for t, s in sizes_in.items()) or (ep > 1 and cp > 1):
            continue
        dp = 2
        world = tp * cp * ep * pp * dp
        sizes = {"tp": tp, "cp": cp, "ep": ep, "dp": dp, "pp": pp}
        gen = ps.RankGenerator(tp=tp, ep=ep, dp=dp, pp=pp, cp=cp, order=order, rank_offset=0)
        ours_offset = ps.RankGenerator(tp=tp, ep=ep, dp=dp, pp=pp, cp=cp, order=order, rank_offset=16)
        for token in TOKENS:
            if any(t not in gen.order.split("-") for t in token.split("-")):
                continue
            want = _loops(world, sizes, gen.order, token)
            assert gen.get_ranks(token) == want, (order, sizes, token)
            assert ours_offset.get_ranks(token) == [[r + 16 for r in row] for row in want]
            mask = gen.get_mask(gen.order, token)
            assert ps.generate_masked_orthogonal_rank_groups(world, gen.ordered_size, mask) == want
            checked += 1
    assert checked >= 13


def test_rank_generator_equals_megatron_core():
    if not HAVE_MCORE or INSTALLED is None:
        pytest.skip("optional: megatron-core 0.16.1 or 0.19 installed")
    from megatron.core import parallel_state as mcore

    for order in ORDERS:
        for tp, cp, ep, pp in [(2, 1, 1, 2), (2, 2, 1, 2), (1, 1, 2, 4)]:
            if any(s > 1 and t not in order for t, s in {"cp": cp, "ep": ep, "pp": pp}.items()):
                continue
            kw = {"tp": tp, "ep": ep, "dp": 2, "pp": pp, "cp": cp, "order": order}
            a, b = ps.RankGenerator(**kw), mcore.RankGenerator(**kw)
            assert (a.order, a.ordered_size, a.world_size) == (b.order, b.ordered_size, b.world_size)
            for token in TOKENS:
                if all(t in b.order.split("-") for t in token.split("-")):
                    assert a.get_ranks(token) == b.get_ranks(token), (kw, token)
    assert ps.default_embedding_ranks([3, 5, 7]) == mcore.default_embedding_ranks([3, 5, 7]) == [3, 7]
    assert ps.default_position_embedding_ranks([3, 5]) == mcore.default_position_embedding_ranks([3, 5])
    cfgs: dict = {}
    ps.overwrite_nccl_comm_cfgs(cfgs, "dp", ("max_ctas", 4))
    assert cfgs == {"dp": {"max_ctas": 4}} and ps.get_nccl_options("tp", cfgs) is None


def test_docstring_examples_run():
    import doctest

    import torch
    from meshgroups.compat import (
        _errors,
        _generated,
        _megatron_api,
        _megatron_buffers,
        _megatron_helpers,
        _megatron_version,
        _parallel_state_versions,
        _versioned,
        hyper_comm_grid,
        megatron_layout,
    )

    for module in (
        _errors,
        _megatron_api,
        _megatron_buffers,
        _megatron_helpers,
        _generated,
        _versioned,
        hyper_comm_grid,
        megatron_layout,
        _megatron_version,
        _parallel_state_versions,
    ):
        result = doctest.testmod(module, extraglobs={"torch": torch, "ps": ps})
        assert result.failed == 0, module.__name__
