"""A transfer world: one process group over ranks of *separate* ``torch.distributed`` worlds.

An RL trainer runs in its own world (torchrun) and an inference engine's workers in theirs
(vLLM's); neither may be re-initialised for the other. A :class:`TransferWorld` is a third,
side world over both, rendezvoused at a ``host:port`` TCP store that one member (trainer rank 0)
hosts and publishes: each member joins with its rank in the transfer world (trainer ranks first,
then the engine's workers at an offset). Its process group is built directly — a
``ProcessGroup`` with a ``ProcessGroupGloo`` backend (and ``ProcessGroupNCCL`` for CUDA tensors,
untested here) over a ``PrefixStore`` of that store — so neither world's default group is
created, destroyed or changed by it (``TransferWorld``'s docstring shows one).

**Why ``active()``.** ``meshgroups.transfer.execute`` (and the collective protocol of
``WeightSync`` / ``TransferGroups``) address ranks through ``dist.get_rank()`` and the default
group and store, with no parameter for another world's rank. Rather than a second copy of the
transfer, ``active()`` makes the transfer world the process's *default* world for the duration
of the block — the default group, the registry entries torch keeps for it, torch's group-name
counter and meshgroups' call numbering — and puts every one of them back when the block ends
(also on an exception). Inside, ``WeightSync``, ``TransferGroups`` and ``execute`` run unchanged:
the plan, fusion, casts, checks, failures and counters are theirs. Groups created inside
(``TransferGroups``) belong to the transfer world and are only used inside ``active()``. The
block must not run collectives of the process's own world (none of ``WeightSync`` does), and no
other thread may use ``torch.distributed`` meanwhile.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch.distributed as dist

from meshgroups._lifecycle import Closeable
from meshgroups.errors import MeshConfigError, StoreConnectionError
from meshgroups.mesh import (
    MeshOptions,
    call_numbering,
    default_world,
    merge_options,
    register_world,
    set_call_numbering,
    set_default_world,
    standalone_group,
    unregister_world,
    use_cohort,
)

#: Group names of transfer worlds start here: torch registers every group by name, and a
#: transfer world's sequential names (``new_group``) must never equal a name of the process's
#: own world, whose counter starts at 0 (the same offset on every member, so names agree).
NAME_BASE = 1 << 40
#: Group names per transfer world (one range per store port, below ``NAME_BASE``).
PORT_RANGE = 1 << 24

_lock = threading.Lock()


def parse_address(address: str) -> tuple[str, int]:
    """``"host:port"`` -> ``(host, port)``.

    >>> parse_address("127.0.0.1:29500")
    ('127.0.0.1', 29500)

    Args:
        address: ``host:port`` (an IPv6 host in brackets: ``[::1]:29500``).

    Returns:
        The host and the port.

    Raises:
        MeshConfigError: not ``host:port`` with a port in 1..65535.
    """
    if not isinstance(address, str) or ":" not in address:
        raise MeshConfigError(f"address={address!r} must be 'host:port'")
    host, _, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise MeshConfigError(f"address={address!r} must be 'host:port' with a port in 1..65535")
    return host, int(port)


def _timedelta(timeout: timedelta | float | None) -> timedelta:
    if timeout is None:
        return timedelta(seconds=300)
    if isinstance(timeout, timedelta):
        return timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise MeshConfigError(f"timeout={timeout!r} must be a positive number of seconds or a timedelta")
    return timedelta(seconds=float(timeout))


class TransferWorld(Closeable):
    """This process's membership of a transfer world: one process group over ranks of separate
    ``torch.distributed`` worlds (an RL trainer's and an inference engine's workers'),
    rendezvoused at a ``host:port`` TCP store that trainer rank 0 hosts; neither world's default
    group is created, destroyed or changed by it. In a job (trainer ranks 0-3, the engine's
    workers 4-5)::

        store = TransferWorld.serve()                  # trainer rank 0: publish store's address
        world = TransferWorld(store, rank=0, size=6)   # blocks until all 6 have joined
        world = TransferWorld.join(address, rank=4, size=6)  # engine worker 0
        with world.active():                           # meshgroups runs in the transfer world
            sync = WeightSync(...)

    A world of one member, in this process::

        >>> import torch
        >>> import torch.distributed as dist
        >>> from meshgroups.engines import TransferWorld
        >>> with TransferWorld(TransferWorld.serve(), rank=0, size=1) as world:
        ...     with world.active():  # the default world inside the block only
        ...         x = torch.ones(2)
        ...         dist.all_reduce(x)
        ...         dist.get_rank(), dist.get_world_size(), x.tolist()
        (0, 1, [1.0, 1.0])
        >>> dist.is_initialized()  # this process's own world: untouched (here: none)
        False

    Args:
        store: the rendezvous store (a ``TCPStore``; the host's or a client of it).
        rank: this member's rank in the transfer world.
        size: the transfer world's size.
        timeout: bounds the rendezvous and every collective of the group (default 300 s).
        generation: a new generation is a new group on the same store (after a failure broke
            the last one); every member passes the same.
        device_type: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL as well; untested here).
        options: a ``MeshOptions`` instead of ``timeout`` and ``device_type`` (its timeout and
            device type are used; giving both is a ``TypeError``).

    Attributes:
        group: the transfer world's process group (``None`` after ``close()``).
        address: ``host:port`` of the store.
        rank, size, generation: as passed.

    ``TransferWorld.serve()`` hosts the store (rank 0); the others :meth:`join` its address.

    Raises:
        MeshConfigError: a rank outside ``[0, size)``, a bad timeout or device type.
        StoreConnectionError: the group could not be rendezvoused within ``timeout``.
    """

    def __init__(
        self,
        store: dist.TCPStore,
        rank: int,
        size: int,
        *,
        timeout: timedelta | float | None = None,
        generation: int = 0,
        device_type: str = "cpu",
        options: MeshOptions | None = None,
    ) -> None:
        given, refusal = merge_options(options, MeshOptions(device_type=device_type, timeout=timeout))
        if refusal is not None:  # before the rendezvous: nothing waits on this member yet
            raise TypeError(refusal)
        device_type, timeout = given.device_type, given.timeout
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise MeshConfigError(f"size={size!r} must be an int >= 1 (trainer ranks + engine workers)")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
            raise MeshConfigError(f"rank={rank!r} must be an int in [0, {size}) (size={size})")
        if device_type not in ("cpu", "cuda"):
            raise MeshConfigError(f"device_type={device_type!r} must be 'cpu' (gloo) or 'cuda' (NCCL)")
        self.store, self.rank, self.size = store, rank, size
        self.timeout = _timedelta(timeout)
        self.generation, self.device_type = generation, device_type
        self.address = f"{store.host}:{store.port}"
        prefix = dist.PrefixStore(f"meshgroups/world/{generation}/", store)
        self._name = f"meshgroups-transfer-{generation}-{store.port}"
        try:
            self.group: dist.ProcessGroup | None = standalone_group(
                prefix, rank, size, self.timeout, self._name, device_type
            )
        except (RuntimeError, dist.DistError) as exc:
            raise StoreConnectionError(
                f"transfer world {self.address} (generation {generation}): rank {rank} of {size} could not "
                f"rendezvous within {self.timeout} ({type(exc).__name__}: {exc}); every member must join "
                "with its own rank and the same size"
            ) from exc
        self._store = prefix
        # torch's group-name counter inside this world: the same on every member, and a range of
        # its own per (generation, store port), so two worlds in one process (a trainer syncing
        # into two engines) never name two groups alike
        self._count = NAME_BASE * (generation + 1) + store.port * PORT_RANGE
        self._collective = call_numbering(fresh=True)
        self._registered = False

    @classmethod
    def serve(
        cls, *, host: str = "127.0.0.1", port: int = 0, timeout: timedelta | float | None = None
    ) -> dist.TCPStore:
        """Only host the store (no group yet): its address can be published before the members
        join, e.g. to an engine whose workers join while rank 0 is blocked in the rendezvous.

        Args:
            host: the address the other members reach this host at.
            port: the store's port (0: any free one).
            timeout: the store's timeout.

        Returns:
            The store (``f"{store.host}:{store.port}"`` is its address).
        """
        return dist.TCPStore(host, port, is_master=True, timeout=_timedelta(timeout), wait_for_workers=False)

    @classmethod
    def join(
        cls,
        address: str,
        rank: int,
        size: int,
        *,
        timeout: timedelta | float | None = None,
        generation: int = 0,
        device_type: str = "cpu",
    ) -> TransferWorld:
        """A member other than the host: connect to the store at ``address`` and join.

        Args:
            address: ``host:port`` the host published.
            rank: this member's rank in the transfer world.
            size: the transfer world's size.
            timeout: as for the constructor.
            generation: as for the constructor.
            device_type: as for the constructor.

        Returns:
            The transfer world.

        Raises:
            StoreConnectionError: no store at ``address`` within ``timeout``.
        """
        host, port = parse_address(address)
        wait = _timedelta(timeout)
        try:
            store = dist.TCPStore(host, port, is_master=False, timeout=wait)
        except (RuntimeError, dist.DistError) as exc:
            raise StoreConnectionError(
                f"no transfer-world store at {address} within {wait} ({type(exc).__name__}: {exc}); "
                "the host (trainer rank 0) publishes it"
            ) from exc
        return cls(store, rank, size, timeout=wait, generation=generation, device_type=device_type)

    # ------------------------------------------------------------------ the switch
    def _register(self) -> None:
        """torch's registry entries for this group, as for a default group; kept until ``close()``."""
        if self.group is None:
            raise RuntimeError(f"transfer world {self.address} (generation {self.generation}) was closed")
        register_world(self.group, self._store, self._name, self.device_type)
        self._registered = True

    @contextmanager
    def active(self) -> Iterator[TransferWorld]:
        """Make this world the process's default world inside the block — the default group,
        torch's registry entries for it, its group-name counter and meshgroups' call numbering —
        so ``WeightSync``, ``TransferGroups`` and ``execute`` run in it unchanged; everything is
        restored when it ends (also on an exception). Not reentrant, one thread at a time; the
        block must not run collectives of the process's own world. See ``TransferWorld``.

        Yields:
            This world.

        Raises:
            RuntimeError: the world was closed, or another world is active in this process.
        """
        if self.group is None:
            raise RuntimeError(f"transfer world {self.address} (generation {self.generation}) was closed")
        if not _lock.acquire(blocking=False):
            raise RuntimeError("another transfer world is active in this process (active() is not reentrant)")
        saved_pg, saved_count = default_world()
        saved_calls = call_numbering()
        try:
            if not self._registered:
                self._register()
            set_default_world(self.group, self._count)
            set_call_numbering(self._collective)
            with use_cohort(None):  # a cohort of the process's own world means nothing here
                yield self
        finally:
            self._count = default_world()[1]
            self._collective = call_numbering()
            set_call_numbering(saved_calls)
            set_default_world(saved_pg, saved_count)
            _lock.release()

    def _release(self) -> int:
        # close(): forget the group: its registry entries go, its connections close when the
        # last reference does. Groups made inside active() (TransferGroups) are their owner's
        # to close, before this.
        if self.group is None:
            return 0
        if self._registered:
            unregister_world(self.group)
        self.group = None
        return 1

    def __enter__(self) -> TransferWorld:
        return self

    def __repr__(self) -> str:
        return (
            f"TransferWorld({self.address}, rank={self.rank}, size={self.size}, generation={self.generation})"
        )


__all__ = ["NAME_BASE", "PORT_RANGE", "TransferWorld", "parse_address"]
