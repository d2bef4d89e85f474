"""Run a function on N real gloo processes (spawned, 127.0.0.1, free port), with a hard timeout.

Starting processes is the slow part (each imports torch), so each test runs many checks in one
job. A worker returns a picklable result; an exception in any rank fails the test with that
rank's traceback; a job that outlives ``timeout`` is killed and fails instead of hanging CI.

Waits scale with MESHGROUPS_TEST_TIME_SCALE (see ``tests/support/timing.py``): :func:`run` scales its job
timeout and the default group's timeout itself; tests scale their own waits with ``scaled``.
"""

from __future__ import annotations

import os
import queue as queue_mod
import socket
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing import forkserver
from typing import Any

import torch.multiprocessing as mp

from .processes import check as check_marked
from .reaper import die_with_parent
from .timing import TIME_SCALE, scaled

__all__ = ["TIME_SCALE", "context", "free_port", "raise_rank_errors", "run", "scaled"]

PRELOAD = __name__.rpartition(".")[0] + ".preload"

if any("multiprocessing.forkserver" in arg for arg in getattr(sys, "orig_argv", ())):
    # imported by the forkserver (this module is in its preload list): it ends with pytest, even
    # a SIGKILLed one, and the ranks it forks end with it (``_entry``)
    die_with_parent()


def context() -> Any:
    """The multiprocessing context every rank of the suite starts from.

    A forkserver with torch, DTensor, FSDP2, meshgroups' torch side and pytest preloaded
    (``tests/support/preload.py``): a rank starts in ~0.1 s from a clean, thread-free server
    process, instead of ~2 s importing torch (spawn) or inheriting pytest's state (fork), and
    imports nothing big after the fork. One server for the session: the first call fixes it.

    The server is running when this returns: its start (seconds, on a loaded machine) never
    falls between ``free_port()`` and rank 0 binding that port, where another process may take it.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "numpy", "meshgroups", __name__, PRELOAD])
    forkserver.ensure_running()
    return ctx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank, world, port, args, queue, backend, env, pg_timeout):
    die_with_parent()  # a rank never outlives the forkserver, hence pytest
    os.environ.update(env)
    try:
        import torch.distributed as dist

        if backend is None:  # the worker sets up (and tears down) torch.distributed itself
            queue.put((rank, "ok", fn(rank, world, *args)))
            return
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=pg_timeout),
        )
        try:
            queue.put((rank, "ok", fn(rank, world, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))


PORT_TAKEN = "address already in use"


class PortTaken(RuntimeError):
    """Rank 0 could not listen on the job's port: another process took it after free_port()."""


def run(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    timeout: float = 120,
    backend: str | None = "gloo",
    env=None,
    pg_timeout: float = 60,
    may_exit: frozenset[int] | set[int] = frozenset(),
    port_retries: int = 2,
) -> list[Any]:
    """``[fn(rank, world, *args) for each rank]`` computed in ``world`` real processes.

    ``timeout`` (the whole job) and ``pg_timeout`` (the default group's) are nominal seconds,
    multiplied by MESHGROUPS_TEST_TIME_SCALE here; a test comparing a time with the default
    group's timeout uses ``scaled(pg_timeout)``. ``backend=None`` leaves torch.distributed to
    ``fn``. Ranks in ``may_exit`` may die without a result (fault injection): their entry is
    ``None``. A job whose port another process took in the meantime is run again on a new one,
    up to ``port_retries`` times (0 where ``fn`` takes its ports from ``args``: see PortTaken).
    """
    for attempt in range(port_retries + 1):
        try:
            return _run_once(
                fn,
                world,
                *args,
                timeout=scaled(timeout),
                backend=backend,
                env=env,
                pg_timeout=scaled(pg_timeout),
                may_exit=may_exit,
            )
        except PortTaken:
            # free_port() closed its socket before rank 0 bound the port, and on a shared machine
            # another job took it: a fresh job on a fresh port, not a failure of the code tested.
            if attempt == port_retries:
                raise
    raise AssertionError("unreachable")


def _run_once(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    timeout: float = 120,
    backend: str | None = "gloo",
    env=None,
    pg_timeout: float = 60,
    may_exit: frozenset[int] | set[int] = frozenset(),
) -> list[Any]:
    check_marked(f"{world} ranks")  # forkserver forks raise no audit event (processes.py)
    ctx = context()
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_entry,
            args=(fn, r, world, port, args, queue, backend, dict(env or {}), pg_timeout),
            daemon=True,
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world:
            try:
                rank, status, value = queue.get(timeout=0.5)
                if status == "error" and PORT_TAKEN in value:
                    raise PortTaken(value)
                (results if status == "ok" else errors)[rank] = value
                continue
            except queue_mod.Empty:
                pass
            missing = sorted(set(range(world)) - set(results) - set(errors))
            dead = [r for r in missing if not procs[r].is_alive() and procs[r].exitcode is not None]
            for r in [r for r in dead if r in may_exit]:
                results[r] = None
                dead.remove(r)
            if dead and queue.empty():
                time.sleep(scaled(0.5))  # a result may still be in flight from a rank that just exited
                if queue.empty():
                    raise RuntimeError(
                        f"ranks {dead} exited (codes {[procs[r].exitcode for r in dead]}) without a result"
                    )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"ranks {missing} did not finish within {timeout:g}s (MESHGROUPS_TEST_TIME_SCALE="
                    f"{TIME_SCALE:g}); errors so far: {errors}"
                )
    except BaseException:
        # a failure, or Ctrl-C / SIGTERM (KeyboardInterrupt): the ranks are of no use any more
        for p in procs:
            if p.is_alive():
                p.kill()
        raise
    finally:
        deadline = time.monotonic() + 5  # one bound for all ranks, not 5 s each
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    raise_rank_errors(errors)
    return [results[r] for r in range(world)]


def raise_rank_errors(errors: dict[int, str]) -> None:
    """Fail with the ranks' tracebacks (``{rank: traceback}``, in the order they arrived), if any.

    The first error to arrive is the cause; the later ones are usually its echo (ranks that
    waited for the failed one), so they are listed by their last line only.
    """
    if not errors:
        return
    first = next(iter(errors))
    others = "".join(
        f"\n  rank {r}: {text.strip().splitlines()[-1][:300]}"
        for r, text in sorted(errors.items())
        if r != first
    )
    raise AssertionError(
        f"{len(errors)} rank(s) failed; the first to fail, rank {first}:\n{errors[first]}"
        + (f"\nthe others (last line of each):{others}" if others else "")
    )
