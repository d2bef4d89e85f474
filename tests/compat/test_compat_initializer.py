"""meshgroups.compat.group_initializer against a literal re-implementation of the legacy loops."""

from __future__ import annotations

import pytest

from ..support.dist import run

EXPLICIT = {
    4: [[0, 1, 2, 3], [3, 1], [2], [1, 2]],
    8: [[0, 1, 2, 3], [5, 3, 1], [7], list(range(8)), [4, 5, 6, 7], [0, 2, 4, 6]],
}


def legacy_oracle(kind, rank, world, arg):
    """The legacy init_dist_group loops, written out literally: which group a rank records."""
    seen = {"local_rank": None, "size": None, "ranks": None}

    def update(ranks):
        if rank in ranks:
            seen.update(local_rank=ranks.index(rank), size=len(ranks), ranks=ranks)

    if kind in ("TP", "SP"):
        for i in range(world // arg):
            update([i * arg + j for j in range(arg)])
    elif kind == "DP":
        between = world // arg
        for j in range(between):
            update([i * between + j for i in range(arg)])
    elif kind == "InterNode":
        for i in range(arg):
            update([i + j * arg for j in range(world // arg)])
    else:
        update(list(arg))
    mode = {
        "TP": "TENSOR_PARALLEL",
        "SP": "SEQUENCE_PARALLEL",
        "DP": "DATA_PARALLEL",
        "InterNode": "INTER_NODE",
        "TrainDP": "TRAIN_DATA_PARALLEL",
        "IntraNode": "INTRA_NODE",
        "WeightTransfer": "WEIGHT_TRANSFER",
    }[kind]
    return seen["local_rank"], seen["size"], seen["ranks"], mode


def configs(world):
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    for kind in ("TP", "SP", "DP", "InterNode"):
        for d in divisors:
            yield kind, d
    for kind in ("TrainDP", "IntraNode", "WeightTransfer"):
        for ranks in EXPLICIT[world]:
            yield kind, ranks


def make(kind, rank, world, arg):
    from meshgroups.compat import group_initializer as gi

    cls = getattr(gi, f"{kind}GroupInitializer")
    return cls(rank, world, list(arg) if isinstance(arg, list) else arg)


def worker_oracle(rank, world, strategy="global"):
    import torch
    import torch.distributed as dist
    from meshgroups.compat import group_initializer as gi

    gi.set_group_strategy(strategy)
    checked = 0
    for i, (kind, arg) in enumerate(configs(world)):
        init = make(kind, rank, world, arg)
        result = init.init_dist_group(use_cpu=True) if i % 2 else init.init_dist_group(backend="gloo")
        local_rank, size, group, ranks, mode = result
        assert (local_rank, size, ranks, mode) == legacy_oracle(kind, rank, world, arg), (kind, arg, result)
        assert (
            init.local_rank,
            init.group_world_size,
            init.process_group,
            init.ranks_in_group,
            init.mode,
        ) == result
        # the stated layout (drawable without processes) holds exactly the groups built
        if ranks is None:
            assert group is None and all(rank not in g for g in init.groups())
            continue
        assert ranks in init.groups()
        assert isinstance(ranks, list) and all(type(r) is int for r in ranks)
        assert dist.get_process_group_ranks(group) == ranks and dist.get_rank(group) == local_rank
        value = torch.tensor([rank + 1.0])
        dist.all_reduce(value, group=group)
        assert value.item() == sum(r + 1 for r in ranks)
        checked += 1
    # equal rank sets share one group: TP and SP of equal size; DP and an equal explicit list
    calls, held = gi.group_cache().calls, len(gi.group_cache())
    tp = gi.TPGroupInitializer(rank, world, 2).init_dist_group(use_cpu=True)
    sp = gi.SPGroupInitializer(rank, world, 2).init_dist_group(use_cpu=True)
    assert sp[2] is tp[2]
    dp = gi.DPGroupInitializer(rank, world, world // 2).init_dist_group(use_cpu=True)
    evens = list(range(0, world, 2))
    train = gi.TrainDPGroupInitializer(rank, world, evens).init_dist_group(use_cpu=True)
    assert len(gi.group_cache()) == held  # no new group (local takes a one-rank pad step instead)
    if strategy == "global":
        assert gi.group_cache().calls == calls
    if rank in evens:
        assert train[2] is dp[2]
    else:
        assert train[:4] == (None, None, None, None)
    gi.reset_group_cache()
    gi.set_group_strategy("global")
    return checked


@pytest.mark.processes
@pytest.mark.parametrize("world", [4, 8])
def test_every_initializer_matches_the_legacy_loops(world):
    checked = run(worker_oracle, world, timeout=180)
    assert all(c > 10 for c in checked)


@pytest.mark.processes
def test_every_initializer_with_the_local_strategy_world8():
    checked = run(worker_oracle, 8, "local", timeout=180)
    assert all(c > 10 for c in checked)


def worker_subclass_and_errors(rank, world):
    import torch.distributed as dist
    from meshgroups.compat.group_initializer import ParallelMode, ProcessGroupInitializer, TPGroupInitializer

    class PairsInitializer(ProcessGroupInitializer):
        """A user subclass in the legacy style: enumerates its groups itself."""

        def __init__(self, rank, world_size):
            super().__init__(rank, world_size)
            self.mode = ParallelMode.DATA_PARALLEL

        def init_dist_group(self, backend="nccl", use_cpu=False):
            half = self.world_size // 2
            for j in range(half):
                self._new_and_update_group_info([j + half, j], use_cpu, backend)
            return self.local_rank, self.group_world_size, self.process_group, self.ranks_in_group, self.mode

    local_rank, size, group, ranks, mode = PairsInitializer(rank, world).init_dist_group(use_cpu=True)
    assert mode == ParallelMode.DATA_PARALLEL
    half = world // 2
    expected = [rank % half + half, rank % half]
    assert ranks == expected and local_rank == expected.index(rank) == dist.get_rank(group) and size == 2
    errors = []
    for call in (
        lambda: TPGroupInitializer(rank, world * 2, 2).init_dist_group(use_cpu=True),
        lambda: TPGroupInitializer((rank + 1) % world, world, 2).init_dist_group(use_cpu=True),
    ):
        try:
            call()
        except ValueError as exc:
            errors.append(str(exc))
    dist.barrier()
    return errors


@pytest.mark.processes
def test_user_subclass_and_world_mismatch_world4():
    for errors in run(worker_subclass_and_errors, 4):
        assert "world_size=8 differs from the default process group's world size 4" in errors[0]
        assert "but this process is rank" in errors[1]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda gi: gi.TPGroupInitializer(0, 8, 3), "tensor_parallel_size=3 does not divide world_size=8"),
        (lambda gi: gi.SPGroupInitializer(0, 8, 0), "sequence_parallel_size=0 does not divide world_size=8"),
        (lambda gi: gi.DPGroupInitializer(0, 6, 4), "data_parallel_size=4 does not divide world_size=6"),
        (
            lambda gi: gi.InterNodeGroupInitializer(0, 8, 16),
            "local_world_size=16 does not divide world_size=8",
        ),
        (lambda gi: gi.TPGroupInitializer(8, 8, 2), r"rank=8 is outside \[0, world_size=8\)"),
        (lambda gi: gi.TPGroupInitializer(-1, 8, 2), r"rank=-1 is outside"),
        (lambda gi: gi.TrainDPGroupInitializer(0, 4, [0, 1, 1]), "lists rank 1 more than once"),
        (lambda gi: gi.IntraNodeGroupInitializer(0, 4, [0, 4]), r"rank 4 in ranks=\[0, 4\] is outside"),
        (lambda gi: gi.WeightTransferGroupInitializer(0, 4, []), "ranks is empty"),
        (lambda gi: gi.TPGroupInitializer(0, 0, 1), "world_size=0 must be positive"),
    ],
)
def test_bad_input_raises_value_error(call, message):
    from meshgroups.compat import group_initializer as gi

    with pytest.raises(ValueError, match=message):
        call(gi)


def test_api_surface_matches_the_seed():
    import inspect

    from meshgroups.compat import group_initializer as gi

    assert (gi.CommMode.GLOBAL, gi.CommMode.INTRA_NODE, gi.CommMode.INTER_NODE) == (
        "GLOBAL",
        "INTRA_NODE",
        "INTER_NODE",
    )
    assert issubclass(gi.ParallelMode, gi.CommMode)
    for name in (
        "TRAIN_DATA_PARALLEL",
        "DATA_PARALLEL",
        "TENSOR_PARALLEL",
        "SEQUENCE_PARALLEL",
        "WEIGHT_TRANSFER",
    ):
        assert getattr(gi.ParallelMode, name) == name
    assert inspect.isabstract(gi.ProcessGroupInitializer)
    signatures = {
        "TrainDPGroupInitializer": ["rank", "world_size", "ranks"],
        "IntraNodeGroupInitializer": ["rank", "world_size", "ranks"],
        "WeightTransferGroupInitializer": ["rank", "world_size", "ranks"],
        "DPGroupInitializer": ["rank", "world_size", "data_parallel_size"],
        "TPGroupInitializer": ["rank", "world_size", "tensor_parallel_size"],
        "SPGroupInitializer": ["rank", "world_size", "sequence_parallel_size"],
        "InterNodeGroupInitializer": ["rank", "world_size", "local_world_size"],
    }
    for cls_name, params in signatures.items():
        cls = getattr(gi, cls_name)
        assert issubclass(cls, gi.ProcessGroupInitializer)
        assert list(inspect.signature(cls.__init__).parameters)[1:] == params
        init = inspect.signature(cls.init_dist_group).parameters
        assert (init["backend"].default, init["use_cpu"].default) == ("nccl", False)
    base = inspect.signature(gi.ProcessGroupInitializer._new_and_update_group_info).parameters
    assert list(base) == ["self", "ranks", "use_cpu", "backend"]
    tp = gi.TPGroupInitializer(5, 8, 4)
    assert (tp.rank, tp.world_size, tp.tensor_parallel_size, tp.tensor_parallel_group_num, tp.mode) == (
        5,
        8,
        4,
        2,
        "TENSOR_PARALLEL",
    )
    assert (tp.local_rank, tp.ranks_in_group, tp.process_group, tp.group_world_size) == (None,) * 4
    dp = gi.DPGroupInitializer(1, 8, 2)
    assert (dp.data_parallel_size, dp.process_num_between_dp_rank) == (2, 4)
    sp = gi.SPGroupInitializer(1, 8, 2)
    assert (sp.sequence_parallel_size, sp.sequence_parallel_group_num, sp.mode) == (2, 4, "SEQUENCE_PARALLEL")
    inter = gi.InterNodeGroupInitializer(1, 8, 4)
    assert (inter.local_world_size, inter.node_count, inter.mode) == (4, 2, "INTER_NODE")
    assert gi.TrainDPGroupInitializer(0, 4, [0, 1]).ranks == [0, 1]
    # the layouts, drawable without processes
    assert tp.groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert dp.groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert inter.groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert gi.WeightTransferGroupInitializer(0, 8, [5, 3]).groups() == [[5, 3]]


def test_argument_checks_docstring_examples_run():
    import doctest

    from meshgroups.compat import _initializer_args, group_initializer

    results = [doctest.testmod(m) for m in (_initializer_args, group_initializer)]
    assert all(r.failed == 0 for r in results) and sum(r.attempted for r in results) >= 1
