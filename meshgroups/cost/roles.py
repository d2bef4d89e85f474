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
Recompute = Literal["none", "selective", "full"]


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

    Args:
        params: the (sharded) parameters, and what FSDP all-gathers.
        grads: the gradients, and what is reduce-scattered or all-reduced.
        master: an extra master copy of the parameters (``None``: none, the parameters are
            the master copy).
        moments: each of Adam's two moments.
        activations: what flows between layers (tp, cp, pp and ep traffic). The activation
            *memory* formulas are Korthikanti et al.'s, which assume 16-bit activations.

    Raises:
        LayoutError: an unknown dtype.

    >>> Precision().bytes_per_param()   # bf16 + fp32 grads + fp32 master + 2 × fp32 moments
    18
    """

    params: str = "bfloat16"
    grads: str = "float32"
    master: str | None = "float32"
    moments: str = "float32"
    activations: str = "bfloat16"

    def __post_init__(self) -> None:
        for name in ("params", "grads", "moments", "activations"):
            dtype_bytes(getattr(self, name))
        if self.master is not None:
            dtype_bytes(self.master)

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
        recompute: ``"none"``, ``"selective"`` (attention's softmax/dropout recomputed) or
            ``"full"`` (each layer recomputed from its input).
        precision: the dtypes.
        vocab_parallel: the embedding and output head cut over tp along the vocabulary (with
            the loss computed on vocabulary shards); ``False``: replicated over tp.

    Raises:
        LayoutError: an unknown role, an unknown schedule or recompute, virtual stages with 1F1B.

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

    def __post_init__(self) -> None:
        object.__setattr__(self, "roles", dict(self.roles))
        for dim, role in self.roles.items():
            if role not in ROLES:
                raise LayoutError(f"dim {dim!r}: unknown role {role!r}; roles are {', '.join(ROLES)}")
        if self.schedule not in ("1f1b", "interleaved"):
            raise LayoutError(f"schedule={self.schedule!r} must be '1f1b' or 'interleaved'")
        if self.recompute not in ("none", "selective", "full"):
            raise LayoutError(f"recompute={self.recompute!r} must be 'none', 'selective' or 'full'")
        for what in ("virtual_stages", "micro_batches"):
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
