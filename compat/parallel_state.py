"""megatron-core's ``parallel_state`` served by meshgroups: a drop-in with the same surface.

    import torch.distributed as dist
    from meshgroups.compat import parallel_state as ps   # was: from megatron.core import parallel_state as ps

    dist.init_process_group("nccl")
    ps.initialize_model_parallel(2, 2)                    # tp=2, pp=2: megatron-core's positional order
    ps.get_tensor_model_parallel_group()                  # same ranks as megatron-core's
    ps._DATA_PARALLEL_GROUP                               # module state megatron's own code reads
    ps.destroy_model_parallel()

Every public function of megatron-core 0.16.1's ``parallel_state`` exists here with its
signature (``megatron_api.API`` is the table; the regular getters, sizes, ranks and setters are
generated from it), its exception classes (``AssertionError`` where megatron-core asserts,
``RuntimeError`` where it raises one, each also a ``ValueError`` — see ``_errors.py``) and its
answers before initialisation. The groups are the dims of ``megatron_plan(...)``'s layout, built
by ``meshgroups.init_mesh`` (each distinct rank set once, in mesh order, after a cross-rank
check); megatron-core's module globals (``_MODEL_PARALLEL_GROUP``, ...) are read off that state
by the module's ``__getattr__``. ``meshgroups.compat.megatron.install()`` makes megatron-core
itself use this module.

Differences from megatron-core: equal rank sets share one group (``dp_cp`` is ``dp`` when cp=1,
a world-spanning group is the default group); ``create_gloo_process_groups`` twins every group,
not only the data-parallel family; assigning a group global (``ps._X = g``) does not change what
the getters return; ``destroy_model_parallel`` also resets the data-parallel rank override and
the embedding rank lists megatron-core leaves set.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from meshgroups.compat._errors import (
    AlreadyInitializedError,
    AmbiguousCallError,
    MegatronAssertionError,
    MegatronRuntimeError,
    NotInitializedError,
)
from meshgroups.compat._megatron_api import API, GLOBALS
from meshgroups.compat._megatron_state import (
    FUNCTIONS,
    SLOTS,
    MegatronState,
    hcp_groups,
    held_groups,
    hybrid_groups,
    require,
    set_override,
)
from meshgroups.compat._megatron_version import megatron_version, set_megatron_version
from meshgroups.compat._parallel_state_versions import own_communicators, read_options_16, read_options_19
from meshgroups.compat._versioned import versioned
from meshgroups.compat.megatron_layout import MegatronPlan, megatron_plan

from meshgroups import GroupCache, MeshGroups, Strategy, init_mesh
from meshgroups.mesh import collective_call, collective_entry

_MODULE = sys.modules[__name__]

# Megatron keywords this layer does not implement, with the value that means "off".
_UNSUPPORTED: dict[str, Any] = {
    "pipeline_model_parallel_comm_backend": (None, "nccl"),
    "use_sharp": (False,),
    "nccl_communicator_config_path": (None,),
    "high_priority_stream_groups": (None, []),
}
_DEFAULT_STRATEGY: list[Strategy] = ["global"]


def set_default_strategy(strategy: Strategy) -> None:
    """The group-creation strategy ``initialize_model_parallel`` uses when not given one
    (``meshgroups.compat.megatron.install(strategy=...)`` sets it)."""
    if strategy not in ("global", "local", "split"):
        raise ValueError(f"strategy={strategy!r} must be 'global', 'local' or 'split'")
    _DEFAULT_STRATEGY[0] = strategy


@dataclass(frozen=True)
class _Config:
    """Everything ``initialize_model_parallel`` decided before creating any group."""

    plan: MegatronPlan
    virtual_pipeline_model_parallel_size: int | None
    create_gloo_process_groups: bool
    create_all_gather_group: bool
    timeout: timedelta
    strategy: Strategy


def megatron_config(
    tensor_model_parallel_size: int,
    pipeline_model_parallel_size: int,
    virtual_pipeline_model_parallel_size: int | None,
    options: dict[str, Any],
) -> _Config:
    """Normalise and validate ``initialize_model_parallel``'s arguments on this rank (no
    collective), in megatron-core's order, with megatron-core's exception classes."""
    for key, allowed in _UNSUPPORTED.items():
        if options[key] not in allowed:
            raise NotImplementedError(
                f"{key}={options[key]!r} is not supported by meshgroups.compat.parallel_state (only {allowed[0]!r})"
            )
    if options["sharp_enabled_group"] is not None:
        raise MegatronAssertionError("sharp_enabled_group is only valid when use_sharp is True")
    if not dist.is_available() or not dist.is_initialized():
        raise NotInitializedError(
            "initialize_model_parallel needs an initialised default process group (torch.distributed.init_process_group)"
        )
    if virtual_pipeline_model_parallel_size is not None and pipeline_model_parallel_size <= 1:
        raise MegatronRuntimeError(
            f"pipeline-model-parallel size should be greater than 1 with interleaved schedule "
            f"(virtual_pipeline_model_parallel_size={virtual_pipeline_model_parallel_size}, "
            f"pipeline_model_parallel_size={pipeline_model_parallel_size})"
        )
    world = options["local_world_size"]
    plan = megatron_plan(
        dist.get_world_size() if world is None else world,
        tensor_model_parallel_size,
        pipeline_model_parallel_size,
        context_parallel_size=options["context_parallel_size"],
        hierarchical_context_parallel_sizes=options["hierarchical_context_parallel_sizes"],
        expert_model_parallel_size=options["expert_model_parallel_size"],
        expert_tensor_parallel_size=options["expert_tensor_parallel_size"],
        num_distributed_optimizer_instances=options["num_distributed_optimizer_instances"],
        order=options["order"],
        get_embedding_ranks=options["get_embedding_ranks"],
        get_position_embedding_ranks=options["get_position_embedding_ranks"],
        hybrid_context_parallel=options["hybrid_context_parallel"],
        gtp_remat_size=options["gtp_remat_size"],
        expert_gtp_remat_size=options["expert_gtp_remat_size"],
        rank_offset=options["rank_offset"],
    )
    if SLOTS.state is not None:
        raise AlreadyInitializedError(
            "model parallel groups are already initialized; call destroy_model_parallel() first"
        )
    # megatron-core 0.19 builds no gloo group under gtp_remat, and none for the expert
    # data-parallel groups under expert gtp_remat
    gloo = bool(options["create_gloo_process_groups"]) and plan.sizes["gtp_remat"] == 1
    return _Config(
        plan,
        virtual_pipeline_model_parallel_size,
        gloo,
        bool(options["create_all_gather_group"]),
        _timeout(options["distributed_timeout_minutes"]),
        options["strategy"] or _DEFAULT_STRATEGY[0],
    )


#: A week: what any real job waits at most (timedelta overflows far beyond it).
_MAX_TIMEOUT_MINUTES = 7 * 24 * 60


def _timeout(minutes: object) -> timedelta:
    """``distributed_timeout_minutes`` as a timedelta: a positive number of minutes, at most a week.

    >>> _timeout(30)
    datetime.timedelta(seconds=1800)
    """
    if isinstance(minutes, bool) or not isinstance(minutes, (int, float)):
        raise TypeError(f"distributed_timeout_minutes must be a number, got {minutes!r}")
    if not 0 < minutes <= _MAX_TIMEOUT_MINUTES:
        raise MegatronAssertionError(
            f"distributed_timeout_minutes={minutes!r} must be positive and at most "
            f"{_MAX_TIMEOUT_MINUTES} (a week)"
        )
    return timedelta(minutes=minutes)


#: initialize_model_parallel's arguments every rank must pass alike, compared across ranks under
#: Megatron's own names (callables are not: their repr differs between processes), so a rank
#: with another tp reads ``tensor_model_parallel_size=4`` rather than the layout built from it.
_COMPARED_OPTIONS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "context_parallel_size",
    "hierarchical_context_parallel_sizes",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "gtp_remat_size",
    "expert_gtp_remat_size",
    "num_distributed_optimizer_instances",
    "order",
    "rank_offset",
    "local_world_size",
    "create_gloo_process_groups",
    "create_all_gather_group",
)


def _initialize(options: dict[str, Any]) -> None:
    if dist.is_available() and dist.is_initialized():
        with collective_call("initialize_model_parallel") as call:  # the call this one runs in
            call.compare(**{name: options[name] for name in _COMPARED_OPTIONS if name in options})
    config = megatron_config(
        options["tensor_model_parallel_size"],
        options["pipeline_model_parallel_size"],
        options["virtual_pipeline_model_parallel_size"],
        options,
    )
    SLOTS.state = _build(config)


# megatron-core's parameters in the positional order of the caller's version (0.16:
# ``..., expert_model_parallel_size, num_distributed_optimizer_instances, ...,
# create_all_gather_group``; 0.19: ``..., expert_model_parallel_size, gtp_remat_size,
# expert_gtp_remat_size, num_distributed_optimizer_instances, ..., rank_offset,
# local_world_size``); numbered first as a collective call, so an error on one rank reaches all.
initialize_model_parallel = versioned(
    "initialize_model_parallel",
    {"0.16": read_options_16, "0.19": read_options_19},
    __name__,
    then=_initialize,
    wrap=collective_entry("initialize_model_parallel"),
)
initialize_model_parallel.__doc__ = """Build megatron-core's model- and data-parallel groups on the default process group.

    megatron-core's parameters, in the positional order of the version the caller is written
    for (``set_megatron_version``). The data-parallel size is ``world_size // (tp × pp × cp ×
    gtp_remat)``, the expert data-parallel size ``world_size // (expert_tp × ep × pp ×
    expert_gtp_remat)``. ``strategy`` (meshgroups' own, keyword-only): ``"global"`` (every rank
    makes every creation call, as megatron-core does), ``"local"`` (each rank creates only its
    own groups: per-rank start-up flat in the world size) or ``"split"``; default:
    ``set_default_strategy`` (``"global"``).

    Raises:
        AssertionError (also ``ValueError``): what megatron-core asserts (no default group,
            already initialised, optimizer instances not dividing dp×cp, gtp_remat with several
            optimizer instances, ...).
        RuntimeError (also ``ValueError``): sizes that don't divide the world; vpp without pp.
        NotImplementedError: SHARP, UCC, NCCL communicator configs, high-priority streams.
        AmbiguousCallError: the version is unknown and the call reads differently in 0.16 and 0.19.
    """


def _build(config: _Config) -> MegatronState:
    """Create the plan's groups (every rank, collectively) and the state that serves them."""
    plan = config.plan
    mesh_groups = init_mesh(
        plan.layout,
        only=plan.group_sets(),
        subsets=plan.subsets,
        gloo_twins=config.create_gloo_process_groups,
        timeout=config.timeout,
        cache=GroupCache(),
        strategy=config.strategy,
        partial=True,  # rank_offset/local_world_size: Megatron's groups over part of the world
    )
    all_gather = None
    if config.create_all_gather_group:
        try:  # the same ranks as dp×cp, but a communicator of its own
            all_gather = own_communicators(
                plan.layout, [("dp", "cp")], timeout=config.timeout, strategy=config.strategy
            )
        except BaseException:
            mesh_groups.close()
            raise
    no_gloo = frozenset({"expt_dp", "intra_expt_dp"} if plan.sizes["expt_gtp_remat"] > 1 else ())
    state = MegatronState(plan, mesh_groups, all_gather, no_gloo=no_gloo)
    if config.virtual_pipeline_model_parallel_size is not None:
        set_override("_VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK", 0)
        set_override(
            "_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE", config.virtual_pipeline_model_parallel_size
        )
    SLOTS.memory_buffer = None
    _set_global_memory_buffer()
    return state


def is_initialized() -> bool:
    """Useful for code that runs with or without model parallelism (False on a rank outside
    the ranks ``rank_offset`` / ``local_world_size`` gave the groups, as in megatron-core)."""
    return SLOTS.state is not None and SLOTS.state.group("dp") is not None


def is_unitialized() -> bool:
    """Deprecated in megatron-core (sic): ``not is_initialized()``."""
    import warnings

    warnings.warn(
        "is_unitialized is deprecated, use is_initialized instead", DeprecationWarning, stacklevel=2
    )
    return not is_initialized()


def model_parallel_is_initialized() -> bool:
    """True between ``initialize_model_parallel`` and ``destroy_model_parallel`` on a rank that
    has tensor-, pipeline- and data-parallel groups (not one outside ``rank_offset`` /
    ``local_world_size``)."""
    state = SLOTS.state
    return state is not None and all(state.group(f) is not None for f in ("tp", "pp", "dp"))


def destroy_model_parallel() -> None:
    """Destroy every group ``initialize_model_parallel`` created and reset the module state."""
    state = SLOTS.reset()
    if state is not None and dist.is_initialized():
        for extra in [state.all_gather, *state.extra]:
            if extra is not None:
                extra.close()
        state.mesh_groups.close()


def get_mesh_groups() -> MeshGroups:
    """The ``meshgroups.MeshGroups`` behind the state (``.mesh`` is the dense DeviceMesh).

    Returns:
        The ``MeshGroups``.

    Raises:
        NotInitializedError: before ``initialize_model_parallel``.
    """
    return require("model parallel groups").mesh_groups


# ------------------------------------------------------------------ table-driven functions
for _api_name, _function in FUNCTIONS.items():
    setattr(_MODULE, _api_name, _function)


# ------------------------------------------------------------------ module state, Megatron's way
def __getattr__(name: str) -> Any:
    """megatron-core's module globals (``_MODEL_PARALLEL_GROUP``, ``_PIPELINE_GLOBAL_RANKS``,
    ...), read off the state: ``None`` before initialisation and after destroy."""
    if name == "_global_process_group_list":
        from meshgroups.compat._megatron_helpers import created_groups

        return None if SLOTS.state is None else [*created_groups, *held_groups()]
    if name not in GLOBALS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    family, what = GLOBALS[name]
    if family == "hybrid":
        return hybrid_groups()
    state = SLOTS.state
    if state is None:
        return None
    if family == "hcp":
        return hcp_groups()
    if what == "ranks":
        return state.ranks(family)
    return state.group(family, gloo=what == "gloo")


# The custom (argument-dependent) functions, the helpers and the memory buffers.
from meshgroups.compat._megatron_buffers import *  # noqa: E402, F403
from meshgroups.compat._megatron_buffers import _set_global_memory_buffer, _set_global_symmetric_memory_buffer  # noqa: E402, F401
from meshgroups.compat._megatron_helpers import *  # noqa: E402, F403
from meshgroups.compat._parallel_state_ranks import *  # noqa: E402, F403
from meshgroups.compat._parallel_state_versions import *  # noqa: E402, F403  (after: per version)

__all__ = [  # noqa: F405
    *sorted(API),
    "AmbiguousCallError",
    "RankGenerator",
    "get_mesh_groups",
    "megatron_version",
    "set_default_strategy",
    "set_megatron_version",
]

from meshgroups.compat._megatron_docs import complete as _complete_docs  # noqa: E402


class _Front(types.ModuleType):
    """This module as megatron-core code sees it: its plain globals (``OVERRIDES``) and memory
    buffers read and write ``megatron_state.SLOTS``, so ``ps._MPU_TENSOR_MODEL_PARALLEL_RANK = 1``
    (how Megatron sets them) and the setters agree with every getter."""

    def __getattr__(self, name: str) -> Any:
        if name in SLOTS.overrides:
            return SLOTS.overrides[name]
        if name in _BUFFERS:
            return getattr(SLOTS, _BUFFERS[name])
        return _module_getattr(name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in SLOTS.overrides:
            SLOTS.overrides[name] = value
        elif name in _BUFFERS:
            setattr(SLOTS, _BUFFERS[name], value)
        else:
            super().__setattr__(name, value)


_BUFFERS = {
    "_GLOBAL_MEMORY_BUFFER": "memory_buffer",
    "_GLOBAL_SYMMETRIC_MEMORY_BUFFER": "symmetric_memory_buffer",
}
_module_getattr = __getattr__
del __getattr__  # served by _Front.__getattr__ (a module's own __getattr__ would shadow it)
_MODULE.__class__ = _Front

_complete_docs(_MODULE)  # the Args/Returns/Raises sections, from the table
