"""Groups passed, not read: megatron-core's ``ProcessGroupCollection`` built from a layout, and
its ``MultiModuleProcessGroupCollection`` (megatron-core 0.19).

megatron-core is moving off ``parallel_state``'s globals: new code receives a
``ProcessGroupCollection``. ``collection_from_layout`` (also
``ProcessGroupCollection.from_layout``) builds every field from the mesh sub-groups of one
layout — ``megatron_plan(...)`` states megatron-core's groups as a ``meshgroups.Layout`` — through
``meshgroups.init_mesh``: each distinct rank set created once, in mesh order, after the
cross-rank check; no module state is touched, so several collections (modules of a multi-module
model, an inference copy) live side by side::

    plan = megatron_plan(8, 2, 2, gtp_remat_size=2, expert_model_parallel_size=2,
                         expert_tensor_parallel_size=1, expert_gtp_remat_size=2)
    pgs = ProcessGroupCollection.from_layout(plan, all_gather=True)   # every rank calls it
    pgs.gtp_remat, pgs.dp_cp_gtp_remat, pgs.tp_ep_pp_with_egtp_remat, pgs.dp_cp_ag
    pgs.close()                                                        # destroys what it built

``MultiModuleProcessGroupCollection.from_layouts({"encoder": enc_plan, "llm": llm_plan},
language_model_module_name="llm")`` does it per module (plans over their own ranks:
``megatron_plan(..., rank_offset=)``), sharing one group cache, and keeps the modules this rank
is in, as megatron-core's multi-module pipelines expect.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any

from meshgroups.compat._megatron_state import legacy_group
from meshgroups.compat.megatron_layout import FIELD_DIMS, MegatronPlan

from meshgroups import GroupCache, Layout, MeshGroups, Strategy, init_mesh

__all__ = ["MultiModuleProcessGroupCollection", "close_collection", "collection_from_layout"]

# ProcessGroupCollection field -> the plan family that fills it (the same name unless listed).
_FAMILY = {"hcp": None, "dp_cp_ag": None, "expt_dp_ag": None}


def _plan_fields(layout: MegatronPlan | Layout) -> tuple[Layout, dict[str, Any], dict[str, Any]]:
    """(layout, field -> dims or subset name, subsets) of a plan, or of a bare layout with
    Megatron's dim names (the fields whose dims it has)."""
    if isinstance(layout, MegatronPlan):
        return layout.layout, dict(layout.fields), dict(layout.subsets)
    if not isinstance(layout, Layout):
        raise TypeError(
            f"layout must be a meshgroups.Layout or a megatron_plan(...), got {type(layout).__name__}"
        )
    found: dict[str, Any] = {}
    for name, dims in FIELD_DIMS.items():
        if isinstance(dims, str):
            continue
        try:
            layout.resolve(*dims)
        except ValueError:
            continue
        found[name] = dims
    return layout, found, {}


def collection_from_layout(
    layout: MegatronPlan | Layout,
    *,
    cls: type | None = None,
    all_gather: bool = False,
    strategy: Strategy = "global",
    timeout: Any = None,
    cache: GroupCache | None = None,
) -> Any:
    """A ``ProcessGroupCollection`` with every field megatron-core 0.19 has, from ``layout``'s
    mesh sub-groups. Collective: every rank of the default group calls it alike.

    Args:
        layout: ``megatron_plan(...)`` (all fields), or a ``Layout`` whose dims use Megatron's
            names (``tp``, ``cp``, ``dp``, ``pp``, views with ``ep``, ``expt_tp``, ...): the fields
            it has dims for.
        cls: the collection class (default ``ProcessGroupCollection``).
        all_gather: also build ``dp_cp_ag`` / ``expt_dp_ag``: communicators of their own over the
            dp×cp and expert dp ranks (megatron-core's ``create_all_gather_groups``); else None.
        strategy: the group-creation strategy (``"global"``, ``"local"``, ``"split"``).
        timeout: the groups' timeout (seconds or timedelta; default: the default group's).
        cache: a ``GroupCache`` to share with other collections (one strategy per cache).

    Returns:
        The collection; ``close_collection(pgs)`` (or ``pgs.close()``) destroys its groups.
    """
    from meshgroups.compat.process_groups_config import ProcessGroupCollection

    cls = cls or ProcessGroupCollection
    base, field_dims, subsets = _plan_fields(layout)
    cache = cache if cache is not None else GroupCache()
    dim_sets = [tuple(d) for d in field_dims.values() if not isinstance(d, str)]
    # partial: a module's collection covers its own ranks only (rank_offset), Megatron's None elsewhere
    built = [
        init_mesh(
            base,
            only=dim_sets,
            subsets=subsets,
            strategy=strategy,
            timeout=timeout,
            cache=cache,
            partial=True,
        )
    ]
    mg = built[0]
    names = {f.name for f in fields(cls)}
    values: dict[str, Any] = {}
    for name in names:
        family = _FAMILY.get(name, name)
        if family in field_dims:
            dims = field_dims[family]
            values[name] = legacy_group(mg.group(*((dims,) if isinstance(dims, str) else dims)))
    if isinstance(layout, MegatronPlan) and layout.sizes.get("n_opt", 1) == 1:
        values["inter_dist_opt"] = None  # megatron-core builds no inter-instance group then
    if "hcp" in names:
        levels = [level for level in (layout.hcp_levels if isinstance(layout, MegatronPlan) else ())]
        values["hcp"] = [legacy_group(mg.group(*level)) for level in levels] or None
    values["dp_cp_ag"] = values["expt_dp_ag"] = None
    if all_gather:  # the same ranks as dp×cp (expert dp), communicators of their own
        from meshgroups.compat._parallel_state_versions import own_communicators

        ag = own_communicators(
            base,
            [d for d in (("dp", "cp"), ("expt_dp",)) if _resolves(base, d)],
            strategy=strategy,
            timeout=timeout,
        )
        built.append(ag)
        values["dp_cp_ag"] = legacy_group(ag.group("dp", "cp")) if _resolves(base, ("dp", "cp")) else None
        values["expt_dp_ag"] = legacy_group(ag.group("expt_dp")) if _resolves(base, ("expt_dp",)) else None
    pgs = cls(**{k: v for k, v in values.items() if k in names})
    object.__setattr__(pgs, "_meshes", built)
    return pgs


def _resolves(layout: Layout, dims: tuple[str, ...]) -> bool:
    try:
        layout.resolve(*dims)
    except ValueError:
        return False
    return True


def close_collection(pgs: Any) -> None:
    """Destroy the groups ``collection_from_layout`` built for ``pgs`` (a no-op for a collection
    filled any other way). Collective, like the build.

    Args:
        pgs: the collection.
    """
    meshes: list[MeshGroups] = pgs.__dict__.pop("_meshes", [])
    for mesh in reversed(meshes):
        mesh.close()


@dataclass
class MultiModuleProcessGroupCollection:
    """megatron-core 0.19's collection for multi-module pipelines (a rank in several modules,
    e.g. a colocated encoder and LLM): ``module_pgs`` maps module names to their
    ``ProcessGroupCollection``; ``language_model_module_name`` names the language model's
    (None when this rank holds none).

        >>> MultiModuleProcessGroupCollection({})
        Traceback (most recent call last):
        ...
        ValueError: module_pgs dict cannot be empty

    Raises:
        ValueError: empty ``module_pgs``, or a language model name that is not one of its keys.
    """

    module_pgs: dict[str, Any]
    language_model_module_name: str | None = None

    def __post_init__(self) -> None:
        self._built: list[Any] = []
        if not self.module_pgs:
            raise ValueError("module_pgs dict cannot be empty")
        name = self.language_model_module_name
        if name is not None and name not in self.module_pgs:
            raise ValueError(
                f"language_model_module_name '{name}' not found in module_pgs keys: {list(self.module_pgs.keys())}"
            )

    @classmethod
    def from_layouts(
        cls,
        layouts: Mapping[str, MegatronPlan | Layout],
        language_model_module_name: str | None = None,
        **options: Any,
    ) -> MultiModuleProcessGroupCollection:
        """One ``collection_from_layout`` per module, sharing one group cache (a rank set two
        modules share is one group), keeping the modules this rank is in. Collective: every
        rank calls it with the same ``layouts``.

        Args:
            layouts: module name -> its plan or layout (over its own ranks).
            language_model_module_name: the language model's module (dropped on ranks outside it).
            options: ``all_gather``, ``strategy``, ``timeout`` for every module.
        """
        import torch.distributed as dist

        options.setdefault("cache", GroupCache())
        rank = dist.get_rank()
        mine: dict[str, Any] = {}
        built = []
        for name, layout in layouts.items():
            pgs = collection_from_layout(layout, **options)
            built.append(pgs)  # kept for close(): closing is collective, members or not
            base = layout.layout if isinstance(layout, MegatronPlan) else layout
            if rank in base:
                mine[name] = pgs
        if language_model_module_name not in mine:
            language_model_module_name = None
        out = cls(mine, language_model_module_name)
        out._built = built
        return out

    def get_language_model_collection(self) -> Any:
        """The language model's collection.

        Raises:
            ValueError: no language model on this rank.
        """
        if self.language_model_module_name is None:
            raise ValueError("No language model specified for this collection")
        return self.module_pgs[self.language_model_module_name]

    def get_language_model_cp_size(self) -> int:
        """The language model's context-parallel size."""
        return int(self.get_language_model_collection().cp.size())

    def has_language_model(self) -> bool:
        """Whether this rank holds the language model."""
        return self.language_model_module_name is not None

    def get_module_collection(self, module_name: str) -> Any:
        """The collection of ``module_name``.

        Raises:
            ValueError: no such module on this rank.
        """
        if module_name not in self.module_pgs:
            raise ValueError(
                f"Module '{module_name}' not found in collections. Available: {list(self.module_pgs.keys())}"
            )
        return self.module_pgs[module_name]

    def __len__(self) -> int:
        return len(self.module_pgs)

    def __getitem__(self, module_name: str) -> Any:
        return self.module_pgs[module_name]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.module_pgs.values())

    def keys(self) -> Any:
        """The module names."""
        return self.module_pgs.keys()

    def values(self) -> Any:
        """The collections."""
        return self.module_pgs.values()

    def items(self) -> Any:
        """``(module name, collection)`` pairs."""
        return self.module_pgs.items()

    def close(self) -> None:
        """Destroy the groups ``from_layouts`` built (collective: every rank calls it)."""
        for pgs in getattr(self, "_built", list(self.module_pgs.values())):
            close_collection(pgs)

    def __repr__(self) -> str:
        lm = self.language_model_module_name
        shown = f", language_model_module_name='{lm}'" if lm else ""
        return f"MultiModuleProcessGroupCollection(modules=[{', '.join(self.module_pgs)}]{shown})"


MultiModuleProcessGroupCollection.__module__ = "meshgroups.compat.process_groups_config"
