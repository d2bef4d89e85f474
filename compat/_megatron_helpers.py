"""megatron-core's free-standing helpers of ``parallel_state``, served by meshgroups layouts.

Re-exported by ``meshgroups.compat.parallel_state``: ``RankGenerator`` (on
``Layout.from_order``), ``generate_masked_orthogonal_rank_groups``, the default embedding rank
callbacks, ``create_group`` and the hierarchical / hybrid group builders (their rank lists are
layout rows), the NCCL option helpers and ``update_pg_timeout``. Same signatures, results and
exception classes as megatron-core 0.16.1::

    >>> RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="tp-cp-ep-dp-pp").get_ranks("dp")
    [[0, 2], [1, 3], [4, 6], [5, 7]]
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from meshgroups.compat._errors import MegatronAssertionError, MegatronRuntimeError
from meshgroups.compat._versioned import versioned
from meshgroups.compat.megatron_layout import hybrid_sizes

from meshgroups import Layout, LayoutError
from meshgroups.layout import product
from meshgroups.mesh import set_group_timeout

__all__ = [
    "RankGenerator",
    "create_group",
    "create_hierarchical_groups",
    "create_hybrid_dp_cp_groups",
    "default_embedding_ranks",
    "default_position_embedding_ranks",
    "generate_masked_orthogonal_rank_groups",
    "get_nccl_options",
    "overwrite_nccl_comm_cfgs",
    "update_pg_timeout",
]

_TOKENS = ("tp", "pp", "dp", "ep", "cp")

# Groups made through ``create_group`` (megatron-core's ``_global_process_group_list``: None
# stands for the default group). ``update_pg_timeout`` also reaches the layout's groups.
created_groups: list[dist.ProcessGroup | None] = [None]


class RankGenerator:
    """Megatron's rank generator: groups of any token subset of an order string, as layout rows.

    ``order`` lists tokens fastest first; tokens left out must have size 1 (appended, as in
    megatron-core). ``layout`` is the ``meshgroups.Layout`` behind it. megatron-core 0.19 adds
    the ``gtp_remat`` token (its size is the last argument) and ``get_gtp_ranks``.

    Args:
        tp, ep, dp, pp, cp: the sizes (one of ep and cp must be 1).
        order: the order string, fastest first (``"tp-cp-ep-dp-pp"``).
        rank_offset: the first global rank.
        gtp_remat: (megatron-core 0.19) the size of the gtp_remat token.
    """

    gtp_remat: int = 1  # megatron-core 0.19's; 0.16's generators have no such size

    def _setup(self, sizes: dict[str, int], order: str, rank_offset: int) -> None:
        if sizes["ep"] != 1 and sizes["cp"] != 1:
            raise MegatronAssertionError(
                f"ep={sizes['ep']} and cp={sizes['cp']} are both > 1: one RankGenerator holds either cp "
                "(dense) or ep (expert)"
            )
        self.tp, self.ep, self.dp, self.pp, self.cp = (sizes[t] for t in ("tp", "ep", "dp", "pp", "cp"))
        self.rank_offset = rank_offset
        self.world_size = product(sizes.values())
        self.name_to_size = sizes
        tokens = order.lower().split("-")
        for name in sizes:
            if name not in tokens and sizes[name] != 1:
                raise MegatronRuntimeError(
                    f"{name}={sizes[name]} but {name!r} is missing from order {order!r}"
                )
        tokens += [name for name in sizes if name not in tokens]
        self.order = "-".join(tokens)
        try:
            self.ordered_size = [sizes[t] for t in tokens]
        except KeyError as exc:
            raise MegatronRuntimeError(
                f"unknown token {exc.args[0]!r} in order {order!r}; tokens are {', '.join(sizes)}"
            ) from None
        self.layout = Layout.from_order(self.order, rank_offset=rank_offset, **sizes)

    def get_gtp_ranks(self, gtp_remat_size: int) -> list[list[int]]:
        """(megatron-core 0.19) The gtp_remat groups; ``gtp_remat_size`` must be this generator's."""
        if self.gtp_remat != gtp_remat_size:
            raise MegatronAssertionError(
                f"gtp_remat axis size ({self.gtp_remat}) != requested gtp_remat_size ({gtp_remat_size})"
            )
        return self.get_ranks("gtp_remat")

    def get_mask(self, order: str, token: str) -> list[bool]:
        """``[t in token for t in order]`` over hyphen-separated tokens."""
        ordered = order.split("-")
        mask = [False] * len(ordered)
        for t in token.split("-"):
            if t not in ordered:
                raise MegatronRuntimeError(f"token {t!r} is not in order {order!r}")
            mask[ordered.index(t)] = True
        return mask

    def get_ranks(self, token: str) -> list[list[int]]:
        """Every group varying the tokens of ``token`` (``"tp-dp"``): Megatron's rows, in
        Megatron's order."""
        self.get_mask(self.order, token)  # validates the tokens with Megatron's message
        return self.layout.groups(*token.split("-")).tolist()


def generate_masked_orthogonal_rank_groups(
    world_size: int, parallel_size: list[int], mask: list[bool]
) -> list[list[int]]:
    """The groups varying the dims where ``mask`` is True of a grid of ``parallel_size``
    (fastest first), as megatron-core enumerates them.

        >>> generate_masked_orthogonal_rank_groups(8, [2, 2, 2], [False, True, False])
        [[0, 2], [1, 3], [4, 6], [5, 7]]
    """
    if len(parallel_size) != len(mask):
        raise MegatronAssertionError(
            f"parallel_size {list(parallel_size)} and mask {list(mask)} must have the same length"
        )
    names = [f"d{i}" for i in range(len(parallel_size))]
    layout = Layout.from_order("-".join(names), **dict(zip(names, parallel_size)))
    rows = layout.groups(*(n for n, m in zip(names, mask) if m))
    if world_size > layout.world_size or world_size % rows.shape[1]:
        raise MegatronAssertionError(
            f"world_size={world_size} must be a multiple of the group size {rows.shape[1]} "
            f"and at most the grid's {layout.world_size} ranks"
        )
    return rows[: world_size // rows.shape[1]].tolist()


def default_embedding_ranks(pp_ranks: list[int]) -> list[int]:
    """First and last pipeline stage (one stage: just it)."""
    return [pp_ranks[0]] if len(pp_ranks) == 1 else [pp_ranks[0], pp_ranks[-1]]


def default_position_embedding_ranks(pp_ranks: list[int]) -> list[int]:
    """The first pipeline stage."""
    return [pp_ranks[0]]


def create_group(
    ranks: list[int] | None = None,
    timeout: timedelta | None = None,
    backend: str | None = None,
    pg_options: Any = None,
    use_local_synchronization: bool = False,
    group_desc: str | None = None,
) -> dist.ProcessGroup | None:
    """``torch.distributed.new_group`` with megatron-core's arguments; the group is remembered
    for ``update_pg_timeout``. Collective over the default group unless
    ``use_local_synchronization``."""
    group = dist.new_group(
        ranks=ranks,
        timeout=timeout,
        backend=backend,
        pg_options=pg_options,
        use_local_synchronization=use_local_synchronization,
        group_desc=group_desc,
    )
    if ranks is None or dist.get_rank() in ranks:
        created_groups.append(group)
    return group


def _member_rows(
    rank: int, rows: np.ndarray, make: Any, gloo: bool, desc: str
) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    mine: tuple[dist.ProcessGroup | None, dist.ProcessGroup | None] = (None, None)
    for row in rows.tolist():
        group = make(row, None, desc)
        twin = make(row, "gloo", f"{desc}_GLOO") if gloo else None
        if rank in row:
            mine = (group, twin)
    return mine


def create_hierarchical_groups(
    rank: int,
    ranks: list[int],
    hierarchical_group_sizes: list[int],
    create_gloo_process_groups: bool = False,
    pg_options: Any = None,
    timeout: timedelta | None = None,
    group_desc: str | None = None,
) -> tuple[list[Any], list[Any]]:
    """Split ``ranks`` into levels (level 0 fastest) and create every level's groups on every
    rank; return this rank's group per level (and gloo twins, or ``None``s)."""
    sizes = [int(s) for s in hierarchical_group_sizes]
    if int(np.prod(sizes)) != len(ranks):
        raise MegatronAssertionError(
            f"hierarchical_group_sizes {sizes} multiply to {int(np.prod(sizes))}, not len(ranks)={len(ranks)}"
        )
    names = [f"level_{i}" for i in range(len(sizes))]
    try:
        layout = Layout.from_grid(np.array(ranks).reshape(sizes[::-1]), names[::-1])
    except LayoutError as exc:
        raise MegatronAssertionError(f"ranks {ranks}: {exc}") from None
    options = pg_options if isinstance(pg_options, list) else [pg_options] * len(sizes)
    groups: list[Any] = []
    twins: list[Any] = []
    for level, name in enumerate(names):

        def make(row: list[int], backend: str | None, desc: str, level: int = level) -> Any:
            return create_group(
                row, timeout=timeout, backend=backend, pg_options=options[level], group_desc=desc
            )

        desc = f"HIERARCHICAL_{group_desc}_L{level}"
        group, twin = _member_rows(rank, layout.groups(name), make, create_gloo_process_groups, desc)
        if rank in ranks:
            groups.append(group)
            twins.append(twin)
    return groups, twins


def create_hybrid_dp_cp_groups(rank: int, ranks: list[int], pg_options: Any) -> dict[int, Any]:
    """For each power of two ``2 <= g <= len(ranks) / 2``: groups of ``g`` consecutive members of
    ``ranks``, created on every rank; returns ``{g: this rank's group}``."""
    out: dict[int, Any] = {}
    for g in hybrid_sizes(len(ranks)):
        if len(ranks) % g:
            raise MegatronAssertionError(f"len(ranks)={len(ranks)} is not divisible by hybrid group size {g}")
        rows = Layout.from_grid(np.array(ranks).reshape(-1, g), ("run", "member")).groups("member")

        def make(row: list[int], backend: str | None, desc: str) -> Any:
            return create_group(row, pg_options=pg_options, group_desc=desc)

        group, _ = _member_rows(rank, rows, make, False, f"HYBRID_DP_CP_GROUP_{g}")
        if group is not None:
            out[g] = group
    return out


def get_nccl_options(pg_name: str, nccl_comm_cfgs: dict[str, Any]) -> Any:
    """NCCL options for group ``pg_name`` from a parsed communicator config, or None."""
    if pg_name not in nccl_comm_cfgs:
        return None
    cfg = nccl_comm_cfgs[pg_name]
    nccl = getattr(torch.distributed, "ProcessGroupNCCL", None)
    if nccl is None:
        raise MegatronRuntimeError(f"NCCL options for {pg_name!r} need a torch build with NCCL")
    options = nccl.Options(is_high_priority_stream=cfg.get("is_high_priority_stream", False))
    for key in ("cga_cluster_size", "max_ctas", "min_ctas", "net_name"):
        if key in cfg:
            setattr(options.config, key, cfg[key])
    if "net_name" in cfg and str(cfg["net_name"]).lower() not in ("ib", "socket"):
        raise MegatronRuntimeError(
            f"net_name ({cfg['net_name']}) is not supported. Accepted values: 'IB' or 'socket'."
        )
    return options


def overwrite_nccl_comm_cfgs(nccl_comm_cfgs: dict[str, Any], pg_name: str, key_value_pair: Any) -> None:
    """``nccl_comm_cfgs[pg_name][key] = value`` (creating the entry)."""
    nccl_comm_cfgs.setdefault(pg_name, {})[key_value_pair[0]] = key_value_pair[1]


def update_pg_timeout(timeout: timedelta, pg: dist.ProcessGroup | None = None) -> None:
    """After a barrier on ``pg``, set the timeout of ``pg`` — or, with ``pg=None``, of the
    default group and every group compat made (the layout's and ``create_group``'s)."""
    from meshgroups.compat._megatron_state import held_groups

    dist.barrier(pg)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    if pg is not None:
        set_group_timeout(pg, timeout)
        return
    seen: set[int] = set()
    for group in [*created_groups, *held_groups()]:
        if id(group) not in seen:
            seen.add(id(group))
            set_group_timeout(group, timeout)


def _init_16(
    self: RankGenerator, tp: int, ep: int, dp: int, pp: int, cp: int, order: str, rank_offset: int = 0
) -> None:
    """megatron-core 0.16's constructor: the tokens tp, pp, dp, ep, cp."""
    self._setup({"tp": tp, "pp": pp, "dp": dp, "ep": ep, "cp": cp}, order, rank_offset)


def _init_19(
    self: RankGenerator,
    tp: int,
    ep: int,
    dp: int,
    pp: int,
    cp: int,
    order: str,
    rank_offset: int = 0,
    gtp_remat: int = 1,
) -> None:
    """megatron-core 0.19's constructor: the tokens tp, pp, dp, ep, cp, gtp_remat."""
    self.gtp_remat = gtp_remat
    self._setup(
        {"tp": tp, "pp": pp, "dp": dp, "ep": ep, "cp": cp, "gtp_remat": gtp_remat}, order, rank_offset
    )


RankGenerator.__init__ = versioned(  # type: ignore[method-assign]
    "__init__", {"0.16": _init_16, "0.19": _init_19}, __name__, call="RankGenerator"
)
RankGenerator.__init__.__qualname__ = "RankGenerator.__init__"
