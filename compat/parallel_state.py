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
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from meshgroups import GroupCache, MeshGroups, Strategy, init_mesh
from meshgroups.collective import collective_entry

from ._errors import (
    AlreadyInitializedError,
    MegatronAssertionError,
    MegatronRuntimeError,
    NotInitializedError,
)
from ._generated import make_function
from .megatron_api import API, FIELD_WHAT, GLOBALS, OVERRIDES
from .megatron_layout import MegatronPlan, megatron_plan

_MODULE = sys.modules[__name__]
for _name in OVERRIDES:  # megatron-core's plain-value globals, real module attributes here too
    setattr(_MODULE, _name, None)
_GLOBAL_MEMORY_BUFFER: Any = None
_GLOBAL_SYMMETRIC_MEMORY_BUFFER: Any = None

# Megatron keywords this layer does not implement, with the value that means "off".
_UNSUPPORTED: dict[str, Any] = {
    "pipeline_model_parallel_comm_backend": (None, "nccl"),
    "use_sharp": (False,),
    "nccl_communicator_config_path": (None,),
    "high_priority_stream_groups": (None, []),
}
_DEFAULT_STRATEGY: list[Strategy] = ["global"]


@dataclass
class _State:
    plan: MegatronPlan
    mesh_groups: MeshGroups
    all_gather: MeshGroups | None = None
    _cache: dict[tuple[str, bool], Any] = field(default_factory=dict)

    def group(self, name: str, gloo: bool = False) -> dist.ProcessGroup | None:
        key = (name, gloo)
        if key not in self._cache:
            self._cache[key] = self._lookup(name, gloo)
        return self._cache[key]

    def _lookup(self, name: str, gloo: bool) -> dist.ProcessGroup | None:
        if name == "dp_cp_ag":
            return None if self.all_gather is None else self.all_gather.group("dp", "cp")
        if name == "inter_dist_opt" and self.plan.sizes["n_opt"] == 1:
            return None  # megatron-core builds no inter-instance group for one instance
        if name not in self.plan.fields:
            return None
        if gloo and not self.mesh_groups.gloo_twins:
            return None
        dims = self.plan.fields[name]
        return self.mesh_groups.group(*((dims,) if isinstance(dims, str) else dims), gloo=gloo)

    def ranks(self, name: str) -> list[int] | None:
        key = (name, "ranks")
        if key not in self._cache:
            dims = self.plan.fields[name]
            self._cache[key] = self.mesh_groups.ranks(*((dims,) if isinstance(dims, str) else dims))  # type: ignore[index]
        return self._cache[key]  # type: ignore[index]


_STATE: _State | None = None


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
    plan = megatron_plan(
        dist.get_world_size(),
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
    )
    if _STATE is not None:
        raise AlreadyInitializedError(
            "model parallel groups are already initialized; call destroy_model_parallel() first"
        )
    return _Config(
        plan,
        virtual_pipeline_model_parallel_size,
        bool(options["create_gloo_process_groups"]),
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


@collective_entry("initialize_model_parallel")  # numbered first: an error on one rank reaches all
def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    pipeline_model_parallel_comm_backend: str | None = None,
    use_sharp=False,
    context_parallel_size: int = 1,
    hierarchical_context_parallel_sizes: list[int] | None = None,
    hybrid_context_parallel=False,
    expert_model_parallel_size: int = 1,
    num_distributed_optimizer_instances: int = 1,
    expert_tensor_parallel_size: int | None = None,
    nccl_communicator_config_path: str | None = None,
    distributed_timeout_minutes: int = 30,
    order: str = "tp-cp-ep-dp-pp",
    get_embedding_ranks: Callable[..., list[int]] | None = None,
    get_position_embedding_ranks: Callable[..., list[int]] | None = None,
    create_gloo_process_groups=True,
    high_priority_stream_groups: list[str] | None = None,
    sharp_enabled_group: str | None = None,
    create_all_gather_group: bool | None = False,
    *,
    strategy: Strategy | None = None,
) -> None:
    """Build megatron-core's model- and data-parallel groups on the default process group.

    megatron-core's parameters, in its positional order. The data-parallel size is
    ``world_size // (tp × pp × cp)``, the expert data-parallel size ``world_size // (expert_tp ×
    ep × pp)``. ``strategy`` (meshgroups' own, keyword-only): ``"global"`` (every rank makes
    every creation call, as megatron-core does), ``"local"`` (each rank creates only its own
    groups: per-rank start-up flat in the world size) or ``"split"``; default:
    ``set_default_strategy`` (``"global"``).

    Raises:
        AssertionError (also ``ValueError``): what megatron-core asserts (no default group,
            already initialised, optimizer instances not dividing dp×cp, ...).
        RuntimeError (also ``ValueError``): sizes that don't divide the world; vpp without pp.
        NotImplementedError: SHARP, UCC, NCCL communicator configs, high-priority streams.
    """
    global _STATE
    options = dict(locals())
    config = megatron_config(
        tensor_model_parallel_size,
        pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size,
        options,
    )
    _STATE = _build(config)


def _build(config: _Config) -> _State:
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
    )
    all_gather = None
    if config.create_all_gather_group:
        try:  # a second cache: the same ranks as dp×cp, but a communicator of its own
            all_gather = init_mesh(
                plan.layout,
                only=[("dp", "cp")],
                timeout=config.timeout,
                cache=GroupCache(),
                strategy=config.strategy,
            )
        except BaseException:
            mesh_groups.close()
            raise
    state = _State(plan, mesh_groups, all_gather)
    if config.virtual_pipeline_model_parallel_size is not None:
        _MODULE._VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK = 0  # type: ignore[attr-defined]
        _MODULE._VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = config.virtual_pipeline_model_parallel_size  # type: ignore[attr-defined]

    global _GLOBAL_MEMORY_BUFFER
    _GLOBAL_MEMORY_BUFFER = None
    _set_global_memory_buffer()
    return state


def is_initialized() -> bool:
    """Useful for code that runs with or without model parallelism."""
    return _STATE is not None


def is_unitialized() -> bool:
    """Deprecated in megatron-core (sic): ``not is_initialized()``."""
    import warnings

    warnings.warn(
        "is_unitialized is deprecated, use is_initialized instead", DeprecationWarning, stacklevel=2
    )
    return not is_initialized()


def model_parallel_is_initialized() -> bool:
    """True between ``initialize_model_parallel`` and ``destroy_model_parallel``."""
    return _STATE is not None


def destroy_model_parallel() -> None:
    """Destroy every group ``initialize_model_parallel`` created and reset the module state."""
    global _STATE, _GLOBAL_MEMORY_BUFFER, _GLOBAL_SYMMETRIC_MEMORY_BUFFER
    state, _STATE = _STATE, None
    for name in OVERRIDES:
        setattr(_MODULE, name, None)
    _GLOBAL_MEMORY_BUFFER = _GLOBAL_SYMMETRIC_MEMORY_BUFFER = None
    if state is not None and dist.is_initialized():
        if state.all_gather is not None:
            state.all_gather.close()
        state.mesh_groups.close()


def get_mesh_groups() -> MeshGroups:
    """The ``meshgroups.MeshGroups`` behind the state (``.mesh`` is the dense DeviceMesh).

    Returns:
        The ``MeshGroups``.

    Raises:
        NotInitializedError: before ``initialize_model_parallel``.
    """
    return _state("model parallel groups").mesh_groups


def held_groups() -> list[dist.ProcessGroup]:
    """Every distinct group the state holds on this rank (for ``update_pg_timeout``)."""
    if _STATE is None:
        return []
    names = [*FIELD_WHAT, *_STATE.plan.fields]
    found = [_STATE.group(n, gloo) for n in names for gloo in (False, True)]
    return list({id(g): g for g in found if g is not None}.values())


# ------------------------------------------------------------------ lookups used by every getter
def _state(what: str) -> _State:
    if _STATE is None:
        raise NotInitializedError(f"{what} is not initialized: call initialize_model_parallel first")
    return _STATE


def lookup(name: str, check_initialized: bool = True, gloo: bool = False, what: str = "") -> Any:
    """This rank's group of family ``name`` (None where Megatron has None); with
    ``check_initialized`` a missing group raises ``NotInitializedError`` (an AssertionError)."""
    what = what or FIELD_WHAT.get(name, name) + (" (gloo)" if gloo else "")
    if _STATE is None:
        if check_initialized:
            _state(what)
        return None
    group = _STATE.group(name, gloo)
    if group is None and check_initialized:
        if gloo and not _STATE.mesh_groups.gloo_twins:
            raise NotInitializedError(f"{what} is not initialized: pass create_gloo_process_groups=True")
        raise NotInitializedError(
            f"{what} is not initialized on rank {dist.get_rank()} (this rank is in no such group)"
        )
    return group


def ranks_of(name: str) -> list[int]:
    """This rank's global ranks in family ``name`` (``NotInitializedError`` if none)."""
    what = FIELD_WHAT.get(name, name)
    ranks = _state(what).ranks(name)
    if ranks is None:
        raise NotInitializedError(
            f"{what} is not initialized on rank {dist.get_rank()} (this rank is in no such group)"
        )
    return ranks


def local_rank_of(name: str) -> int:
    return ranks_of(name).index(dist.get_rank())


# ------------------------------------------------------------------ table-driven functions
for _api_name, _api in API.items():
    if _api.kind != "custom":
        setattr(_MODULE, _api_name, make_function(_api_name, _MODULE))


# ------------------------------------------------------------------ module state, Megatron's way
def __getattr__(name: str) -> Any:
    """megatron-core's module globals (``_MODEL_PARALLEL_GROUP``, ``_PIPELINE_GLOBAL_RANKS``,
    ...), read off the state: ``None`` before initialisation and after destroy."""
    if name == "_global_process_group_list":
        from .megatron_helpers import created_groups

        return None if _STATE is None else [*created_groups, *held_groups()]
    if name not in GLOBALS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    family, what = GLOBALS[name]
    if family == "hybrid":
        return {} if _STATE is None else _hybrid_groups()
    if _STATE is None:
        return None
    if family == "hcp":
        return _hcp_groups()
    if what == "ranks":
        return _STATE.ranks(family)
    return _STATE.group(family, gloo=what == "gloo")


def _hcp_groups() -> list[dist.ProcessGroup] | None:
    if _STATE is None or not _STATE.plan.hcp_levels:
        return None
    return [_STATE.group(level[0]) for level in _STATE.plan.hcp_levels]  # type: ignore[misc]


def _hybrid_groups() -> dict[int, dist.ProcessGroup]:
    assert _STATE is not None
    names = [n for n in _STATE.plan.fields if n.startswith("hybrid_dp_cp_")]
    found = {int(n.rsplit("_", 1)[1]): _STATE.group(n) for n in names}
    return {g: pg for g, pg in found.items() if pg is not None}


# The custom (argument-dependent) functions, the helpers and the memory buffers.
from .megatron_buffers import *  # noqa: E402, F403
from .megatron_buffers import _set_global_memory_buffer, _set_global_symmetric_memory_buffer  # noqa: E402, F401
from .megatron_helpers import *  # noqa: E402, F403
from .parallel_state_ranks import *  # noqa: E402, F403

__all__ = [*sorted(API), "RankGenerator", "get_mesh_groups", "set_default_strategy"]  # noqa: F405

from ._megatron_docs import complete as _complete_docs  # noqa: E402

_complete_docs(_MODULE)  # the Args/Returns/Raises sections, from the table
