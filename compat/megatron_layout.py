"""Megatron-Core's parallel groups stated as one ``meshgroups.Layout`` with views.

``megatron_plan(...)`` needs no processes: it is what ``meshgroups.compat.parallel_state`` builds, and
what tests and notebooks inspect. Every group is a dim (or flattened dim set) of a factorisation
of the world, named with Megatron's tokens:

- main (dense): ``Layout.from_order(order without "ep", tp, gtp_remat, cp, dp, pp)``, with
  megatron-core 0.19's ``gtp_remat`` token placed after ``tp`` (size 1 unless ``gtp_remat_size``);
- ``expert``: ``from_order(order, expt_tp, expt_cp=1, ep, expt_gtp_remat, expt_dp, pp)``, its
  ``gtp_remat`` placed after ``ep`` (pp checked equal);
- ``dense_opt``: ``dp×cp`` split into ``dist_opt`` instances of ``intra_dp_cp`` consecutive ranks;
- ``expert_opt``: ``expt_dp`` split into ``inter_dist_opt × intra_expt_dp``;
- ``hcp``: ``cp`` split into levels ``hcp_0`` (fastest) .. ``hcp_{k-1}``;
- ``hybrid_<g>`` (``hybrid_context_parallel``): ``dp×cp`` split into runs of ``g`` consecutive
  members, one view per power of two ``2 <= g <= dp×cp / 2`` (Megatron's hybrid DP×CP groups);
- subsets ``embd`` / ``pos_embd``: first and last / first pipeline stage (or the callbacks').
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from meshgroups.compat._errors import MegatronAssertionError, MegatronRuntimeError

from meshgroups import Layout, LayoutError
from meshgroups.layout import check_int, formula, product

RanksCallback = Callable[[list[int]], list[int]]

# Megatron field name -> the dims of its groups (or a subset name)
FIELD_DIMS: dict[str, tuple[str, ...] | str] = {
    "tp": ("tp",),
    "pp": ("pp",),
    "mp": ("pp", "tp"),
    "cp": ("cp",),
    "tp_cp": ("cp", "tp"),
    "dp": ("dp",),
    "dp_cp": ("dp", "cp"),
    "tp_dp": ("dp", "tp"),
    "tp_dp_cp": ("dp", "cp", "tp"),
    "ep": ("ep",),
    "expt_tp": ("expt_tp",),
    "tp_ep": ("ep", "expt_tp"),
    "tp_ep_pp": ("pp", "ep", "expt_tp"),
    "expt_dp": ("expt_dp",),
    "intra_dp_cp": ("intra_dp_cp",),
    "intra_expt_dp": ("intra_expt_dp",),
    "inter_dist_opt": ("inter_dist_opt",),
    "intra_dist_opt": ("pp", "intra_expt_dp", "ep", "expt_cp", "expt_tp"),
    "embd": "embd",
    "pos_embd": "pos_embd",
    # megatron-core 0.19's generalized tensor parallelism (size-1 dims when it is off, so the
    # "with gtp_remat" families are then the same rank sets, hence the same groups, as without)
    "gtp_remat": ("gtp_remat",),
    "expt_gtp_remat": ("expt_gtp_remat",),
    "dp_gtp_remat": ("dp", "gtp_remat"),
    "dp_cp_gtp_remat": ("dp", "cp", "gtp_remat"),
    "intra_dp_cp_gtp_remat": ("intra_dp_cp",),
    "expt_dp_gtp_remat": ("expt_dp", "expt_gtp_remat"),
    "intra_expt_dp_gtp_remat": ("intra_expt_dp",),
    "tp_ep_pp_with_egtp_remat": ("pp", "expt_gtp_remat", "ep", "expt_tp"),
}
# megatron-core 0.19 with gtp_remat or expert gtp_remat > 1 (one optimizer instance): the
# intra-instance "full" groups are the full groups, the optimizer instance the whole layout.
GTP_FIELDS: dict[str, tuple[str, ...]] = {
    "intra_dp_cp_gtp_remat": ("dp", "cp", "gtp_remat"),
    "intra_expt_dp_gtp_remat": ("expt_dp", "expt_gtp_remat"),
    "intra_dist_opt": ("pp", "expt_dp", "ep", "expt_gtp_remat", "expt_cp", "expt_tp"),
}
# megatron-core 0.19's tp×dp groups span gtp_remat (model parallel too); with size 1, the same.
_WITH_GTP: dict[str, tuple[str, ...]] = {
    "mp": ("pp", "gtp_remat", "tp"),
    "tp_dp": ("dp", "gtp_remat", "tp"),
    "tp_dp_cp": ("dp", "cp", "gtp_remat", "tp"),
}


def inject_gtp_remat(order: str, after: str) -> str:
    """megatron-core 0.19's order with its ``gtp_remat`` token: after ``after`` (``"tp"`` for the
    dense grid, ``"ep"`` for the expert one), else after ``tp``, else first; unchanged when the
    order already names it.

    >>> inject_gtp_remat("tp-cp-ep-dp-pp", "ep")
    'tp-cp-ep-gtp_remat-dp-pp'
    """
    tokens = order.split("-")
    if "gtp_remat" in tokens:
        return order
    anchor = after if after in tokens else "tp"
    tokens.insert(tokens.index(anchor) + 1 if anchor in tokens else 0, "gtp_remat")
    return "-".join(tokens)


@dataclass(frozen=True)
class MegatronPlan:
    """The layout (with views), subsets and field -> dims map of one Megatron configuration."""

    layout: Layout
    subsets: dict[str, tuple[Layout, tuple[str, ...]]]
    fields: dict[str, tuple[str, ...] | str]
    hcp_levels: tuple[tuple[str, ...], ...] = ()
    sizes: dict[str, int] = field(default_factory=dict)

    def rows(self, name: str) -> list[list[int]]:
        """Every group of field ``name`` (e.g. ``"tp_ep"``, ``"embd"``, ``"hcp_1"``)."""
        dims = self.fields[name]
        if isinstance(dims, str):
            sub, sub_dims = self.subsets[dims]
            return sub.groups(*sub_dims).tolist()
        return self.layout.groups(*dims).tolist()

    def group_sets(self) -> list[tuple[str, ...]]:
        """The dim sets to build (every field that is not a subset)."""
        return [dims for dims in self.fields.values() if not isinstance(dims, str)]


def _positive(name: str, value: object) -> int:
    value = check_int(value, name)
    if value < 1:
        raise ValueError(f"{name}={value} must be a positive integer")
    return value


def _callback_subset(
    name: str, callback: RanksCallback, pp_rows: list[list[int]]
) -> tuple[Layout, tuple[str, ...]]:
    rows = [list(callback(list(row))) for row in pp_rows]
    sizes = {len(r) for r in rows}
    if len(sizes) != 1:
        raise ValueError(
            f"{name} returned groups of different sizes {sorted(sizes)}; meshgroups needs equal sizes"
        )
    try:
        return Layout.from_grid(rows, ("pp_group", "member")), ("member",)
    except ValueError as exc:
        raise ValueError(f"{name} returned overlapping or invalid ranks: {exc}") from None


def _shown(names: tuple[str, ...], sizes: tuple[int, ...]) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The sizes for a message: the gtp_remat ones only when they are set (0.16's words otherwise)."""
    kept = [(n, s) for n, s in zip(names, sizes) if "gtp_remat" not in n or s > 1]
    return tuple(n for n, _ in kept), tuple(s for _, s in kept)


def hybrid_sizes(dp_cp: int) -> list[int]:
    """Megatron's hybrid DP×CP group sizes for a ``dp×cp`` of ``dp_cp``: the powers of two
    ``2 <= g <= dp_cp / 2``."""
    return [1 << i for i in range(1, dp_cp.bit_length() - 1)]


def _add_hybrid_views(
    views: dict[str, Layout], fields: dict[str, tuple[str, ...] | str], dense: Layout, dp_cp: int
) -> None:
    if dp_cp % 2:
        raise MegatronAssertionError(f"hybrid context parallel needs an even dp×cp, got dp×cp = {dp_cp}")
    flat = dense.flatten("dp", "cp", name="dp_cp")
    for g in hybrid_sizes(dp_cp):
        name = f"hybrid_dp_cp_{g}"
        views[f"hybrid_{g}"] = flat.split("dp_cp", **{f"hybrid_run_{g}": dp_cp // g, name: g})
        fields[name] = (name,)


def megatron_plan(
    world_size: int,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    *,
    context_parallel_size: int = 1,
    hierarchical_context_parallel_sizes: Sequence[int] | None = None,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
    num_distributed_optimizer_instances: int = 1,
    order: str = "tp-cp-ep-dp-pp",
    get_embedding_ranks: RanksCallback | None = None,
    get_position_embedding_ranks: RanksCallback | None = None,
    hybrid_context_parallel: bool = False,
    gtp_remat_size: int = 1,
    expert_gtp_remat_size: int = 1,
    rank_offset: int = 0,
) -> MegatronPlan:
    """State Megatron's groups for ``world_size`` ranks as a layout; see the module docstring.

    Raises a ``ValueError`` naming the sizes for every rule megatron-core enforces, of
    megatron-core's class too: ``MegatronRuntimeError`` where it raises ``RuntimeError``
    (the world not divisible by ``tp×pp×cp`` or ``expert_tp×ep×pp``, an order missing a token
    whose size is not 1), ``MegatronAssertionError`` where it asserts (``dp×cp`` and
    ``expert_dp`` divisible by the optimizer instances, hierarchical cp sizes multiplying to cp,
    equal dense/expert dp when pp is not last in ``order``, an even ``dp×cp`` for hybrid cp,
    one optimizer instance under gtp_remat).

    ``gtp_remat_size`` / ``expert_gtp_remat_size`` (megatron-core 0.19): the generalized
    tensor-parallel dims, which count toward the model size (dp is the replicate degree);
    ``rank_offset``: the layout covers ranks ``rank_offset .. rank_offset + world_size - 1``.
    """
    world = _positive("world_size", world_size)
    gtp = _positive("gtp_remat_size", gtp_remat_size)
    egtp = _positive("expert_gtp_remat_size", expert_gtp_remat_size)
    offset = check_int(rank_offset, "rank_offset")
    if offset < 0:
        raise ValueError(f"rank_offset={offset} must be non-negative")
    if (gtp > 1 or egtp > 1) and check_int(num_distributed_optimizer_instances, "n") > 1:
        raise MegatronAssertionError(
            f"gtp_remat_size={gtp}, expert_gtp_remat_size={egtp} with num_distributed_optimizer_instances="
            f"{num_distributed_optimizer_instances}: GTP_remat with more than one distributed-optimizer "
            "instance is not supported (megatron-core 0.19 asserts)"
        )
    tp = _positive("tensor_model_parallel_size", tensor_model_parallel_size)
    pp = _positive("pipeline_model_parallel_size", pipeline_model_parallel_size)
    cp = _positive("context_parallel_size", context_parallel_size)
    ep = _positive("expert_model_parallel_size", expert_model_parallel_size)
    etp = (
        tp
        if expert_tensor_parallel_size is None
        else _positive("expert_tensor_parallel_size", expert_tensor_parallel_size)
    )
    n_opt = _positive("num_distributed_optimizer_instances", num_distributed_optimizer_instances)
    dense_names, dense_sizes = ("tp", "pp", "cp", "gtp_remat"), (tp, pp, cp, gtp)
    if world % product(dense_sizes):
        raise MegatronRuntimeError(
            f"world_size={world} is not divisible by {formula(*_shown(dense_names, dense_sizes))}"
        )
    dp = world // product(dense_sizes)
    expert_names, expert_sizes = ("expert_tp", "ep", "pp", "expert_gtp_remat"), (etp, ep, pp, egtp)
    if world % product(expert_sizes):
        raise MegatronRuntimeError(
            f"world_size={world} is not divisible by {formula(*_shown(expert_names, expert_sizes))}"
        )
    edp = world // product(expert_sizes)
    if (dp * cp) % n_opt:
        raise MegatronAssertionError(
            f"dp×cp = {dp * cp} is not divisible by num_distributed_optimizer_instances={n_opt}"
        )
    if edp % n_opt:
        raise MegatronAssertionError(
            f"expert_dp={edp} is not divisible by num_distributed_optimizer_instances={n_opt}"
        )
    if not isinstance(order, str):
        raise TypeError(f"order must be a str like 'tp-cp-ep-dp-pp', got {order!r}")
    tokens = order.lower().split("-")
    if pp > 1 and tokens[-1] != "pp" and edp != dp:
        raise MegatronAssertionError(
            f"order={order!r} does not end in pp, so the dense and expert dp sizes must match; got dp={dp}, expert_dp={edp}"
        )
    rename = {"tp": "expt_tp", "cp": "expt_cp", "dp": "expt_dp", "gtp_remat": "expt_gtp_remat"}
    dense_order = inject_gtp_remat("-".join(tokens), "tp").split("-")
    expert_order = inject_gtp_remat("-".join(tokens), "ep").split("-")
    try:
        dense = Layout.from_order(
            "-".join(t for t in dense_order if t != "ep"),
            rank_offset=offset,
            tp=tp,
            gtp_remat=gtp,
            cp=cp,
            dp=dp,
            pp=pp,
        )
        expert = Layout.from_order(
            "-".join(rename.get(t, t) for t in expert_order),
            rank_offset=offset,
            expt_tp=etp,
            expt_cp=1,
            ep=ep,
            expt_gtp_remat=egtp,
            expt_dp=edp,
            pp=pp,
        )
    except LayoutError as exc:  # megatron-core's RankGenerator raises RuntimeError here
        raise MegatronRuntimeError(str(exc)) from None
    if not np.array_equal(dense.groups("pp"), expert.groups("pp")):
        raise MegatronAssertionError(
            f"order={order!r}: the pipeline groups of the dense and the expert layouts differ "
            f"({dense.groups('pp').tolist()[:2]} ... and {expert.groups('pp').tolist()[:2]} ...); "
            "megatron-core asserts they are the same"
        )
    views = {
        "expert": expert,
        "dense_opt": dense.flatten("dp", "cp", name="dp_cp").split(
            "dp_cp", dist_opt=n_opt, intra_dp_cp=dp * cp // n_opt
        ),
        "expert_opt": expert.split("expt_dp", inter_dist_opt=n_opt, intra_expt_dp=edp // n_opt),
    }
    fields = {**FIELD_DIMS, **_WITH_GTP, **(GTP_FIELDS if gtp > 1 or egtp > 1 else {})}
    hcp_levels: list[tuple[str, ...]] = []
    if hierarchical_context_parallel_sizes:
        sizes = [
            _positive("hierarchical_context_parallel_sizes[i]", s)
            for s in hierarchical_context_parallel_sizes
        ]
        if product(sizes) != cp:
            raise MegatronAssertionError(
                f"hierarchical_context_parallel_sizes={sizes} multiply to {product(sizes)}, not context_parallel_size={cp}"
            )
        names = [f"hcp_{i}" for i in range(len(sizes))]
        views["hcp"] = dense.split("cp", **{names[i]: sizes[i] for i in reversed(range(len(sizes)))})
        hcp_levels = [(n,) for n in names]
        fields.update({n: (n,) for n in names})
    if hybrid_context_parallel:
        _add_hybrid_views(views, fields, dense, dp * cp)
    # Only callbacks need every pipeline group (O(world)); the defaults are O(ndim) subsets.
    subsets = {
        "embd": _callback_subset("get_embedding_ranks", get_embedding_ranks, dense.groups("pp").tolist())
        if get_embedding_ranks
        else (dense.select("pp", [0, -1]), ("pp",)),
        "pos_embd": _callback_subset(
            "get_position_embedding_ranks", get_position_embedding_ranks, dense.groups("pp").tolist()
        )
        if get_position_embedding_ranks
        else (dense.select("pp", [0]), ("pp",)),
    }
    sizes_used = {
        "tp": tp,
        "pp": pp,
        "cp": cp,
        "dp": dp,
        "ep": ep,
        "expt_tp": etp,
        "expt_dp": edp,
        "n_opt": n_opt,
        "gtp_remat": gtp,
        "expt_gtp_remat": egtp,
    }
    return MegatronPlan(dense.with_views(**views), subsets, fields, tuple(hcp_levels), sizes_used)


__all__ = ["MegatronPlan", "hybrid_sizes", "inject_gtp_remat", "megatron_plan"]
