"""Every collective call stays in step, on real gloo processes (world 4): one rank's early error,
wrong argument or skipped call reaches every rank at once, the identical retry pairs up, failed
calls leave no store keys; one module-scoped job runs the numbered cases, a property test draws
one wrong argument on one rank.

Every time is scaled by MESHGROUPS_TEST_TIME_SCALE (``scaled``).
"""

from __future__ import annotations

import pytest

from meshgroups import Layout

from ..support.dist import run, scaled
from ..support.fault_helpers import FLATTEN, LAYOUT, _outcome, verify_groups

pytestmark = pytest.mark.processes  # every test here starts processes

# ------------------------------------------------------------------------------------------------
# Issue 18: every collective call stays in step. One test per numbered case of the issue; each
# worker returns, per check, what this rank saw, and the test asserts it on every rank.
# ------------------------------------------------------------------------------------------------


def _same_error_everywhere(results, key, cls, bad_rank=None, words=()):
    """Every rank raised ``cls`` for ``key``; the others' messages name ``bad_rank`` and ``words``."""
    for rank, out in enumerate(results):
        name, message = out[key]
        assert name == cls, (key, rank, name, message)
        if bad_rank is not None and rank == bad_rank:
            continue  # the failing rank raises its own error, which names the rule
        if bad_rank is not None:
            assert f"rank {bad_rank}" in message, (key, rank, message)
        for word in words:
            assert word in message, (key, rank, word, message)


def worker_in_step(rank, world):
    """Cases 1-5, 7, 8 on one job: each check fails on every rank, then the identical call works."""
    import torch
    import torch.distributed as dist
    from meshgroups.compat import group_initializer as gi
    from meshgroups.compat import parallel_state as ps

    from meshgroups import GroupCache, init_mesh
    from meshgroups.mesh._torch_seam import default_store

    out = {}
    mg = init_mesh(LAYOUT, timeout=scaled(20))

    # -- case 1: an error before anything else, on one rank, reaches every rank at once
    out["c1_megatron"] = _outcome(
        lambda: ps.initialize_model_parallel(tensor_model_parallel_size=3 if rank == 1 else 2)
    )
    ps.initialize_model_parallel(tensor_model_parallel_size=2)  # the identical retry pairs up
    assert ps.get_tensor_model_parallel_group() is not None
    out["c1_megatron_retry"] = dist.get_process_group_ranks(ps.get_tensor_model_parallel_group())
    ps.destroy_model_parallel()
    # issue 52: a tp valid on every rank but different on one is said in Megatron's words
    out["c1_megatron_tp"] = _outcome(
        lambda: ps.initialize_model_parallel(tensor_model_parallel_size=4 if rank == 3 else 2)
    )
    ps.destroy_model_parallel()
    claimed = 0 if rank == 1 else rank  # rank 1 names the wrong rank
    out["c1_legacy"] = _outcome(lambda: gi.TPGroupInitializer(claimed, world, 2).init_dist_group("gloo"))
    out["c1_legacy_retry"] = gi.TPGroupInitializer(rank, world, 2).init_dist_group("gloo")[3]
    gi.reset_group_cache()
    # a constructor refusing its argument on one rank: the others' init_dist_group raises at once
    out["c1_constructor"] = _outcome(
        lambda: gi.TPGroupInitializer(rank, world, 3 if rank == 1 else 2).init_dist_group("gloo")
    )
    out["c1_constructor_retry"] = gi.TPGroupInitializer(rank, world, 2).init_dist_group("gloo")[3]
    gi.reset_group_cache()
    out["c1_flatten"] = _outcome(lambda: mg.flatten("dp", "xx" if rank == 1 else "tp"))
    verify_groups(mg, LAYOUT, rank)
    out["c1_flatten_retry"] = mg.flatten("dp", "tp").mesh.tolist()
    # a skipped call: rank 1 skips the first of two identical calls (different lines)
    if rank != 1:
        out["c1_skip"] = _outcome(lambda: init_mesh(LAYOUT, timeout=scaled(20)).close())
    if rank == 1:
        out["c1_skip"] = _outcome(lambda: init_mesh(LAYOUT, timeout=scaled(20)).close())
    # another operation at the same call number
    out["c1_operation"] = _outcome(
        lambda: init_mesh(LAYOUT, timeout=scaled(20)).close() if rank != 2 else mg.flatten("dp", "tp")
    )
    with init_mesh(LAYOUT, timeout=scaled(20)) as again:  # in step again
        verify_groups(again, LAYOUT, rank)

    # -- case 2: the immediate identical retry after a build failure, same short timeout
    real_new_group = dist.new_group
    for strategy in ("global", "local"):
        calls = {"n": 0}

        def failing_new_group(*args, calls=calls, **kwargs):
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("injected failure in group creation")
            return real_new_group(*args, **kwargs)

        if rank == 1:
            dist.new_group = failing_new_group
        try:
            out[f"c2_{strategy}"] = _outcome(
                lambda s=strategy: init_mesh(LAYOUT, flatten=FLATTEN, timeout=scaled(4), strategy=s)
            )
        finally:
            dist.new_group = real_new_group
        with init_mesh(LAYOUT, flatten=FLATTEN, timeout=scaled(4), strategy=strategy) as retry:
            verify_groups(retry, LAYOUT, rank)
        # and after a mismatch, and after a one-rank error, on this strategy
        out[f"c2_mismatch_{strategy}"] = _outcome(
            lambda s=strategy: init_mesh(LAYOUT, timeout=scaled(4), strategy=s, gloo_twins=rank == 3)
        )
        with init_mesh(LAYOUT, timeout=scaled(4), strategy=strategy) as retry:
            verify_groups(retry, LAYOUT, rank)

    # -- case 3: check= and cache= differing; a set where an order matters
    out["c3_check"] = _outcome(lambda: init_mesh(LAYOUT, timeout=scaled(20), check=rank != 1))
    filled = GroupCache()
    keep = init_mesh(LAYOUT, timeout=scaled(20), cache=filled)
    out["c3_cache"] = _outcome(
        lambda: init_mesh(LAYOUT, timeout=scaled(20), cache=filled if rank == 1 else None)
    )
    keep.close()
    out["c3_set"] = _outcome(lambda: init_mesh(LAYOUT, flatten=[{"dp", "tp"}], timeout=scaled(20)))
    with init_mesh(LAYOUT, flatten=[["dp", "tp"]], timeout=scaled(20)) as retry:
        verify_groups(retry, LAYOUT, rank)

    # -- case 4: flatten's name is an identifier naming no dim (torch's _flatten too)
    for label, name in {
        "dim": "tp",
        "int": 7,
        "nan": float("nan"),
        "object": object(),
        "digit": "1x",
    }.items():
        out[f"c4_{label}"] = _outcome(lambda name=name: mg.flatten("dp", "tp", name=name))
    out["c4_torch"] = _outcome(lambda: mg.mesh["dp", "tp"]._flatten("tp"))
    out["c4_after"] = (mg.mesh["tp"].mesh.tolist(), mg.ranks("tp"), mg.mesh["dp_tp"].mesh.tolist())

    # -- case 5: failed calls leave no store keys behind
    store = default_store()

    def failures(n):
        for i in range(n):
            kind = i % 3
            if kind == 0:  # a one-rank error
                _outcome(lambda i=i: init_mesh(LAYOUT, flatten=[("dp", "xx" if rank == i % world else "tp")]))
            elif kind == 1:  # a mismatch
                _outcome(lambda i=i: init_mesh(LAYOUT, gloo_twins=rank == i % world, timeout=scaled(20)))
            else:  # an error on every rank
                _outcome(lambda: init_mesh(LAYOUT, strategy="eager"))
        dist.barrier()
        keys = len(store.list_keys())
        dist.barrier()  # (before any rank starts the next call)
        return keys

    out["c5_keys"] = (failures(20), failures(980))
    with init_mesh(LAYOUT, timeout=scaled(20)) as after:
        verify_groups(after, LAYOUT, rank)
    dist.barrier()
    out["c5_after_success"] = len(store.list_keys())
    dist.barrier()

    # -- case 7: a device type this torch cannot run
    if not torch.cuda.is_available():
        out["c7_cuda"] = _outcome(lambda: init_mesh(LAYOUT, "cuda", timeout=scaled(20)))

    # -- case 8: a closed mesh's slices never resolve to a newer mesh's groups
    for strategy in ("global", "local"):
        first = init_mesh(LAYOUT, strategy=strategy, timeout=scaled(20))
        old_tp, old_flat = first.mesh["tp"], first.flatten("dp", "tp")
        first.close()
        second = init_mesh(LAYOUT, flatten=FLATTEN, strategy=strategy, timeout=scaled(20))
        new_groups = {second.group("tp"), second.group("dp", "tp")}
        for label, old in (("slice", old_tp), ("flat", old_flat)):
            got = _outcome(old.get_group)
            if got[0] == "ok" and got[1] is dist.group.WORLD:
                got = ("WORLD", "")  # the world's group is nobody's: close() never destroys it
            assert got[0] != "ok" or got[1] not in new_groups, (strategy, label)
            out[f"c8_{strategy}_{label}"] = got[0]
        verify_groups(second, LAYOUT, rank)
        second.close()
    mg.close()
    return out


@pytest.fixture(scope="module")
def in_step():
    """One spawned job for cases 1-5, 7 and 8 (starting processes is the slow part)."""
    return run(worker_in_step, 4, timeout=scaled(500))


@pytest.mark.timeout(600)  # (it starts the module's job)
def test_issue18_case1_one_ranks_early_error_or_skipped_call_reaches_every_rank(in_step):
    results = in_step
    _same_error_everywhere(results, "c1_megatron", results[1]["c1_megatron"][0], bad_rank=1)
    assert results[1]["c1_megatron"][0] not in ("ok", "RendezvousTimeoutError")
    _same_error_everywhere(results, "c1_legacy", "ValueError", bad_rank=1, words=["init_dist_group"])
    _same_error_everywhere(
        results,
        "c1_constructor",
        "ValueError",
        bad_rank=1,
        words=["tensor_parallel_size=3", "init_dist_group"],
    )
    assert results[1]["c1_flatten"][0] in ("LayoutError", "UnknownDimError")
    _same_error_everywhere(results, "c1_flatten", results[1]["c1_flatten"][0], bad_rank=1, words=["'xx'"])
    _same_error_everywhere(results, "c1_skip", "MismatchError", bad_rank=1, words=["call_site"])
    # issue 52: a skipped call is reported as one, not as a different layout
    for _, message in (out["c1_skip"] for out in results):
        assert "A rank skipped a collective call" in message and "pairs different calls" in message, message
    # issue 52: Megatron's argument and both values, not meshgroups' internal layouts
    _same_error_everywhere(
        results,
        "c1_megatron_tp",
        "MismatchError",
        words=["tensor_model_parallel_size=4", "rank 3", "2", "rank 0"],
    )
    for _, message in (out["c1_megatron_tp"] for out in results):
        assert "Layout(" not in message and "dense_opt" not in message, message
    _same_error_everywhere(results, "c1_operation", "MismatchError", words=["init_mesh", "flatten"])
    for rank, out in enumerate(results):  # and the identical retries paired up
        assert out["c1_megatron_retry"] == [rank // 2 * 2, rank // 2 * 2 + 1]
        assert out["c1_legacy_retry"] == [rank // 2 * 2, rank // 2 * 2 + 1]
        assert out["c1_constructor_retry"] == [rank // 2 * 2, rank // 2 * 2 + 1]
        assert out["c1_flatten_retry"] == [0, 1, 2, 3]


def test_issue18_case2_the_immediate_retry_after_a_failure_works(in_step):
    for rank, out in enumerate(in_step):  # (the retries' groups were verified in the job)
        for strategy in ("global", "local"):
            name, message = out[f"c2_{strategy}"]
            assert name == "MeshBuildError" and "failed on rank 1" in message, (rank, message)
            assert out[f"c2_mismatch_{strategy}"][0] == "MismatchError"


def test_issue18_case3_check_and_cache_compared_sets_refused(in_step):
    _same_error_everywhere(in_step, "c3_check", "MeshConfigError", bad_rank=1, words=["check=False"])
    _same_error_everywhere(in_step, "c3_cache", "MismatchError", words=["'cache'", "rank 1"])
    _same_error_everywhere(in_step, "c3_set", "TypeError", words=["no defined order"])


def test_issue18_case4_flatten_names_are_identifiers_naming_no_dim(in_step):
    _same_error_everywhere(in_step, "c4_dim", "MeshConfigError", words=["'tp'"])
    for label in ("int", "nan", "object"):
        _same_error_everywhere(in_step, f"c4_{label}", "TypeError")
    _same_error_everywhere(in_step, "c4_digit", "MeshConfigError", words=["identifier"])
    _same_error_everywhere(in_step, "c4_torch", "ValueError", words=["'tp'"])
    for rank, out in enumerate(in_step):
        tp_mesh, tp_ranks, flat = out["c4_after"]
        assert tp_mesh == tp_ranks == [rank // 2 * 2, rank // 2 * 2 + 1] and flat == [0, 1, 2, 3]


def test_issue18_case5_failed_calls_leave_no_store_keys(in_step):
    for rank, out in enumerate(in_step):
        after_20, after_1000 = out["c5_keys"]  # keys after 20 failed calls, and after 1,000
        assert after_1000 == after_20, (rank, after_20, after_1000)
        assert out["c5_after_success"] <= after_20, (rank, out["c5_after_success"], after_20)


def test_issue18_case7_a_device_type_torch_cannot_run(in_step):
    if "c7_cuda" not in in_step[0]:
        pytest.skip("this torch can run cuda")
    _same_error_everywhere(in_step, "c7_cuda", "DeviceTypeError", words=["'cuda'"])


def test_issue18_case8_a_closed_meshs_slices_never_resolve_to_new_groups(in_step):
    for out in in_step:
        assert out["c8_global_slice"] == out["c8_local_slice"] == "RuntimeError", out
        assert out["c8_local_flat"] in ("RuntimeError", "WORLD") and out["c8_global_flat"] == "WORLD", out


def worker_property(rank, world, trials, seed):
    """A random wrong argument of a random entry point on a random rank: what each rank raised,
    then the identical call on every rank (which must work)."""
    import random

    from meshgroups.compat import group_initializer as gi
    from meshgroups.compat import parallel_state as ps

    from meshgroups import init_mesh

    mg = init_mesh(LAYOUT, timeout=scaled(30))
    entry_points = {
        "init_mesh": (
            lambda **kw: init_mesh(**{"layout": LAYOUT, "flatten": FLATTEN, "timeout": 30, **kw}).close(),
            [
                {"layout": {"dp": 4}},
                {"layout": Layout(dp=4, tp=1)},
                {"flatten": [("dp", "xx")]},
                {"flatten": [{"dp", "tp"}]},
                {"timeout": -1},
                {"strategy": "eager"},
                {"strategy": "local"},
                {"device_type": "tpu"},
                {"gloo_twins": "no"},
                {"check": False},
                {"cache": "x"},
                {"backend": "glo"},
                {"subsets": [("x", LAYOUT)]},
            ],
        ),
        "flatten": (
            lambda dims=("dp", "tp"), **kw: mg.flatten(*dims, **kw),
            [{"dims": ("dp", "xx")}, {"name": "tp"}, {"name": 7}, {"dims": ()}, {"name": "other"}],
        ),
        "_flatten": (
            lambda name="dp_tp", **kw: mg.mesh["dp", "tp"]._flatten(name, **kw),
            [{"name": "tp"}, {"name": 7}, {"name": "1x"}],
        ),
        "initialize_model_parallel": (
            lambda **kw: (
                ps.initialize_model_parallel(**{"tensor_model_parallel_size": 2, **kw}),
                ps.destroy_model_parallel(),
            ),
            [
                {"tensor_model_parallel_size": 3},
                {"tensor_model_parallel_size": 1},
                {"pipeline_model_parallel_size": 0},
                {"order": "tp-xx"},
                {"use_sharp": True},
                {"bogus": 1},
            ],
        ),
        "init_dist_group": (
            lambda cls=gi.TPGroupInitializer, me=rank, backend="gloo": (
                cls(me, world, 2).init_dist_group(backend),
                gi.reset_group_cache(),
            ),
            [{"me": (rank + 1) % world}, {"cls": gi.DPGroupInitializer}, {"backend": "glo"}],
        ),
    }
    rnd = random.Random(seed)  # the same draws on every rank
    seen = []
    order: list[str] = []
    for _ in range(trials):
        if not order:  # every entry point once per round, in a random order
            order = sorted(entry_points)
            rnd.shuffle(order)
        name = order.pop()
        call, variants = entry_points[name]
        variant, bad_rank = rnd.choice(variants), rnd.randrange(world)
        got = _outcome(
            lambda call=call, variant=variant, bad_rank=bad_rank: call(
                **(variant if rank == bad_rank else {})
            )
        )
        retry = _outcome(call)
        seen.append((name, repr(variant), bad_rank, got[0], retry[0], got[1] if got[0] != "ok" else ""))
    verify_groups(mg, LAYOUT, rank)
    mg.close()
    return seen


def test_issue18_property_one_wrong_argument_on_one_rank():
    trials = 25
    results = run(worker_property, 4, trials, 18, timeout=scaled(240))
    for i in range(trials):
        name, variant, bad_rank = results[0][i][:3]
        classes = {rank: out[i][3] for rank, out in enumerate(results)}
        # the same class on every rank, an error (never a silent success), never a wait that ran out
        assert len(set(classes.values())) == 1, (name, variant, bad_rank, classes, results[0][i])
        assert classes[0] not in ("ok", "RendezvousTimeoutError", "MeshBuildError"), (name, variant, classes)
        for rank, out in enumerate(results):
            assert out[i][4] == "ok", (name, variant, bad_rank, rank, out[i])  # the identical retry
            if rank != bad_rank and classes[0] != "MismatchError":
                assert f"rank {bad_rank}" in out[i][5], (name, variant, rank, out[i][5])
    assert len({r[0] for r in results[0]}) == 5  # every entry point was drawn
