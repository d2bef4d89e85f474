"""Megatron-Core's ``ModelCommProcessGroups`` and ``GradCommProcessGroups`` on meshgroups.

Same fields and behaviour as ``megatron.core.process_groups_config``: ``__init__(**kwargs)``
sets the given fields and rejects unknown names with ``ValueError``;
``use_mpu_process_groups(required_pgs=None)`` fills them from ``meshgroups.compat.parallel_state``.
New: ``from_mesh_groups(mesh_groups)`` fills them from a ``meshgroups.MeshGroups`` without any
global state.

An unset field is simply absent: reading it raises ``AttributeError`` naming the field, and
``hasattr`` tells the truth. A field set from a rank that is in no such group (e.g. ``embd``
off the first/last pipeline stage) holds ``None``, as in Megatron.

    >>> ps.initialize_model_parallel(tensor_model_parallel_size=2)          # doctest: +SKIP
    >>> model_pgs = ModelCommProcessGroups.use_mpu_process_groups()         # doctest: +SKIP
    >>> grad_pgs = GradCommProcessGroups.use_mpu_process_groups(["dp", "dp_cp"])
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from meshgroups.compat import parallel_state
from meshgroups.compat._errors import AmbiguousAttributeError
from meshgroups.compat._megatron_state import legacy_group
from meshgroups.compat._megatron_version import megatron_version
from meshgroups.compat.megatron_layout import FIELD_DIMS

from meshgroups import MeshGroups

__all__ = [
    "GradCommProcessGroups",
    "ModelCommProcessGroups",
    "MultiModuleProcessGroupCollection",
    "ProcessGroupCollection",
    "ProcessGroupHelperMeta",
]


class ProcessGroupHelperMeta(type):
    """megatron-core's metaclass that forbids assigning ``virtual_pipeline_model_parallel_size``
    on a class directly (a setter method must be used)."""

    def __setattr__(cls, name: str, value: Any) -> None:
        if name == "virtual_pipeline_model_parallel_size":
            raise AttributeError(
                f"Cannot set '{name}' directly. Use set_virtual_pipeline_model_parallel_size() method instead."
            )
        super().__setattr__(name, value)


class _ProcessGroupFields:
    """Shared behaviour of the two dataclasses."""

    _getters: ClassVar[dict[str, Callable[[], Any]]] = {}

    def __init__(self, **kwargs: Any) -> None:
        names = {f.name for f in fields(self)}  # type: ignore[arg-type]
        for key, value in kwargs.items():
            if key not in names:
                raise ValueError(f"Unknown attribute: {key}")
            setattr(self, key, value)

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails: an unset field, or a name that is no field.
        if name in {f.name for f in fields(self)}:  # type: ignore[arg-type]
            raise AttributeError(f"{type(self).__name__}.{name} was not set")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __repr__(self) -> str:
        parts = []
        for f in fields(self):  # type: ignore[arg-type]
            if f.name in self.__dict__:
                value = self.__dict__[f.name]
                ranks = _ranks(value)
                parts.append(f"{f.name}={ranks if ranks is not None else value!r}")
        return f"{type(self).__name__}({', '.join(parts)})"

    @classmethod
    def use_mpu_process_groups(cls, required_pgs: list[str] | None = None) -> Any:
        """Use the process groups of ``meshgroups.compat.parallel_state``.

        Args:
            required_pgs: names of the fields to fill; None fills every field.
        """
        all_pgs = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        if required_pgs is None:
            required_pgs = list(all_pgs)
        invalid_pgs = [pg for pg in required_pgs if pg not in all_pgs]
        if invalid_pgs:
            raise ValueError(f"Invalid process groups requested: {invalid_pgs}")
        return cls(**{pg: cls._getters[pg]() for pg in required_pgs})

    @classmethod
    def from_mesh_groups(
        cls,
        mesh_groups: MeshGroups,
        field_dims: Mapping[str, Sequence[str] | str] | None = None,
    ) -> Any:
        """Fill the fields from ``mesh_groups`` (no global state). ``field_dims`` maps a field
        to its dims or subset name; the default is Megatron's naming (``tp``, ``dp``, ``cp``,
        ``ep``, ``expt_tp``, ``expt_dp``, ``embd``, ...). Fields whose groups were not built are
        left unset; a field named explicitly in ``field_dims`` must have been built."""
        names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        explicit = dict(field_dims or {})
        unknown = sorted(set(explicit) - names)
        if unknown:
            raise ValueError(f"Unknown attribute: {unknown[0]}")
        mapping = {name: FIELD_DIMS[name] for name in names if name in FIELD_DIMS} | explicit
        values: dict[str, Any] = {}
        for name, dims in mapping.items():
            dims_t = (dims,) if isinstance(dims, str) else tuple(dims)
            if mesh_groups.has(*dims_t) or name in explicit:
                values[name] = legacy_group(mesh_groups.group(*dims_t))  # an unknown name raises here
        if "hcp" in names and "hcp" not in explicit:
            hcp_layout = mesh_groups.layout.views.get("hcp", mesh_groups.layout)
            levels = sorted(d for d in hcp_layout.names if d.startswith("hcp_"))
            if levels:
                values["hcp"] = [legacy_group(mesh_groups.group(level)) for level in levels]
        return cls(**values)


def _ranks(group: Any) -> list[int] | None:
    """The group's global ranks, or None for anything torch has not registered (a destroyed
    group, a mock, a group of another process)."""
    if isinstance(group, dist.ProcessGroup):
        try:
            return dist.get_process_group_ranks(group)
        except (KeyError, RuntimeError, ValueError):
            return None
    return None


def _size(group: Any) -> str:
    if isinstance(group, list):
        return f"[{', '.join(_size(g) for g in group)}]"
    try:
        return str(group.size())
    except Exception:  # a destroyed or foreign group: show what it is rather than fail
        return "?"


@dataclass(init=False, repr=False, eq=False)
class ModelCommProcessGroups(_ProcessGroupFields):
    """Process groups for transformer model parallelism.

    Attributes:
        tp: Tensor parallel process group
        pp: Pipeline parallel process group
        mp: Model parallel group (tensor + pipeline)
        embd: Embedding process group
        pos_embd: Position embedding process group
        cp: Context parallel process group
        tp_cp: Tensor and context parallel group
        hcp: Hierarchical context parallel groups
        ep: Expert model parallel group
        expt_tp: Expert tensor parallel group
        tp_ep: Tensor and expert parallel group
        tp_ep_pp: Tensor, expert, and pipeline parallel group
        expt_dp: Expert data parallel group
    """

    tp: torch.distributed.ProcessGroup = field(init=False)
    pp: torch.distributed.ProcessGroup = field(init=False)
    mp: torch.distributed.ProcessGroup = field(init=False)
    embd: torch.distributed.ProcessGroup = field(init=False)
    pos_embd: torch.distributed.ProcessGroup = field(init=False)
    cp: torch.distributed.ProcessGroup = field(init=False)
    tp_cp: torch.distributed.ProcessGroup = field(init=False)
    hcp: list[torch.distributed.ProcessGroup] = field(init=False)
    ep: torch.distributed.ProcessGroup = field(init=False)
    expt_tp: torch.distributed.ProcessGroup = field(init=False)
    tp_ep: torch.distributed.ProcessGroup = field(init=False)
    tp_ep_pp: torch.distributed.ProcessGroup = field(init=False)
    expt_dp: torch.distributed.ProcessGroup = field(init=False)

    _getters: ClassVar[dict[str, Callable[[], Any]]] = {
        "tp": lambda: parallel_state.get_tensor_model_parallel_group(False),
        "pp": lambda: parallel_state.get_pipeline_model_parallel_group(False),
        "mp": lambda: parallel_state.get_model_parallel_group(False),
        "cp": lambda: parallel_state.get_context_parallel_group(False),
        "tp_cp": lambda: parallel_state.get_tensor_and_context_parallel_group(False),
        "hcp": lambda: parallel_state.get_hierarchical_context_parallel_groups(False),
        "ep": lambda: parallel_state.get_expert_model_parallel_group(False),
        "expt_tp": lambda: parallel_state.get_expert_tensor_parallel_group(False),
        "tp_ep": lambda: parallel_state.get_expert_tensor_and_model_parallel_group(False),
        "tp_ep_pp": lambda: parallel_state.get_expert_tensor_model_pipeline_parallel_group(False),
        "embd": lambda: parallel_state.get_embedding_group(False),
        "pos_embd": lambda: parallel_state.get_position_embedding_group(False),
        "expt_dp": lambda: parallel_state.get_expert_data_parallel_group(False),
    }


@dataclass(init=False, repr=False, eq=False)
class GradCommProcessGroups(_ProcessGroupFields):
    """Process groups for gradient communication in distributed training.

    Attributes:
        dp: Data parallel process group
        dp_cp: Data and context parallel group
        expt_dp: Expert data parallel group
        intra_dp_cp: Intra partial data parallel group
        intra_expt_dp: Intra partial expert data parallel group
        inter_dist_opt: Inter distributed optimizer instance group
    """

    dp: torch.distributed.ProcessGroup = field(init=False)
    dp_cp: torch.distributed.ProcessGroup = field(init=False)
    expt_dp: torch.distributed.ProcessGroup = field(init=False)
    intra_dp_cp: torch.distributed.ProcessGroup = field(init=False)
    intra_expt_dp: torch.distributed.ProcessGroup = field(init=False)
    inter_dist_opt: torch.distributed.ProcessGroup = field(init=False)

    _getters: ClassVar[dict[str, Callable[[], Any]]] = {
        "dp": lambda: parallel_state.get_data_parallel_group(),
        "dp_cp": lambda: parallel_state.get_data_parallel_group(with_context_parallel=True),
        "expt_dp": lambda: parallel_state.get_expert_data_parallel_group(False),
        "intra_dp_cp": lambda: parallel_state.get_data_parallel_group(
            with_context_parallel=True, partial_data_parallel=True
        ),
        "intra_expt_dp": lambda: parallel_state.get_expert_data_parallel_group(
            False, partial_expert_data_parallel=True
        ),
        "inter_dist_opt": lambda: parallel_state.get_inter_distributed_optimizer_instance_group(False),
    }


#: ProcessGroupCollection's fields that megatron-core 0.19 added (0.16 code never sees them set).
FIELDS_SINCE_019 = (
    "tp_ep_pp_with_egtp_remat",
    "dp_cp_gtp_remat",
    "dp_cp_ag",
    "gtp_remat",
    "expt_gtp_remat",
    "expt_dp_gtp_remat",
    "expt_dp_ag",
)


def _family(name: str, check: bool = False) -> Callable[[], Any]:
    """A field's getter: its family's group, read version-neutrally (megatron-core's getter
    with the arguments its version passes; ``check``: missing raises, as there)."""
    from meshgroups.compat._megatron_state import lookup

    return lambda: lookup(name, check)


@dataclass(init=False, repr=False, eq=False)
class ProcessGroupCollection(_ProcessGroupFields):
    """megatron-core's single collection: every model and gradient group, plus ``tp_dp_cp``
    (tensor × data × context) and ``intra_dist_opt`` (one distributed-optimizer instance);
    megatron-core 0.19's gtp_remat groups (``gtp_remat``, ``expt_gtp_remat``,
    ``dp_cp_gtp_remat``, ``expt_dp_gtp_remat``, ``tp_ep_pp_with_egtp_remat``) and all-gather
    communicators (``dp_cp_ag``, ``expt_dp_ag``). Same behaviour as the two dataclasses above
    (unknown names rejected, ``use_mpu_process_groups(required_pgs)``, ``from_mesh_groups``),
    per the caller's megatron-core version: an unset field is absent in 0.16 (``AttributeError``)
    and reads as ``None`` in 0.19; ``from_layout`` builds every field from a layout without any
    global state.

        >>> ProcessGroupCollection(tp=None)
        ProcessGroupCollection(empty)
    """

    tp: torch.distributed.ProcessGroup = field(init=False)
    pp: torch.distributed.ProcessGroup = field(init=False)
    mp: torch.distributed.ProcessGroup = field(init=False)
    embd: torch.distributed.ProcessGroup = field(init=False)
    pos_embd: torch.distributed.ProcessGroup = field(init=False)
    cp: torch.distributed.ProcessGroup = field(init=False)
    tp_cp: torch.distributed.ProcessGroup = field(init=False)
    hcp: list[torch.distributed.ProcessGroup] = field(init=False)
    ep: torch.distributed.ProcessGroup = field(init=False)
    expt_tp: torch.distributed.ProcessGroup = field(init=False)
    tp_ep: torch.distributed.ProcessGroup = field(init=False)
    tp_ep_pp: torch.distributed.ProcessGroup = field(init=False)
    tp_ep_pp_with_egtp_remat: torch.distributed.ProcessGroup = field(init=False)
    tp_dp_cp: torch.distributed.ProcessGroup = field(init=False)
    dp: torch.distributed.ProcessGroup = field(init=False)
    dp_cp: torch.distributed.ProcessGroup = field(init=False)
    dp_cp_gtp_remat: torch.distributed.ProcessGroup = field(init=False)
    dp_cp_ag: torch.distributed.ProcessGroup = field(init=False)
    gtp_remat: torch.distributed.ProcessGroup = field(init=False)
    expt_gtp_remat: torch.distributed.ProcessGroup = field(init=False)
    expt_dp: torch.distributed.ProcessGroup = field(init=False)
    expt_dp_gtp_remat: torch.distributed.ProcessGroup = field(init=False)
    expt_dp_ag: torch.distributed.ProcessGroup = field(init=False)
    intra_dp_cp: torch.distributed.ProcessGroup = field(init=False)
    intra_expt_dp: torch.distributed.ProcessGroup = field(init=False)
    inter_dist_opt: torch.distributed.ProcessGroup = field(init=False)
    intra_dist_opt: torch.distributed.ProcessGroup = field(init=False)

    def __getattr__(self, name: str) -> Any:
        # Only reached for an unset field or a name that is no field: 0.19 reads an unset field
        # as None, 0.16 as absent; with the version unknown, an error naming both.
        if name not in {f.name for f in fields(self)}:
            raise AttributeError(f"'ProcessGroupCollection' object has no attribute {name!r}")
        version = megatron_version()
        if version == "0.19":
            return None
        if version == "0.16":
            raise AttributeError(f"ProcessGroupCollection.{name} was not set")
        raise AmbiguousAttributeError(
            f"ProcessGroupCollection.{name} was not set, which megatron-core 0.16 reports as a missing "
            "attribute (hasattr is False) and 0.19 reads as None; which one your code is written for "
            "is not known: call meshgroups.compat.parallel_state.set_megatron_version('0.16' or "
            "'0.19') or install that megatron-core"
        )

    def __repr__(self) -> str:
        """megatron-core's form: ``ProcessGroupCollection(tp(2), pp(None))`` — each set field
        with its group's size (0.19: fields holding None left out, a list as ``hcp([2, 4])``) —
        or ``ProcessGroupCollection(empty)``."""
        newer = megatron_version() != "0.16"
        active = []
        for f in fields(self):
            if f.name not in self.__dict__:
                continue
            value = self.__dict__[f.name]
            if value is None and newer:
                continue
            active.append(f"{f.name}({'None' if value is None else _size(value)})")
        return f"ProcessGroupCollection({', '.join(active)})" if active else "ProcessGroupCollection(empty)"

    @classmethod
    def use_mpu_process_groups(cls, required_pgs: list[str] | None = None) -> Any:
        """Use the process groups of ``meshgroups.compat.parallel_state``.

        Args:
            required_pgs: names of the fields to fill; None fills every field (of the caller's
                megatron-core version: 0.16 has no gtp_remat or all-gather fields).
        """
        if required_pgs is None and megatron_version() == "0.16":
            required_pgs = [f.name for f in fields(cls) if f.name not in FIELDS_SINCE_019]
        return super().use_mpu_process_groups(required_pgs)

    @staticmethod
    def is_gtp_remat_active(process_group_dict: dict[str, Any]) -> bool:
        """(megatron-core 0.19) True when the ``gtp_remat_group`` or ``expt_gtp_remat_group`` of
        a ``setup_process_groups_for_*`` dictionary spans more than one rank.

        Args:
            process_group_dict: the dictionary.
        """
        groups = [process_group_dict.get("gtp_remat_group"), process_group_dict.get("expt_gtp_remat_group")]
        return any(g is not None and g.size() > 1 for g in groups)

    @staticmethod
    def setup_process_groups_for_optimizer(
        pg_collection: ProcessGroupCollection | None,
        model_chunks: list[Any],
        use_gloo_process_groups: bool = True,
    ) -> dict[str, Any]:
        """The groups megatron-core's optimizer set-up needs, from ``pg_collection`` or (None)
        from ``parallel_state``; see ``pg_setup.for_optimizer``."""
        from meshgroups.compat._pg_setup import for_optimizer

        return for_optimizer(pg_collection, model_chunks, use_gloo_process_groups)

    @staticmethod
    def setup_process_groups_for_ddp(
        pg_collection: ProcessGroupCollection | None, config: Any, ddp_config: Any
    ) -> dict[str, Any]:
        """The groups megatron-core's DDP needs, from ``pg_collection`` or (None) from
        ``parallel_state``; see ``pg_setup.for_ddp``."""
        from meshgroups.compat._pg_setup import for_ddp

        return for_ddp(pg_collection, config, ddp_config)

    @classmethod
    def from_layout(cls, layout: Any, **options: Any) -> ProcessGroupCollection:
        """Every field built from mesh sub-groups of ``layout`` (a ``megatron_plan`` or a
        ``Layout`` with Megatron's dim names), without any global state; see
        ``meshgroups.compat._pg_collection.collection_from_layout``."""
        from meshgroups.compat._pg_collection import collection_from_layout

        return collection_from_layout(layout, cls=cls, **options)

    def close(self) -> None:
        """Destroy the groups ``from_layout`` built for this collection (collective; a no-op for
        a collection filled any other way)."""
        from meshgroups.compat._pg_collection import close_collection

        close_collection(self)

    _getters: ClassVar[dict[str, Callable[[], Any]]] = {
        **ModelCommProcessGroups._getters,
        **GradCommProcessGroups._getters,
        "dp": _family("dp", check=True),
        "dp_cp": _family("dp_cp", check=True),
        "intra_dp_cp": _family("intra_dp_cp", check=True),
        "expt_dp": _family("expt_dp"),
        "intra_expt_dp": _family("intra_expt_dp"),
        "tp_ep_pp": _family("tp_ep_pp"),
        "tp_dp_cp": _family("tp_dp_cp"),
        "intra_dist_opt": _family("intra_dist_opt"),
        "tp_ep_pp_with_egtp_remat": _family("tp_ep_pp_with_egtp_remat"),
        "dp_cp_gtp_remat": _family("dp_cp_gtp_remat", check=True),
        "expt_dp_gtp_remat": _family("expt_dp_gtp_remat"),
        "gtp_remat": _family("gtp_remat"),
        "expt_gtp_remat": _family("expt_gtp_remat"),
        "dp_cp_ag": lambda: None,
        "expt_dp_ag": lambda: None,
    }


from meshgroups.compat._pg_collection import MultiModuleProcessGroupCollection  # noqa: E402
