"""``python -m meshgroups store``: an elastic job's store in a process of its own, outside every
torchrun agent, so that it outlives any worker and any agent's restart::

    python -m meshgroups store --port 29600          # on a host every node reaches
    MESHGROUPS_STORE=$HOST:29600 MESHGROUPS_NODE_RANK=0 torchrun --nnodes=1 --max-restarts=3 ...

It hosts a ``TCPStore`` (the workers are its clients: ``meshgroups.elastic.start``) and serves
until Ctrl-C or SIGTERM, exiting 0. The first line printed is the address workers connect to
(``--json``: one JSON document ``{"host", "port", "address"}``; ``--port 0`` takes a free port).
Not one of the layout commands: it takes no dims and no ``--node``.
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import sys
from types import FrameType
from typing import Any

from meshgroups.cli._args import bounded_int

#: The port the store listens on unless told (torchrun's defaults: 29500 and 29400).
DEFAULT_PORT = 29600


def _stop(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # SIGTERM ends the store as Ctrl-C does


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Host the store and serve until Ctrl-C or SIGTERM; returns 0."""
    from datetime import timedelta

    import torch.distributed as dist

    try:
        store = dist.TCPStore(
            args.host, args.port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
        )
    except (RuntimeError, dist.DistError) as exc:
        parser.error(f"cannot listen on {args.host}:{args.port}: {exc}")
    host = socket.gethostname() if args.host in ("0.0.0.0", "::") else args.host
    address = f"{host}:{store.port}"
    if args.json:
        print(json.dumps({"host": host, "port": store.port, "address": address}))
    else:
        print(
            f"meshgroups store at {address} (workers: MESHGROUPS_STORE={address}); Ctrl-C or SIGTERM stops it"
        )
    sys.stdout.flush()
    signal.signal(signal.SIGTERM, _stop)
    try:
        while True:
            signal.pause()
    except KeyboardInterrupt:
        pass
    del store
    return 0


def register(sub: Any) -> argparse.ArgumentParser:
    """Add ``store`` to the command line's subparsers; returns its parser."""
    p = sub.add_parser("store", help="host an elastic job's store (a TCPStore) until Ctrl-C or SIGTERM")
    p.add_argument(
        "--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0: every interface)"
    )
    p.add_argument(
        "--port",
        type=bounded_int("--port", 0, 65535),
        default=DEFAULT_PORT,
        help=f"port to listen on; 0 takes a free one (default {DEFAULT_PORT})",
    )
    p.add_argument("--json", action="store_true", help="print the address as one JSON document")
    p.set_defaults(run=run, parser=p)
    return p


__all__ = ["DEFAULT_PORT", "register", "run"]
