"""Typed errors of meshgroups, one module so the layout core and the torch bridge share them.

Each subclasses the builtin that callers already catch (``ValueError``, ``TimeoutError``,
``RuntimeError``), so existing ``except ValueError`` clauses keep working while new code can
tell a bad layout from a cross-rank mismatch or a rank that never arrived::

    >>> from meshgroups import Layout
    >>> try:
    ...     Layout(pp=2, tp=3, world_size=16)
    ... except LayoutError as exc:
    ...     print(exc)
    pp=2 × tp=3 = 6 does not match world_size=16

Every error class of meshgroups lives here (compat's Megatron-named ones aside, in
``meshgroups.compat``), each named ``...Error``. Nothing here imports torch.
"""

from __future__ import annotations


class LayoutError(ValueError):
    """A layout, or an argument about a layout, breaks a rule (size, name, rank, index)::

    >>> from meshgroups import Layout
    >>> try:
    ...     Layout(dp=2, tp=0)
    ... except LayoutError as exc:
    ...     print(exc)
    tp=0: dim sizes must be positive integers
    """


class RecoveryError(LayoutError):
    """A recovery plan (``plan_shrink``, ``plan_substitute``, ``plan_grow`` of
    ``meshgroups.elastic``) cannot be made from these arguments: the lost ranks hit every replica,
    a rank is not in the layout, too few spares, an unknown dim, ...::

    >>> from meshgroups import Layout
    >>> from meshgroups.elastic import plan_shrink
    >>> try:  # doctest: +ELLIPSIS
    ...     plan_shrink(Layout(dp=2, tp=2), lost=[0, 2])  # a rank of each dp replica
    ... except RecoveryError as exc:
    ...     print(exc)
    the lost ranks hit every replica of dp (dp=2: indices 0, 1 each hold a lost rank); ...
    """


class MeshConfigError(ValueError):
    """An ``init_mesh`` argument is invalid on this rank (found before any collective)::

    >>> import torch.distributed as dist
    >>> from torch.testing._internal.distributed.fake_pg import FakeStore
    >>> from meshgroups import Layout, init_mesh
    >>> dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)  # one rank of 8
    >>> try:
    ...     init_mesh(Layout(dp=2, tp=4), timeout=-1)
    ... except MeshConfigError as exc:
    ...     print(exc)
    timeout=-1 must be a positive number of seconds up to 604800
    >>> dist.destroy_process_group()
    """


class MismatchError(ValueError):
    """Ranks called ``init_mesh`` with different arguments; raised on every rank alike.

    Attributes:
        argument: the name of the first argument that differs (``"layout"``, ``"flatten"``, ...).
        ranks: the ranks whose value differs from rank 0's (as far as they were seen).

    Args:
        message: what differs, naming the ranks and both values.
        argument: see Attributes.
        ranks: see Attributes.

    Raised by ``init_mesh`` on every rank; here built by hand::

        >>> exc = MismatchError("rank 3 passed flatten=[('dp', 'tp')], rank 0 flatten=[]", "flatten", (3,))
        >>> exc.argument, exc.ranks, isinstance(exc, ValueError)
        ('flatten', (3,), True)
    """

    def __init__(self, message: str, argument: str = "", ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.argument = argument
        self.ranks = ranks


class RendezvousTimeoutError(TimeoutError):
    """Some rank never reached (or reached too late) the cross-rank check of ``init_mesh``;
    a ``TimeoutError``, so code that catches torch's timeouts catches it::

        >>> issubclass(RendezvousTimeoutError, TimeoutError)
        True
    """


class StoreConnectionError(RuntimeError):
    """The connection to the rendezvous store was lost (e.g. the store's host, rank 0, died)::

    >>> try:
    ...     raise StoreConnectionError("the store at 10.0.0.1:29500 is gone (rank 0 died?)")
    ... except RuntimeError as exc:
    ...     print(type(exc).__name__)
    StoreConnectionError
    """


class MeshBuildError(RuntimeError):
    """Some rank failed while creating the groups of an ``init_mesh`` call; raised on every rank
    after each destroyed what that call had created, so the same call can simply be retried::

        >>> def build_with_one_retry(build):
        ...     try:
        ...         return build()
        ...     except MeshBuildError:  # every rank lands here alike
        ...         return build()
        >>> build_with_one_retry(lambda: "built")
        'built'
    """


class RanksGoneError(RendezvousTimeoutError, MeshBuildError):
    """Ranks a collective call waits for have exited or stopped responding (their heartbeat
    in the store stopped: SIGKILL, SIGSTOP, a lost host); raised on every waiting rank alike,
    within seconds, instead of at the timeout. Also a ``RendezvousTimeoutError`` (the wait
    ended) and a ``MeshBuildError`` (the call built nothing), so clauses for those catch it.

    Args:
        message: what was waited for and who is gone.
        ranks: the ranks gone (attribute ``ranks``, in increasing order).
        states: how each went (attribute): ``"exited"`` or ``"stopped responding (...)"``.

    >>> RanksGoneError("rank 0: rank 3 exited", (3,), {3: "exited"}).states
    {3: 'exited'}
    """

    def __init__(
        self, message: str, ranks: tuple[int, ...] = (), states: dict[int, str] | None = None
    ) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)
        self.states = dict(states or {})


class ConcurrentInitError(RuntimeError):
    """``init_mesh`` was called from a second thread while another call was in progress::

    >>> issubclass(ConcurrentInitError, RuntimeError)
    True
    """


class StepFailedError(RuntimeError):
    """A guarded training step failed on some rank (``Elastic.step()``); raised on every live
    rank alike once the ranks agreed who is still alive.

    Args:
        message: what failed, naming the lost ranks or the cause.
        lost, epoch, survivors, cause: the attributes below.

    Attributes:
        lost: the ranks the verdict declared lost (empty: every rank is alive, the step failed
            for another reason, ``cause`` says which). epoch: the verdict's epoch. survivors:
            the live ranks. cause: the first failure a rank published (``"rank r: Class: msg"``).

    Raised by ``Elastic.step()``; here built by hand::

        >>> exc = StepFailedError("step 7 failed", epoch=0, survivors=(0, 1), cause="rank 1: OSError: disk")
        >>> exc.lost, exc.cause
        ((), 'rank 1: OSError: disk')
    """

    def __init__(
        self,
        message: str,
        lost: tuple[int, ...] = (),
        epoch: int = 0,
        survivors: tuple[int, ...] = (),
        cause: str = "",
    ) -> None:
        super().__init__(message)
        self.lost, self.epoch, self.survivors, self.cause = lost, epoch, survivors, cause


class RanksLostError(StepFailedError):
    """Ranks died (or hung past the verdict's timeout): ``lost`` names them, on every survivor.

    Args:
        message, lost, epoch, survivors, cause: as :class:`StepFailedError`.

    Raised by ``Elastic.step()`` on every survivor; here built by hand::

        >>> exc = RanksLostError("ranks [3] lost", lost=(3,), epoch=1, survivors=(0, 1, 2))
        >>> isinstance(exc, StepFailedError), exc.lost, exc.survivors
        (True, (3,), (0, 1, 2))
    """


class ExcludedError(RuntimeError):
    """This rank was declared lost by the verdict (it reported after the decision, or never
    reported while it hung); it must not take part in the survivors' collectives. Exit, or
    wait to be re-admitted as a spare::

        >>> try:
        ...     raise ExcludedError("rank 3 was declared lost at epoch 1")
        ... except ExcludedError as exc:
        ...     print("leaving:", exc)
        leaving: rank 3 was declared lost at epoch 1
    """


class TransferError(RuntimeError):
    """A transfer failed on some rank; raised on every rank of the status group alike.

    Attributes:
        ranks: the ranks that failed. bucket: the bucket it happened in (0-based; ``-1``: the
            check before the first). stage: ``"check"``, ``"prepare"`` (nothing of the bucket
            moved yet), ``"transfer"`` or ``"progress"`` (the bucket is complete). done: weights
            complete on every rank before the failure (the others may be partly written).

    Args:
        message: what failed, naming the ranks and their reasons, the bucket and the stage.
        ranks: see Attributes.
        bucket: see Attributes.
        stage: see Attributes.
        done: see Attributes.

    Raised by ``execute`` and ``WeightSync.sync`` on every rank alike; here built by hand::

        >>> exc = TransferError("rank 5 failed: out of memory", (5,), bucket=2, stage="transfer", done=("wq",))
        >>> exc.ranks, exc.stage, exc.done
        ((5,), 'transfer', ('wq',))
    """

    def __init__(self, message: str, ranks: tuple[int, ...], bucket: int, stage: str, done: tuple[str, ...]):
        super().__init__(message)
        self.ranks, self.bucket, self.stage, self.done = ranks, bucket, stage, done


class PlanError(LayoutError):
    """The plan breaks one of its guarantees (coverage exactly once); a bug, never silent.
    A ``LayoutError``, so ``except ValueError`` catches it::

        >>> issubclass(PlanError, ValueError)
        True
    """


class TorchInternalsError(ImportError):
    """This torch lacks a private piece meshgroups' torch seam relies on, sets a field the seam
    does not know, or behaves differently from what the seam's self-test expects. An
    ``ImportError``, as for any missing piece of an installed package; its message names the
    torch version, what differs and the tested versions::

        >>> issubclass(TorchInternalsError, ImportError)
        True
    """


class StepAbortedError(RuntimeError):
    """``commit`` saw a failure (published, or a member's heartbeat stopped): the step must not
    be applied; ``Elastic.step()`` turns it into the verdict::

        >>> issubclass(StepAbortedError, RuntimeError)
        True
    """


class VersionError(ValueError):
    """A sync was asked for a version that is not newer than the one the engine serves, or
    trainer ranks asked for different versions; raised on every trainer rank alike, before
    any byte moves. The engine keeps serving what it served, and the sync object stays usable::

        >>> try:
        ...     raise VersionError("version 3 is not newer than the engine's 5")
        ... except ValueError as exc:  # the sync stays usable: ask for a newer version
        ...     print(type(exc).__name__, exc)
        VersionError version 3 is not newer than the engine's 5
    """


class ClosedError(RuntimeError):
    """An object that holds process groups (``MeshGroups``, ``Elastic``, ``Job``,
    ``TransferGroups``, ``WeightSync``, ...) was used after ``close()``; build a new one::

    >>> import torch.distributed as dist
    >>> from torch.testing._internal.distributed.fake_pg import FakeStore
    >>> from meshgroups import Layout, init_mesh
    >>> dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)  # one rank of 8
    >>> mg = init_mesh(Layout(dp=2, tp=4))
    >>> mg.close()  # the number of groups it destroyed
    2
    >>> try:
    ...     mg.group("tp")
    ... except ClosedError as exc:
    ...     print(exc)
    this MeshGroups was closed (group() needs it open): build a new one
    >>> dist.destroy_process_group()
    """


# Errors that are also the class torch raises for the same misuse, so code written against
# torch (``except RuntimeError`` around ``init_device_mesh``, ``except KeyError`` around
# ``mesh["nope"]``) catches meshgroups' error too, which keeps its own, clearer message and
# quotes torch's sentence for the misuse after it (``torch_says``), so a match on torch's text
# (``assertRaisesRegex(RuntimeError, "Each mesh_dim_name must be unique.")``) matches ours.


def torch_says(message: str, torch_sentence: str) -> str:
    """meshgroups' ``message`` followed by torch 2.13's own sentence for the same misuse::

        >>> torch_says("duplicate dim name 'dp'", "Each mesh_dim_name must be unique.")
        "duplicate dim name 'dp' [torch: Each mesh_dim_name must be unique.]"

    Args:
        message: meshgroups' explanation (the value and the rule).
        torch_sentence: torch's text, verbatim (with torch's values filled in).

    Returns:
        The message an error raises.
    """
    return f"{message} [torch: {torch_sentence}]"


class DuplicateNameError(LayoutError, RuntimeError):
    """Names repeat (``mesh_dim_names``, dims of a slice); torch raises ``RuntimeError``::

    >>> from meshgroups import Layout
    >>> import numpy as np
    >>> try:
    ...     Layout.from_grid(np.arange(4).reshape(2, 2), ("dp", "dp"))
    ... except RuntimeError as exc:
    ...     print(type(exc).__name__, isinstance(exc, ValueError))
    DuplicateNameError True
    """


class NameCountError(LayoutError, RuntimeError):
    """The number of names differs from the number of dims (``init_device_mesh(mesh_shape=(8,),
    mesh_dim_names=("dp", "tp"))``); torch raises ``RuntimeError``::

    >>> from meshgroups import Layout
    >>> try:  # doctest: +ELLIPSIS
    ...     Layout.from_grid([[0, 1], [2, 3]], ("dp",))
    ... except RuntimeError as exc:
    ...     print(type(exc).__name__, exc)
    NameCountError grid has 2 dims but 1 names were given: ('dp',); give one name per dim [torch: ...]
    """


class UnknownDimError(LayoutError, KeyError):
    """A dim name the layout does not have; torch raises ``KeyError`` (``mesh["nope"]``)::

    >>> from meshgroups import Layout
    >>> try:
    ...     Layout(dp=2, tp=2).groups("xp")
    ... except KeyError as exc:
    ...     print(type(exc).__name__, exc)
    UnknownDimError unknown dim 'xp'; dims of this layout are dp, tp
    """

    __str__ = BaseException.__str__  # the message as written, not KeyError's repr of it


class DeviceTypeError(MeshConfigError, RuntimeError):
    """``device_type`` carries an index (``"cpu:0"``) or is no device type; torch raises
    ``RuntimeError``::

    >>> import torch.distributed as dist
    >>> from torch.testing._internal.distributed.fake_pg import FakeStore
    >>> from meshgroups import Layout, init_mesh
    >>> dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)  # one rank of 8
    >>> try:  # doctest: +ELLIPSIS
    ...     init_mesh(Layout(dp=2, tp=4), device_type="cpu:0")
    ... except RuntimeError as exc:
    ...     print(type(exc).__name__, exc)
    DeviceTypeError device_type='cpu:0': give the device type only, e.g. 'cpu' or 'cuda' [torch: ...]
    >>> dist.destroy_process_group()
    """


class WorldSizeError(MeshConfigError, RuntimeError):
    """A layout needs ranks outside the default group's world; torch raises ``RuntimeError``
    (``Mesh should not be bigger than default world size``)::

    >>> import torch.distributed as dist
    >>> from torch.testing._internal.distributed.fake_pg import FakeStore
    >>> from meshgroups import Layout, init_mesh
    >>> dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)  # one rank of 8
    >>> try:  # doctest: +ELLIPSIS
    ...     init_mesh(Layout(dp=4, tp=4))  # 16 ranks in a world of 8
    ... except RuntimeError as exc:
    ...     print(type(exc).__name__, exc)
    WorldSizeError group ('dp',) uses rank 15, outside the default group's world (ranks 0..7); ...
    >>> dist.destroy_process_group()
    """


class BackendOverrideError(MeshConfigError, RuntimeError):
    """``backend_override`` names a dim twice (by name and index) or a dim that does not exist;
    torch raises ``RuntimeError``::

    >>> import torch.distributed as dist
    >>> from torch.testing._internal.distributed.fake_pg import FakeStore
    >>> from meshgroups import Layout, init_mesh
    >>> dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)  # one rank of 8
    >>> try:  # doctest: +ELLIPSIS
    ...     init_mesh(Layout(dp=2, tp=4), backend_override={"xp": "gloo"})
    ... except RuntimeError as exc:
    ...     print(type(exc).__name__, exc)
    BackendOverrideError backend_override keys ['xp'] name no dim, declared flattened dim or subset ...
    >>> dist.destroy_process_group()
    """


__all__ = [
    "BackendOverrideError",
    "ClosedError",
    "ConcurrentInitError",
    "DeviceTypeError",
    "DuplicateNameError",
    "ExcludedError",
    "LayoutError",
    "MeshBuildError",
    "MeshConfigError",
    "MismatchError",
    "NameCountError",
    "PlanError",
    "RanksGoneError",
    "RanksLostError",
    "RecoveryError",
    "RendezvousTimeoutError",
    "StepAbortedError",
    "StepFailedError",
    "StoreConnectionError",
    "TorchInternalsError",
    "TransferError",
    "UnknownDimError",
    "VersionError",
    "WorldSizeError",
    "torch_says",
]


def __getattr__(name: str) -> object:
    # the names before the ``Error`` suffix (0.3, 0.4), served with a warning by the table
    from meshgroups import _deprecated

    return _deprecated.old_name(__name__, name)
