"""Drop-in replacement for ``rlightning.utils.distributed.group_initializer``.

Change one import line::

    from rlightning.utils.distributed.group_initializer import TPGroupInitializer   # before
    from meshgroups.compat.group_initializer import TPGroupInitializer                        # after

Same class names, constructor arguments, attributes, ``mode`` values and
``init_dist_group(backend="nccl", use_cpu=False)`` 5-tuples
``(local_rank, group_world_size, process_group, ranks_in_group, mode)``. Underneath, each
initializer states its layout as a ``meshgroups.Layout`` (``.layout``, drawable without
processes) and takes its group from ``meshgroups.init_mesh``; no rank arithmetic lives here.

Deliberate differences from the legacy module (each was a silent bug there):

- Sizes that do not divide ``world_size``, ``rank`` outside ``[0, world_size)``, and duplicate,
  out-of-range or empty explicit rank lists raise ``ValueError`` in the constructor (legacy:
  some ranks silently got no group, or ``new_group`` failed midway). In an initialised job the
  refusal is also the outcome of the ``init_dist_group`` call it leads into: the other ranks'
  ``init_dist_group`` raises the same class at once, naming the rank (instead of a timeout).
- ``init_dist_group`` raises ``ValueError`` if ``world_size`` or ``rank`` differ from the
  initialised default group (legacy: wrong groups), and every rank checks that all ranks build
  the same groups before any is created (legacy: a hang).
- Groups keep the given rank order: ``dist.get_rank(process_group) == local_rank`` always
  (legacy sorted the ranks, so an unsorted explicit list gave a ``local_rank`` that disagreed
  with the group's own rank).
- Initializers that ask for the same ranks share one process group (TP and SP of equal size, a
  DP group equal to an explicit list), instead of creating duplicates.
"""

from __future__ import annotations

from abc import abstractmethod

import torch.distributed as dist
from meshgroups.compat._initializer_args import RefusalsReachEveryRank, check_divides, check_ranks
from torch.distributed import ProcessGroup

from meshgroups import GroupCache, Layout, Strategy, init_mesh
from meshgroups.layout import MAX_WORLD_SIZE, check_int, short_repr
from meshgroups.mesh import collective_entry

__all__ = [
    "CommMode",
    "DPGroupInitializer",
    "InterNodeGroupInitializer",
    "IntraNodeGroupInitializer",
    "ParallelMode",
    "ProcessGroupInitializer",
    "SPGroupInitializer",
    "TPGroupInitializer",
    "TrainDPGroupInitializer",
    "WeightTransferGroupInitializer",
    "group_cache",
    "reset_group_cache",
    "set_group_strategy",
]

InitResult = tuple[int | None, int | None, ProcessGroup | None, list[int] | None, str | None]

# The compat layer's one piece of process state: groups shared by every initializer, so that
# equal rank sets get one process group. ``reset_group_cache()`` destroys and forgets them.
_CACHE = GroupCache()
_STRATEGY: Strategy = "global"


def set_group_strategy(strategy: Strategy) -> None:
    """How the initializers create groups from now on (``meshgroups.init_mesh``'s strategies):
    ``"global"`` (default, safe everywhere: every rank makes every creation call) or
    ``"local"`` (each rank creates only its own groups: per-rank cost flat in the world size).
    Every rank must choose the same (the cross-rank check compares it). Set it before the first
    ``init_dist_group`` or after ``reset_group_cache()``: one cache holds one strategy's groups."""
    global _STRATEGY
    if strategy not in ("global", "local", "split"):
        raise ValueError(f"strategy={short_repr(strategy)} is not one of 'global', 'local', 'split'")
    if len(_CACHE) and _CACHE.strategy not in (None, strategy):
        raise ValueError(
            f"groups were already created with strategy={_CACHE.strategy!r}; call reset_group_cache() first"
        )
    _STRATEGY = strategy


def group_cache() -> GroupCache:
    """The cache holding every group the compat initializers created (``.calls``, ``len()``).

    Returns:
        The ``GroupCache``.
    """
    return _CACHE


def reset_group_cache() -> None:
    """Destroy every group the initializers created and start afresh (e.g. between jobs)."""
    global _CACHE
    if dist.is_initialized():
        _CACHE.destroy()
    _CACHE = GroupCache()


class CommMode:
    """Communication mode identifiers for process groups.

    Attributes:
        GLOBAL: Global communication group spanning all processes.
        INTRA_NODE: Communication group within a single node.
        INTER_NODE: Communication group across nodes (one process per node).
    """

    GLOBAL: str = "GLOBAL"
    INTRA_NODE: str = "INTRA_NODE"
    INTER_NODE: str = "INTER_NODE"


class ParallelMode(CommMode):
    """Parallel mode identifiers extending CommMode.

    Attributes:
        TRAIN_DATA_PARALLEL: Data parallel group for training.
        DATA_PARALLEL: General data parallel group.
        TENSOR_PARALLEL: Tensor parallel group for model parallelism.
        SEQUENCE_PARALLEL: Sequence parallel group for long sequences.
        WEIGHT_TRANSFER: Group for transferring model weights.
    """

    TRAIN_DATA_PARALLEL: str = "TRAIN_DATA_PARALLEL"
    DATA_PARALLEL: str = "DATA_PARALLEL"
    TENSOR_PARALLEL: str = "TENSOR_PARALLEL"
    SEQUENCE_PARALLEL: str = "SEQUENCE_PARALLEL"
    WEIGHT_TRANSFER: str = "WEIGHT_TRANSFER"


class ProcessGroupInitializer(metaclass=RefusalsReachEveryRank):
    """Abstract base class for process group initialization.

    Attributes:
        rank: Global rank of this process.
        world_size: Total number of processes.
        local_rank: Local rank within the initialized group.
        ranks_in_group: List of global ranks in the group.
        process_group: The initialized ProcessGroup instance.
        group_world_size: Size of the initialized group.
        mode: Communication mode identifier for this group.
    """

    def __init__(self, rank: int, world_size: int) -> None:
        """Initialize the process group initializer.

        Args:
            rank: Global rank of this process.
            world_size: Total number of processes.

        Raises:
            ValueError: ``world_size`` outside ``1..2**24`` or ``rank`` outside ``[0, world_size)``.
        """
        world_size = check_int(world_size, "world_size")
        rank = check_int(rank, "rank")
        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be positive")
        if world_size > MAX_WORLD_SIZE:
            raise ValueError(f"world_size={world_size} exceeds the {MAX_WORLD_SIZE} ranks a layout may hold")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} is outside [0, world_size={world_size})")
        self.rank: int = rank
        self.world_size: int = world_size
        self.local_rank: int | None = None
        self.ranks_in_group: list[int] | None = None
        self.process_group: ProcessGroup | None = None
        self.group_world_size: int | None = None
        self.mode: str | None = None

    @property
    def layout(self) -> Layout:
        """The layout this initializer's groups are the ``group_dims`` groups of."""
        raise NotImplementedError(f"{type(self).__name__} does not state a layout")

    @property
    def group_dims(self) -> tuple[str, ...]:
        """The dims of :attr:`layout` whose groups ``init_dist_group`` creates."""
        raise NotImplementedError(f"{type(self).__name__} does not state a layout")

    def groups(self) -> list[list[int]]:
        """Every group ``init_dist_group`` creates, as rank lists; no processes needed."""
        return self.layout.groups(*self.group_dims).tolist()

    @abstractmethod
    def init_dist_group(self, backend: str = "nccl", use_cpu: bool = False) -> InitResult:
        """Initialize the distributed group.

        Args:
            backend: Communication backend ('nccl' or 'gloo').
            use_cpu: If True, use CPU tensors (forces 'gloo' backend).

        Returns:
            Tuple of (local_rank, group_world_size, process_group, ranks_in_group, mode).
        """

    @collective_entry("_new_and_update_group_info", method=True)
    def _new_and_update_group_info(
        self, ranks: list[int], use_cpu: bool = False, backend: str = "nccl"
    ) -> None:
        """Create the group of ``ranks`` and, on its members, record it on ``self``.

        Collective, as in the legacy module: every rank must call it with the same lists in the
        same order. Kept for user subclasses that enumerate groups themselves.

        Args:
            ranks: List of global ranks to include in the group.
            use_cpu: If True, use 'gloo' backend for CPU tensors.
            backend: Communication backend to use.
        """
        checked = check_ranks(ranks, self.world_size)
        self._update_from_layout(Layout.from_grid(checked, ("members",)), ("members",), use_cpu, backend)

    def _update_from_layout(self, layout: Layout, dims: tuple[str, ...], use_cpu: bool, backend: str) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "init_dist_group needs an initialised default process group (dist.init_process_group)"
            )
        if dist.get_world_size() != self.world_size:
            raise ValueError(
                f"world_size={self.world_size} differs from the default process group's world size "
                f"{dist.get_world_size()}"
            )
        if dist.get_rank() != self.rank:
            raise ValueError(
                f"rank={self.rank} but this process is rank {dist.get_rank()} of the default group"
            )
        # The legacy contract: a layout over some ranks only, the others get ``None``s.
        built = init_mesh(
            layout,
            backend="gloo" if use_cpu else backend,
            only=[dims],
            cache=_CACHE,
            strategy=_STRATEGY,
            partial=True,
        )
        ranks = built.ranks(*dims)
        if ranks is not None:
            self.local_rank = built.local_rank(*dims)
            self.group_world_size = len(ranks)
            self.process_group = built.group(*dims)
            self.ranks_in_group = ranks

    def _result(self) -> InitResult:
        return (self.local_rank, self.group_world_size, self.process_group, self.ranks_in_group, self.mode)


class _LayoutInitializer(ProcessGroupInitializer):
    """An initializer whose groups are the ``group_dims`` groups of its ``layout``."""

    @collective_entry("init_dist_group", method=True)  # numbered first: an error on one rank reaches all
    def init_dist_group(self, backend: str = "nccl", use_cpu: bool = False) -> InitResult:
        """Create this initializer's groups (a collective call: every rank makes it).

        Args:
            backend: Communication backend ('nccl' or 'gloo').
            use_cpu: If True, use CPU tensors (forces 'gloo' backend).

        Returns:
            Tuple of (local_rank, group_world_size, process_group, ranks_in_group, mode);
            the first four are ``None`` on a rank that is in none of the groups.
        """
        self._update_from_layout(self.layout, self.group_dims, use_cpu, backend)
        return self._result()


class _ExplicitRanksInitializer(_LayoutInitializer):
    """One group of explicitly given ranks; other ranks get ``None``s (and ``mode``)."""

    _mode: str = ""

    def __init__(self, rank: int, world_size: int, ranks: list[int]) -> None:
        super().__init__(rank, world_size)
        self.ranks: list[int] = check_ranks(ranks, self.world_size)
        self.mode = self._mode

    @property
    def layout(self) -> Layout:
        return Layout.from_grid(self.ranks, ("members",))

    @property
    def group_dims(self) -> tuple[str, ...]:
        return ("members",)


class TrainDPGroupInitializer(_ExplicitRanksInitializer):
    """Data parallel group initializer for training: one group of the given ranks.

    Attributes:
        ranks: List of global ranks to include in this group.
    """

    _mode = ParallelMode.TRAIN_DATA_PARALLEL


class IntraNodeGroupInitializer(_ExplicitRanksInitializer):
    """Intra-node process group initializer: one group of the given ranks of a node.

    Attributes:
        ranks: List of global ranks within the node.
    """

    _mode = CommMode.INTRA_NODE


class WeightTransferGroupInitializer(_ExplicitRanksInitializer):
    """Weight transfer process group initializer: one group of the given ranks.

    Attributes:
        ranks: List of global ranks participating in weight transfer.
    """

    _mode = ParallelMode.WEIGHT_TRANSFER


class DPGroupInitializer(_LayoutInitializer):
    """Data parallel groups: ``Layout(dp=data_parallel_size, rest=world_size // data_parallel_size)``,
    the ``dp`` groups (dp outermost, so members are ``process_num_between_dp_rank`` apart).

    Attributes:
        data_parallel_size: Number of processes in each data parallel group.
        process_num_between_dp_rank: Stride between data parallel ranks.
    """

    def __init__(self, rank: int, world_size: int, data_parallel_size: int) -> None:
        super().__init__(rank, world_size)
        self.data_parallel_size: int = check_divides(
            "data_parallel_size", data_parallel_size, self.world_size
        )
        self.process_num_between_dp_rank: int = self.world_size // self.data_parallel_size
        self.mode = ParallelMode.DATA_PARALLEL

    @property
    def layout(self) -> Layout:
        return Layout(dp=self.data_parallel_size, rest=self.process_num_between_dp_rank)

    @property
    def group_dims(self) -> tuple[str, ...]:
        return ("dp",)


class TPGroupInitializer(_LayoutInitializer):
    """Tensor parallel groups: ``Layout(rest=world_size // tensor_parallel_size, tp=...)``, the
    ``tp`` groups (blocks of consecutive ranks).

    Attributes:
        tensor_parallel_size: Number of processes in each tensor parallel group.
        tensor_parallel_group_num: Total number of tensor parallel groups.
    """

    def __init__(self, rank: int, world_size: int, tensor_parallel_size: int) -> None:
        super().__init__(rank, world_size)
        self.tensor_parallel_size: int = check_divides(
            "tensor_parallel_size", tensor_parallel_size, self.world_size
        )
        self.tensor_parallel_group_num: int = self.world_size // self.tensor_parallel_size
        self.mode = ParallelMode.TENSOR_PARALLEL

    @property
    def layout(self) -> Layout:
        return Layout(rest=self.tensor_parallel_group_num, tp=self.tensor_parallel_size)

    @property
    def group_dims(self) -> tuple[str, ...]:
        return ("tp",)


class SPGroupInitializer(_LayoutInitializer):
    """Sequence parallel groups: ``Layout(rest=world_size // sequence_parallel_size, sp=...)``,
    the ``sp`` groups (blocks of consecutive ranks).

    Attributes:
        sequence_parallel_size: Number of processes in each sequence parallel group.
        sequence_parallel_group_num: Total number of sequence parallel groups.
    """

    def __init__(self, rank: int, world_size: int, sequence_parallel_size: int) -> None:
        super().__init__(rank, world_size)
        self.sequence_parallel_size: int = check_divides(
            "sequence_parallel_size", sequence_parallel_size, self.world_size
        )
        self.sequence_parallel_group_num: int = self.world_size // self.sequence_parallel_size
        self.mode = ParallelMode.SEQUENCE_PARALLEL

    @property
    def layout(self) -> Layout:
        return Layout(rest=self.sequence_parallel_group_num, sp=self.sequence_parallel_size)

    @property
    def group_dims(self) -> tuple[str, ...]:
        return ("sp",)


class InterNodeGroupInitializer(_LayoutInitializer):
    """Inter-node groups: ``Layout(node=node_count, local=local_world_size)``, the ``node``
    groups (the same local rank on every node).

    Attributes:
        local_world_size: Number of processes per node.
        node_count: Total number of nodes in the cluster.
    """

    def __init__(self, rank: int, world_size: int, local_world_size: int) -> None:
        super().__init__(rank, world_size)
        self.local_world_size: int = check_divides("local_world_size", local_world_size, self.world_size)
        self.node_count: int = self.world_size // self.local_world_size
        self.mode = CommMode.INTER_NODE

    @property
    def layout(self) -> Layout:
        return Layout(node=self.node_count, local=self.local_world_size)

    @property
    def group_dims(self) -> tuple[str, ...]:
        return ("node",)
