"""Hostile input that needs a process group (issue 18, case 10): slicing the root mesh with a
non-string name, and a Megatron timeout that would overflow ``timedelta``. Only typed errors,
also the class torch / Megatron raise, and the next good call still works."""

from __future__ import annotations

import pytest

from tests.support.dist import run

pytestmark = pytest.mark.processes  # every test here starts processes


def _worker(rank: int, world: int) -> bool:
    from meshgroups.compat import parallel_state as ps

    from meshgroups import Layout, init_mesh
    from meshgroups.errors import UnknownDimError

    mg = init_mesh(Layout(dp=2, tp=2))
    for bad in (b"2", 7, ["dp", 3], ("dp", 3)):  # a list of names slices like a tuple (torch)
        try:
            mg.mesh[bad]
        except UnknownDimError as exc:  # torch raises KeyError here; ours is also a ValueError
            assert isinstance(exc, KeyError) and isinstance(exc, ValueError), exc
            assert repr(bad) in str(exc), exc
        else:
            raise AssertionError(f"mesh[{bad!r}] was accepted")
    assert mg.mesh["dp"].size() == 2 and mg.mesh["dp", "tp"] is mg.mesh and mg.mesh[["dp", "tp"]] is mg.mesh
    for bad in (2**63, 0, -1):
        try:
            ps.initialize_model_parallel(2, distributed_timeout_minutes=bad)
        except AssertionError as exc:  # Megatron's class, and meshgroups' ValueError
            assert isinstance(exc, ValueError) and str(bad) in str(exc), exc
        else:
            raise AssertionError(f"distributed_timeout_minutes={bad} was accepted")
    ps.initialize_model_parallel(2)  # the identical good call right after works
    assert ps.get_tensor_model_parallel_world_size() == 2
    ps.destroy_model_parallel()
    mg.close()
    return True


def test_hostile_slicing_and_megatron_timeout_world4() -> None:
    assert run(_worker, 4) == [True] * 4
