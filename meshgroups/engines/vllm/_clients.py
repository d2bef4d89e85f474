"""Clients of a vLLM engine's weight-sync calls, on trainer rank 0 (no vLLM imported).

vLLM's ``VLLMWeightSyncClient`` is structural: four calls (``init_weight_transfer_engine``,
``start_weight_update``, ``update_weights``, ``finish_weight_update``). Two clients here:

- :class:`LLMClient`: an in-process ``vllm.LLM``.
- :class:`HTTPClient`: a separately started ``vllm serve`` (its RL routes, served with
  ``VLLM_SERVER_DEV_MODE=1``), over plain HTTP (the standard library; no ``requests``). It also
  reads the engine's size (``/get_world_size``) and version (``/weight_info``).

Any other object with the four calls works too (vLLM's own ``HTTPVLLMWeightSyncClient``); an
``engine_size`` and a ``get_weight_version()`` are used where a client has them::

    >>> HTTPClient("http://127.0.0.1:8000/").base_url
    'http://127.0.0.1:8000'
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch.distributed as dist

from meshgroups.errors import LayoutError, MeshConfigError

if TYPE_CHECKING:
    from meshgroups.layout import Layout


class WeightSyncClient(Protocol):
    """vLLM's ``VLLMWeightSyncClient`` (structural): the engine's four weight-sync calls. Any
    object with them is a client (``LLMClient``, ``HTTPClient``, vLLM's own)::

        >>> from meshgroups.engines.vllm import WeightSyncClient
        >>> class Recorder:  # records what VLLMWeightSync asks of the engine
        ...     def __init__(self):
        ...         self.calls = []
        ...     def init_weight_transfer_engine(self, init_info):
        ...         self.calls.append("init")
        ...     def start_weight_update(self):
        ...         self.calls.append("start")
        ...     def update_weights(self, update_info):
        ...         self.calls.append("update")
        ...     def finish_weight_update(self, weight_version=None):
        ...         self.calls.append(f"finish {weight_version}")
        >>> client: WeightSyncClient = Recorder()
    """

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...

    def start_weight_update(self) -> None: ...

    def update_weights(self, update_info: dict[str, Any]) -> None: ...

    def finish_weight_update(self, weight_version: str | None = None) -> None: ...


class LLMClient:
    """An in-process ``vllm.LLM`` as a ``VLLMWeightSyncClient``: the LLM's calls take
    ``{"init_info": ...}`` / ``{"update_info": ...}`` requests, the protocol plain dicts.

    Args:
        llm: the ``vllm.LLM``.

    >>> client = LLMClient(llm)                                 # doctest: +SKIP
    >>> client.engine_size                                      # doctest: +SKIP
    2
    """

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    @property
    def engine_size(self) -> int:
        """The engine's workers (its tensor-parallel size times pipeline stages)."""
        return int(self.llm.llm_engine.vllm_config.parallel_config.world_size)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version=weight_version)

    def get_weight_version(self) -> str:
        """The engine's last committed version (vLLM's own record)."""
        return str(self.llm.get_weight_version())


class HTTPClient:
    """A ``vllm serve`` process's weight-sync routes as a ``VLLMWeightSyncClient``.

    Start the server with the backend and its RL routes::

        VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --tensor-parallel-size 2 \\
            --weight-transfer-config '{"backend": "meshgroups"}'

    Args:
        base_url: the server's address (``http://host:port``).
        timeout: seconds each request may take (an update returns once the bytes moved).

    Raises (from each call):
        RuntimeError: the server answered with an error status (its body in the message), or
            could not be reached.

    >>> from meshgroups.engines.vllm import HTTPClient
    >>> client = HTTPClient("http://127.0.0.1:8000/", timeout=60)  # no request until a call
    >>> client.base_url, client.timeout
    ('http://127.0.0.1:8000', 60.0)
    """

    def __init__(self, base_url: str, timeout: float = 300.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = float(timeout)

    def _request(self, path: str, body: dict[str, Any] | None = None, method: str = "POST") -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            f"{self.base_url}/{path}", data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                text = response.read().decode()
        except urllib.error.HTTPError as exc:
            raise RuntimeError(
                f"{method} {self.base_url}/{path}: HTTP {exc.code}: {exc.read().decode()[:500]}"
            ) from exc
        except (urllib.error.URLError, OSError) as exc:
            raise RuntimeError(f"{method} {self.base_url}/{path}: {exc}") from exc
        return json.loads(text) if text else None

    @property
    def engine_size(self) -> int:
        """The engine's workers (``/get_world_size?include_dp=false``)."""
        return int(self._request("get_world_size?include_dp=false", method="GET")["world_size"])

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._request("init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self._request("start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._request("update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._request(
            "finish_weight_update", {} if weight_version is None else {"weight_version": weight_version}
        )

    def get_weight_version(self) -> str:
        """The version the server serves (``/weight_info``)."""
        return str(self._request("weight_info", method="GET")["weight_version"])


def front_version(client: Any) -> int:
    """The version an engine's front end reports as an int (``-1``: the client cannot say, or
    it is no int — another backend's label).

    >>> front_version(object())
    -1
    """
    get = getattr(client, "get_weight_version", None)
    if get is None:
        return -1
    try:
        return int(str(get()))
    except (ValueError, TypeError, RuntimeError):
        return -1


class Call:
    """A blocking client call in a thread: the engine's workers only return from it once the
    trainer's ranks have moved the bytes, which this thread's caller does meanwhile."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True, name="meshgroups-vllm-call")
        self.thread.start()

    def _run(self, fn: Callable[[], object]) -> None:
        try:
            fn()
        except BaseException as exc:  # handed to the caller by join()
            self.error = exc

    def join(self, timeout: float) -> BaseException | None:
        """Wait up to ``timeout`` seconds; the call's error, a ``TimeoutError``, or ``None``."""
        self.thread.join(timeout)
        if self.thread.is_alive():
            return TimeoutError(f"the engine did not answer within {timeout:g} s")
        return self.error


def check_trainer_args(
    rank: int, client: Any, layout: Layout, group: dist.ProcessGroup | None, engine_size: int | None
) -> int | None:
    """This trainer rank's own checks of ``VLLMWeightSync``'s arguments (agreed by the caller).

    Returns:
        The engine's size on rank 0 (``None`` elsewhere: rank 0 broadcasts it).
    """
    if (client is None) == (rank == 0):
        raise MeshConfigError(
            f"client={client!r} on rank {rank}: trainer rank 0 holds the engine's client (an LLMClient, "
            "an HTTPClient or a VLLMWeightSyncClient), the other ranks pass None"
        )
    ranks, world = int(layout.grid.size), dist.get_world_size(group)
    if ranks != world or sorted(layout.grid.ravel().tolist()) != list(range(ranks)):
        raise LayoutError(
            f"layout {layout!r} must hold the trainer's ranks 0..{world - 1} (its world), each once; "
            f"it holds {ranks} ranks"
        )
    if rank != 0:
        return None
    size = engine_size if engine_size is not None else getattr(client, "engine_size", None)
    if size is None:
        raise MeshConfigError(
            "engine_size is needed: the client does not say how many workers the engine has"
        )
    return int(size)


__all__ = ["Call", "HTTPClient", "LLMClient", "WeightSyncClient", "front_version"]
