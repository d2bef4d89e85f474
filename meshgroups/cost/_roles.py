"""What each dim of a layout does in training, and in which dtypes.

A layout names its dims; the cost model needs to know what each does. :class:`Parallelism` maps dims to
roles (a dim named like a role plays it unless ``roles`` says otherwise) and holds the training
choices the costs depend on:

- ``tp``: tensor parallelism (Megatron's column/row split), optionally with sequence parallelism
  (``sequence_parallel``: activations outside the matmuls cut along the sequence).
- ``cp``: context parallelism (the sequence cut over ranks, ring attention passes K and V on).
- ``pp``: pipeline stages, run as ``1f1b`` or ``interleaved`` with ``virtual_stages`` chunks.
- ``dp_shard``: FSDP2 / ZeRO-3 (parameters, gradients and optimizer state sharded, parameters
  all-gathered per layer, gradients reduce-scattered); ``dp_replicate``: plain data parallelism
  (gradients all-reduced; with ``dp_shard`` too, HSDP).
- ``ep``: expert parallelism (the experts of a layer spread over the dim, tokens all-to-all);
  the experts are cut by ``tp`` too (expert tensor parallelism equal to ``tp``).

The pipeline bubble follows Narayanan et al. 2021, "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM" (§2.2.1 and §2.2.2)::

    >>> bubble_fraction(pp=4, micro_batches=8)   # (p-1)/(m+p-1)
    0.2727272727272727
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from meshgroups.errors import LayoutError
from meshgroups.layout import Layout

__all__ = ["DTYPE_BYTES", "ROLES", "Parallelism", "Precision", "bubble_fraction", "dtype_bytes"]

#: The roles a dim can play (see the module docstring).
ROLES = ("pp", "dp_replicate", "dp_shard", "ep", "cp", "tp")

#: Bytes per element of the dtypes the cost model knows (torch's names and the usual short ones).
DTYPE_BYTES = {
    "float32": 4,
    "fp32": 4,
    "bfloat16": 2,
    "bf16": 2,
    "float16": 2,
    "fp16": 2,
    "float8": 1,
    "fp8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}

Schedule = Literal["1f1b", "interleaved"]
Recompute = Literal["none", "selective", "op", "layer", "full"]
Attention = Literal["flash", "eager"]
#: Recomputation policies (see :class:`Parallelism`).
RECOMPUTE = ("none", "selective", "op", "layer", "full")
#: Attention kernels: ``flash`` (FlashAttention / SDPA's fused kernels: no s² matrix kept) or
#: ``eager`` (an explicit softmax, whose s² probabilities backward keeps).
ATTENTION = ("flash", "eager")


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of ``dtype`` (a key of :data:`DTYPE_BYTES`).

    Args:
        dtype: e.g. ``"bfloat16"``.

    Returns:
        the size in bytes.

    Raises:
        LayoutError: an unknown dtype (the message lists the known ones).

    >>> dtype_bytes("bf16")
    2
    """
    if dtype not in DTYPE_BYTES:
        raise LayoutError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class Precision:
    """The dtypes of what a rank stores and sends.

    Two common settings, as classmethods: :meth:`megatron` (this default: bf16 parameters, an
    fp32 main-gradient buffer, an fp32 master copy, fp32 moments: 18 bytes per parameter) and
    :meth:`fsdp2` (torchtitan's FSDP2 ``MixedPrecisionPolicy``: fp32 parameters stored and
    sharded, all-gathered and computed in bf16, gradients reduced and kept in fp32, no separate
    master: 16 bytes per parameter).

    Args:
        params: the parameters as stored (FSDP2: the sharded fp32 parameters).
        grads: the gradients as kept (the ``.grad`` of a parameter, Megatron's main-grad buffer).
        master: an extra master copy of the parameters (``None``: none, the parameters are
            the master copy).
        moments: each of Adam's two moments.
        activations: the dtype layers compute and keep activations in, and what flows between
            them (tp, cp, pp and ep traffic).
        compute: the dtype parameters are all-gathered and computed in (FSDP2's
            ``param_dtype``); ``None``: ``params``.
        reduce: the dtype gradients are reduce-scattered / all-reduced in (FSDP2's
            ``reduce_dtype``); ``None``: ``grads``.

    Raises:
        LayoutError: an unknown dtype.

    >>> Precision().bytes_per_param()   # bf16 + fp32 grads + fp32 master + 2 × fp32 moments
    18
    >>> Precision.fsdp2().bytes_per_param(), Precision.fsdp2().gather
    (16, 'bfloat16')
    """

    params: str = "bfloat16"
    grads: str = "float32"
    master: str | None = "float32"
    moments: str = "float32"
    activations: str = "bfloat16"
    compute: str | None = None
    reduce: str | None = None

    def __post_init__(self) -> None:
        for name in ("params", "grads", "moments", "activations"):
            dtype_bytes(getattr(self, name))
        for name in ("master", "compute", "reduce"):
            if getattr(self, name) is not None:
                dtype_bytes(getattr(self, name))

    @classmethod
    def megatron(cls) -> Precision:
        """Megatron-Core's bf16 training: bf16 parameters, fp32 main gradients, an fp32 master
        copy and fp32 moments (the default).

        Returns:
            the precision.

        >>> Precision.megatron() == Precision()
        True
        """
        return cls()

    @classmethod
    def fsdp2(cls, compute: str = "bfloat16") -> Precision:
        """FSDP2's mixed precision as torchtitan sets it: fp32 parameters stored (and updated in
        place: no master copy), all-gathered and computed in ``compute``, gradients reduced and
        kept in fp32, fp32 moments.

        Args:
            compute: ``MixedPrecisionPolicy.param_dtype``.

        Returns:
            the precision.

        >>> Precision.fsdp2().params
        'float32'
        """
        return cls(
            params="float32", grads="float32", master=None, moments="float32", activations=compute,
            compute=compute, reduce="float32",
        )  # fmt: skip

    @property
    def gather(self) -> str:
        """The dtype parameters are all-gathered and computed in (``compute``, else ``params``)."""
        return self.compute or self.params

    @property
    def reduction(self) -> str:
        """The dtype gradients are reduced in (``reduce``, else ``grads``)."""
        return self.reduce or self.grads

    def bytes_per_param(self) -> int:
        """Bytes of parameter, gradient, master copy and optimizer moments per element.

        Returns:
            their sum.

        >>> Precision(params="float32", master=None).bytes_per_param()
        16
        """
        master = dtype_bytes(self.master) if self.master else 0
        return dtype_bytes(self.params) + dtype_bytes(self.grads) + master + 2 * dtype_bytes(self.moments)


def bubble_fraction(pp: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """The share of a step a pipeline stage idles: ``(p-1) / (v·m + p-1)``.

    With ``p`` stages and ``m`` micro-batches, 1F1B (and GPipe) idle ``(p-1)`` micro-batch
    times out of ``m + p - 1`` (Narayanan et al. 2021, §2.2.1: the bubble is ``(p-1)/m`` of the
    ideal time); the interleaved schedule's ``v`` chunks per stage shrink each idle slot ``v``
    times (§2.2.2: ``(p-1)/(v·m)`` of the ideal time).

    Args:
        pp: stages p. micro_batches: m per step. virtual_stages: v (1: plain 1F1B).

    Returns:
        the fraction of the step's time in the bubble, in ``[0, 1)``.

    Raises:
        LayoutError: a count below 1.

    >>> bubble_fraction(8, 8), bubble_fraction(8, 8, 2)
    (0.4666666666666667, 0.30434782608695654)
    """
    for what, value in (("pp", pp), ("micro_batches", micro_batches), ("virtual_stages", virtual_stages)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise LayoutError(f"{what}={value!r} must be a positive int")
    return (pp - 1) / (virtual_stages * micro_batches + pp - 1)


@dataclass(frozen=True)
class Parallelism:
    """What the dims of a layout do, and how a training step runs.

    Args:
        roles: ``{dim: role}`` for dims not named after their role (``{"dp": "dp_shard"}``);
            a dim named like a role (:data:`ROLES`) plays it.
        sequence_parallel: tp with sequence parallelism (Korthikanti et al. 2022).
        schedule: ``"1f1b"`` or ``"interleaved"``. virtual_stages: chunks per stage
            (interleaved only; 1 for 1F1B).
        micro_batches: micro-batches per step (gradient accumulation; the pipeline's m).
        recompute: what each layer keeps for backward (:mod:`meshgroups.cost._activations`):
            ``"none"``; ``"selective"``, Megatron's (the attention core recomputed; Korthikanti
            et al. 2022); ``"op"``, torchtitan's op-level policy (the attention kernel's outputs
            and every other matmul's output saved, the rest recomputed); ``"layer"``,
            torchtitan's per-layer policy (every ``recompute_every``-th layer recomputed
            whole); ``"full"`` (each layer recomputed from its input).
        recompute_every: the ``"layer"`` policy's k (layers k, 2k, ... counted from 1).
        attention: ``"flash"`` (FlashAttention, SDPA's fused kernels) or ``"eager"`` (an
            explicit softmax whose probabilities are kept: the s² term).
        precision: the dtypes.
        vocab_parallel: the embedding and output head cut over tp along the vocabulary (with
            the loss computed on vocabulary shards, torch's ``loss_parallel``); ``False``:
            replicated over tp.
        zero: optimizer sharding over the data-parallel dims FSDP does not shard
            (``dp_replicate``, or every data-parallel dim without ``dp_shard``): 0 none, 1 the
            master copy and the moments sharded (ZeRO-1, Megatron's distributed optimizer),
            2 the gradients too (ZeRO-2).
        reshard_after_forward: FSDP2 frees a block's gathered parameters after its forward
            (and gathers them again for backward); ``False`` keeps them (torchtitan with
            pipelines).
        layers_per_stage: layers of each model chunk in pipeline order (``pp × virtual_stages``
            entries; chunk ``c`` on stage ``c % pp``; the embedding on the first chunk, the
            head and the loss on the last). ``None``: as even as the layers allow.

    Raises:
        LayoutError: an unknown role, schedule, recompute policy or attention kernel, virtual
            stages with 1F1B, a ``zero`` outside 0..2.

    >>> Parallelism(roles={"dp": "dp_shard"}).dims(Layout(dp=4, tp=2))
    {'dp_shard': 'dp', 'tp': 'tp'}
    """

    roles: Mapping[str, str] = field(default_factory=dict)
    sequence_parallel: bool = False
    schedule: Schedule = "1f1b"
    virtual_stages: int = 1
    micro_batches: int = 1
    recompute: Recompute = "none"
    precision: Precision = field(default_factory=Precision)
    vocab_parallel: bool = True
    recompute_every: int = 2
    attention: Attention = "flash"
    zero: int = 0
    reshard_after_forward: bool = True
    layers_per_stage: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "roles", dict(self.roles))
        for dim, role in self.roles.items():
            if role not in ROLES:
                raise LayoutError(f"dim {dim!r}: unknown role {role!r}; roles are {', '.join(ROLES)}")
        if self.schedule not in ("1f1b", "interleaved"):
            raise LayoutError(f"schedule={self.schedule!r} must be '1f1b' or 'interleaved'")
        if self.recompute not in RECOMPUTE:
            raise LayoutError(f"recompute={self.recompute!r} must be one of {', '.join(RECOMPUTE)}")
        if self.attention not in ATTENTION:
            raise LayoutError(f"attention={self.attention!r} must be one of {', '.join(ATTENTION)}")
        if self.zero not in (0, 1, 2) or isinstance(self.zero, bool):
            raise LayoutError(f"zero={self.zero!r} must be 0, 1 or 2 (the ZeRO stage of the optimizer)")
        if self.layers_per_stage is not None:
            object.__setattr__(self, "layers_per_stage", tuple(self.layers_per_stage))
            for n in self.layers_per_stage:
                if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                    raise LayoutError(
                        f"layers_per_stage={list(self.layers_per_stage)}: each entry is a layer count >= 0"
                    )
        for what in ("virtual_stages", "micro_batches", "recompute_every"):
            value = getattr(self, what)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LayoutError(f"{what}={value!r} must be a positive int")
        if self.schedule == "1f1b" and self.virtual_stages != 1:
            raise LayoutError(
                f"virtual_stages={self.virtual_stages} needs schedule='interleaved' (1F1B has one chunk per stage)"
            )
        if not isinstance(self.precision, Precision):
            raise TypeError(f"precision must be a Precision, got {type(self.precision).__name__}")

    def dims(self, layout: Layout) -> dict[str, str]:
        """``{role: dim}`` for the roles ``layout`` has, in layout order.

        Args:
            layout: the layout.

        Returns:
            the mapping.

        Raises:
            LayoutError: a dim with no role, a role played by two dims, or a ``roles`` entry
                naming a dim the layout lacks.

        >>> Parallelism().dims(Layout(pp=2, dp_shard=2, tp=2))
        {'pp': 'pp', 'dp_shard': 'dp_shard', 'tp': 'tp'}
        """
        if not isinstance(layout, Layout):
            raise TypeError(f"layout must be a meshgroups.Layout, got {type(layout).__name__}")
        missing = sorted(set(self.roles) - set(layout.names))
        if missing:
            raise LayoutError(f"roles name dim {missing[0]!r}, which {layout!r} does not have")
        out: dict[str, str] = {}
        for dim in layout.names:
            role = self.roles.get(dim, dim)
            if role not in ROLES:
                raise LayoutError(
                    f"dim {dim!r} has no role: name it after one ({', '.join(ROLES)}) "
                    f"or map it, e.g. roles={{{dim!r}: 'dp_shard'}}"
                )
            if role in out:
                raise LayoutError(f"dims {out[role]!r} and {dim!r} both play role {role!r}; one dim per role")
            out[role] = dim
        return out

    def sizes(self, layout: Layout) -> dict[str, int]:
        """``{role: size}`` for every role (1 for roles the layout lacks).

        Args:
            layout: the layout.

        Returns:
            the sizes.

        >>> Parallelism().sizes(Layout(dp_shard=4, tp=2))["pp"]
        1
        """
        dims = self.dims(layout)
        return {role: layout.size(dims[role]) if role in dims else 1 for role in ROLES}
