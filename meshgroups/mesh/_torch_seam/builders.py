"""Which ``MeshGroups`` builds the groups of a mesh: a weak registry of builders by token (pickled
with the meshes, so copies and unpickled meshes in the building process find it) and the
collective-call factory ``_flatten``/``_unflatten`` run in."""

from __future__ import annotations

import itertools
import os
import weakref
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

import torch
import torch.distributed as dist

BackendConfig = tuple["str | None", "object | None"]
GroupBuilder = Callable[
    [Sequence[torch.Tensor], Sequence[str], Sequence[BackendConfig]], Sequence["dist.ProcessGroup | None"]
]
# Live builders by serial, so a copy or an unpickled mesh *in the process that built it* finds
# its MeshGroups; weak, so a mesh nobody holds does not keep its MeshGroups alive.
_BUILDERS: dict[int, weakref.WeakMethod] = {}
_SERIALS = itertools.count(1)


def register_builder(builder: GroupBuilder) -> tuple[int, int]:
    """A token for ``builder`` (a bound method): ``(pid, serial)``, pickled with the meshes."""
    serial = next(_SERIALS)
    _BUILDERS[serial] = weakref.WeakMethod(builder)
    return (os.getpid(), serial)


def unregister_builder(token: tuple[int, int]) -> None:
    _BUILDERS.pop(token[1], None)


def lookup_builder(token: tuple[int, int] | None) -> GroupBuilder | None:
    if token is None or token[0] != os.getpid():
        return None
    ref = _BUILDERS.get(token[1])
    return None if ref is None else ref()


#: ``call(operation)``: the collective call (``meshgroups.mesh._collective``) that ``_flatten`` and
#: ``_unflatten`` run in, numbered before they check anything; set by ``use_collective_calls``.
CallFactory = Callable[[str], AbstractContextManager[object]]
CALL_FACTORIES: list[CallFactory] = []


def use_collective_calls(factory: CallFactory) -> None:
    CALL_FACTORIES[:] = [factory]
