"""The trainer side as vLLM's own trainer API: a ``TrainerWeightTransferEngine`` (imports vLLM).

Frameworks that drive vLLM's weight transfer through its trainer factory (TRL, SkyRL) select
the backend by its init info and hand it a ``WeightSource``; this class is that entry, a thin
shell over :class:`~meshgroups.engines.vllm.VLLMWeightSync` (registered by the plugin under
``"meshgroups"``; ``MeshgroupsTrainerEngine``'s docstring shows it).

The source: a ``ModuleSource`` is read through its module (its DTensors say how each weight is
sharded, FSDP2 × TP's strided shards included); any other ``WeightSource`` through its full
tensors (``iter_full()``, or iteration before vLLM 0.33), replicated on every trainer rank and
read again at each ``send_weights()``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from meshgroups.engines.vllm import _api as api
from meshgroups.engines.vllm._plugin import BACKEND
from meshgroups.engines.vllm._trainer import VLLMWeightSync
from meshgroups.layout import Layout


@dataclass
class MeshgroupsTrainerInitInfo(api.TrainerInitInfo):
    """vLLM's ``TrainerInitInfo`` for the ``meshgroups`` backend (``rank``: this trainer rank,
    keyword-only, vLLM's field). The other fields are ``VLLMWeightSync``'s arguments.

    Attributes:
        layout: the trainer's layout (its ranks ``0..n-1``).
        engine_size: the engine's workers (default: the client's ``engine_size``).
        cast, allow_unused, bucket_bytes, timeout, host, name_map: as for ``VLLMWeightSync``.

    >>> from meshgroups import Layout
    >>> from meshgroups.engines.vllm import MeshgroupsTrainerInitInfo  # imports vLLM
    >>> info = MeshgroupsTrainerInitInfo(Layout(dp=2, tp=2), engine_size=2, rank=0)
    >>> info.backend, info.layout.world_size, info.bucket_bytes
    ('meshgroups', 4, 67108864)
    """

    backend: ClassVar[str] = BACKEND

    layout: Layout
    engine_size: int | None = None
    cast: Any = None
    allow_unused: Any = False
    bucket_bytes: int = 64 << 20
    timeout: float = 300.0
    host: str = "127.0.0.1"
    name_map: Any = field(default=None)


class MeshgroupsTrainerEngine(api.TrainerWeightTransferEngine[MeshgroupsTrainerInitInfo]):
    """``TrainerWeightTransferEngine`` of the ``meshgroups`` backend: what frameworks that drive
    vLLM's weight transfer through its trainer factory (TRL, SkyRL) build, a thin shell over
    ``VLLMWeightSync``. On every trainer rank, with a running engine (vLLM and a world of several
    processes: not run here)::

        >>> from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory  # doctest: +SKIP
        >>> engine = WeightTransferTrainerFactory.trainer_init(  # doctest: +SKIP
        ...     MeshgroupsTrainerInitInfo(Layout(dp=2, tp=2), engine_size=2, rank=dist.get_rank()),
        ...     client=client, source=ModuleSource(model))
        >>> engine.send_weights()  # engine.version: what vLLM serves now  # doctest: +SKIP

    Attributes:
        sync: the ``VLLMWeightSync``.
        version: the version the engine serves after the last ``send_weights()``.
    """

    init_info_cls = MeshgroupsTrainerInitInfo

    def __init__(self, *, client: Any, source: Any = None, is_sender: bool = True, rank: int = 0) -> None:
        api.trainer_base_init(self, client=client, source=source, is_sender=is_sender, rank=rank)
        self.sync: VLLMWeightSync | None = None
        self.version = 0

    @classmethod
    def trainer_init(cls, init_info: MeshgroupsTrainerInitInfo, *, client: Any, source: Any = None) -> Any:
        """Build the ``VLLMWeightSync`` (collective over the trainer's world; every rank).

        Args:
            init_info: see :class:`MeshgroupsTrainerInitInfo`.
            client: the engine's client (only the sender, rank 0, calls it).
            source: the trainer's ``WeightSource``.

        Returns:
            The engine, connected.

        Raises:
            TypeError: no source.
            As ``VLLMWeightSync`` (on every rank alike).
        """
        if source is None:
            raise TypeError("the meshgroups trainer engine moves a WeightSource's weights: pass source=")
        engine = cls(client=client, source=source, is_sender=init_info.rank == 0, rank=init_info.rank)
        engine.sync = VLLMWeightSync(
            engine._tensors(),
            init_info.layout,
            client if init_info.rank == 0 else None,
            engine_size=init_info.engine_size,
            cast=init_info.cast,
            allow_unused=init_info.allow_unused,
            bucket_bytes=init_info.bucket_bytes,
            timeout=init_info.timeout,
            host=init_info.host,
            name_map=init_info.name_map,
        )
        engine.version = engine.sync.version
        return engine

    def _tensors(self) -> Any:
        module = api.source_module(self.source)
        if module is not None:
            return module
        return dict(api.source_full(self.source))

    def send_weights(self) -> None:
        """One ``VLLMWeightSync.sync()`` (every trainer rank): start, update and finish on the
        engine, the bytes moved shard to shard; ``self.version`` is then what vLLM serves."""
        if self.sync is None:
            raise RuntimeError("trainer_init first")
        if api.source_module(self.source) is None:  # a generic source: its tensors of this round
            tensors = self._tensors()
            self.sync.model = self.sync.sync_state.trainer = tensors
        self.version = self.sync.sync()

    def shutdown(self) -> None:
        """Leave the transfer world (the engine keeps its version)."""
        if self.sync is not None:
            self.sync.close()


__all__ = ["MeshgroupsTrainerEngine", "MeshgroupsTrainerInitInfo"]
