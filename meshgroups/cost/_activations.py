"""What a layer keeps for backward, per micro-batch and rank, as frameworks run it — counted from
the tensors torch's autograd saves for a Llama-style block (RMSNorm, q/k/v projections, rotary
embedding, attention, output projection, a gated or plain MLP) and checked against torch's own
memory on real training steps (``tests/cost/test_cost_memory.py``).

With ``T`` tokens per micro-batch on the rank (``micro_batch × seq_len / cp``), ``Tn`` the tokens
the norms and the residual stream hold (``T / tp`` with sequence parallelism, else ``T``), ``c``
the activation dtype's bytes, ``h`` the hidden size and ``q``, ``k``, ``f`` the rank's query,
key/value and MLP widths (``heads·head_dim / tp``, ``kv_heads·head_dim / tp``, ``ffn / tp``), one
layer without recomputation keeps:

- its output (the next layer's input) ``c·Tn·h``, the residual sum inside it ``c·Tn·h``, each
  norm's fp32 ``1/rms`` (``4·Tn``) and the normed input of the projections after it ``c·T·h``
  (gathered over tp with sequence parallelism: torch's ``ColwiseParallel`` keeps the gathered
  input);
- attention (``flash``): the rotated ``q`` and ``k``, ``v``, the kernel's output and its fp32
  log-sum-exp (``4·T·heads/tp``); with fused projections ``v`` is a view of the ``qkv`` output,
  which it keeps whole (``q + 2k`` more); ``eager`` keeps the softmax probabilities
  (``c·b·heads/tp·s²``), the causal mask and ``k``, ``v`` repeated over the query heads instead;
- the MLP: gated ``4·c·T·f`` (gate and up outputs, the activation, the product), plain
  ``2·c·T·f``.

Recomputation keeps less: ``selective`` (Megatron's: the attention core recomputed) drops the
kernel's log-sum-exp (with flash attention the s² term it was made for is gone already);
``op`` (torchtitan's op-level policy) keeps the attention kernel's outputs and every other matmul's
output (the 1st, 3rd, ... of the layer: which they are depends on fused or separate projections)
and, with sequence parallelism, the reduce-scatters' outputs; ``layer`` keeps only the output of
every ``recompute_every``-th layer; ``full`` only every layer's output. While a layer's backward
runs it holds its whole unrecomputed set again plus a working set (the MLP's input gradients:
``2·c·T·f`` gated, ``c·T·f`` plain).

Korthikanti et al. 2022 (:func:`korthikanti_bytes_per_layer`) count multi-head attention, a 4h
plain MLP and 16-bit activations, with dropout and the s² attention terms; the measurement of a
torch step differs (no dropout, flash attention, GQA, the norms' fp32 statistics, what sequence
parallelism gathers) and wins::

    >>> from meshgroups.cost._model import preset
    >>> m = preset("llama3-8b").with_(seq_len=8192)
    >>> layer_stored(m, Parallelism(recompute="none"), {"tp": 1, "cp": 1}, 0) // 8192   # bytes per token
    178312
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from meshgroups.cost._model import Model
from meshgroups.cost._roles import Parallelism, Recompute, dtype_bytes

__all__ = [
    "LossBytes",
    "activation_bytes_per_layer",
    "attention_working",
    "embedding_bytes",
    "head_bytes",
    "is_recomputed",
    "korthikanti_bytes_per_layer",
    "layer_recomputed",
    "layer_stored",
    "layer_working",
    "loss_bytes",
]


def _dims(model: Model, plan: Parallelism, sizes: Mapping[str, int]) -> dict[str, int]:
    t, cp = int(sizes.get("tp", 1)), int(sizes.get("cp", 1))
    s = model.seq_len // cp
    tokens = model.micro_batch * s
    hd, kv = model.head_dim or 0, model.kv_heads or model.heads
    return {
        "t": t,
        "cp": cp,
        "s": s,
        "T": tokens,
        "Tn": tokens // t if plan.sequence_parallel and t > 1 else tokens,
        "h": model.hidden,
        "q": model.heads * hd // t,
        "k": kv * hd // t,
        "a": model.heads // t,
        "f": model.ffn // t,
        "c": dtype_bytes(plan.precision.activations),
    }


def _moe_mlp(model: Model, d: dict[str, int]) -> tuple[int, int]:
    """(kept, working) bytes of an MoE layer's MLP: the router's fp32 logits and probabilities,
    each token's top-k copies dispatched and combined, the experts' MLPs on them (an estimate:
    the experts' memory is not measured by the tests)."""
    c, T, h = d["c"], d["T"], d["h"]
    routed = T * model.top_k
    f = (model.expert_ffn or model.ffn) // d["t"]
    mlp = (4 if model.gated_mlp else 2) * c * routed * f
    return 8 * T * model.experts + 2 * c * routed * h + mlp, (2 if model.gated_mlp else 1) * c * routed * f


def _attention_set(model: Model, attention: str, d: dict[str, int]) -> int:
    """Bytes the attention part keeps without recomputation (flash or eager), besides the
    normed input and the residual stream."""
    c, T, q, k, a = d["c"], d["T"], d["q"], d["k"], d["a"]
    if attention == "eager":
        # q, k and v repeated to every query head, the probabilities and the causal mask (each
        # query of this rank's slice against the whole sequence: with cp an estimate, ring
        # attention runs fused kernels), and the output's copy the output projection reads
        s, b, keys = d["s"], model.micro_batch, d["s"] * d["cp"]
        return c * T * 4 * q + c * b * a * s * keys + s * keys
    kept_qkv = c * T * (q + 2 * k) if model.fused_projections else c * T * k
    return kept_qkv + c * T * (q + k) + c * T * q + 4 * T * a


def _mlp_set(model: Model, d: dict[str, int]) -> int:
    if model.is_moe:
        return _moe_mlp(model, d)[0]
    return (4 if model.gated_mlp else 2) * d["c"] * d["T"] * d["f"]


def layer_recomputed(model: Model, plan: Parallelism, sizes: Mapping[str, int]) -> int:
    """Bytes one layer keeps without recomputation (its output included): what a recomputed
    layer holds again while its backward runs (see the module docstring).

    Args:
        model: the model. plan: attention kernel, dtypes, sequence parallelism. sizes: role
            sizes (``tp``, ``cp``).

    Returns:
        bytes.

    >>> from meshgroups.cost._model import Model
    >>> m = Model(layers=3, hidden=128, heads=8, kv_heads=2, ffn=256, vocab=64, gated_mlp=True, seq_len=128, micro_batch=2)
    >>> layer_recomputed(m, Parallelism(precision=Precision(activations="bfloat16")), {}) // (256 * 2)
    2036
    """
    d = _dims(model, plan, sizes)
    c, T, Tn, h = d["c"], d["T"], d["Tn"], d["h"]
    stream = 2 * c * Tn * h + 2 * 4 * Tn  # the residual sum, the output; the norms' 1/rms
    normed = 2 * c * T * h  # the inputs of the attention's and the MLP's projections
    return stream + normed + _attention_set(model, plan.attention, d) + _mlp_set(model, d)


def _matmul_outputs(model: Model, d: dict[str, int]) -> list[int]:
    """The bytes of each matmul's output in one layer's forward, in order (what torchtitan's
    op-level policy counts to keep every other one)."""
    c, T, h, q, k, f = d["c"], d["T"], d["h"], d["q"], d["k"], d["f"]
    out = [c * T * (q + 2 * k)] if model.fused_projections else [c * T * q, c * T * k, c * T * k]
    out.append(c * T * h)  # the output projection (a partial sum under tp)
    if model.is_moe:
        return out  # the experts' grouped matmuls are not aten.mm: recomputed
    if model.gated_mlp and not model.fused_projections:
        out += [c * T * f, c * T * f]
    else:
        out.append(c * T * (2 if model.gated_mlp else 1) * f)
    return [*out, c * T * h]


def is_recomputed(plan: Parallelism, index: int) -> bool:
    """Whether layer ``index`` (global, from 0) is recomputed whole in backward: every layer
    with ``full``, layers ``k-1, 2k-1, ...`` with ``layer`` (torchtitan counts from 1).

    Args:
        plan: the policy. index: the layer.

    Returns:
        the answer.

    >>> [is_recomputed(Parallelism(recompute="layer", recompute_every=2), i) for i in range(4)]
    [False, True, False, True]
    """
    if plan.recompute == "full":
        return True
    return plan.recompute == "layer" and (index + 1) % plan.recompute_every == 0


def layer_stored(model: Model, plan: Parallelism, sizes: Mapping[str, int], index: int) -> int:
    """Bytes layer ``index`` keeps from its forward to its backward, per micro-batch, under
    ``plan.recompute`` (see the module docstring); its output (the next layer's input) included.

    Args:
        model: the model. plan: policy, kernel, dtypes. sizes: role sizes (``tp``, ``cp``).
        index: the layer's global index (the ``layer`` policy picks every k-th).

    Returns:
        bytes.

    >>> m = preset("llama3-8b")
    >>> layer_stored(m, Parallelism(recompute="full"), {}, 0) == 2 * 8192 * 4096
    True
    """
    d = _dims(model, plan, sizes)
    c, T, Tn, h = d["c"], d["T"], d["Tn"], d["h"]
    output = c * Tn * h
    if is_recomputed(plan, index):
        return output
    whole = layer_recomputed(model, plan, sizes)
    policy: Recompute = plan.recompute
    if policy == "selective":
        # the core's inputs (q, k, v) kept, its output kept by the output projection, its
        # internals (flash: the log-sum-exp; eager: the probabilities) recomputed
        return (
            whole
            - _attention_set(model, plan.attention, d)
            + _attention_set(model, "flash", d)
            - 4 * T * d["a"]
        )
    if policy == "op":
        kept = sum(_matmul_outputs(model, d)[::2]) + output
        if plan.attention == "flash":
            kept += c * T * d["q"] + 4 * T * d["a"]
        if plan.sequence_parallel and d["t"] > 1:
            kept += 2 * c * Tn * h  # the reduce-scatters' outputs (in torchtitan's save list)
        return kept
    return whole


def layer_working(model: Model, plan: Parallelism, sizes: Mapping[str, int]) -> int:
    """Bytes a layer's backward makes on top of what it keeps, at its peak: the MLP's input
    gradients (``2·c·T·f`` gated, ``c·T·f`` plain; the routed tokens' for MoE).

    Args:
        model, plan, sizes: as :func:`layer_stored`.

    Returns:
        bytes.

    >>> m = Model(layers=3, hidden=128, heads=8, kv_heads=2, ffn=256, vocab=64, gated_mlp=True, seq_len=128, micro_batch=2)
    >>> layer_working(m, Parallelism(precision=Precision(activations="bfloat16")), {}) // (256 * 2)
    512
    """
    d = _dims(model, plan, sizes)
    if model.is_moe:
        return _moe_mlp(model, d)[1]
    return (2 if model.gated_mlp else 1) * d["c"] * d["T"] * d["f"]


def attention_working(model: Model, plan: Parallelism, sizes: Mapping[str, int]) -> tuple[int, int, int]:
    """The attention's moments: ``(forward extra, backward kept, backward extra)``.

    ``forward extra``: what the forward makes on top of the kept set while the attention runs
    (eager: the masked scores beside the probabilities, ``c·b·heads/tp·s²``; flash: nothing).
    ``backward kept``: what the layer still keeps once its MLP's backward has run (its attention
    part: the normed input, the attention's kept tensors, the input). ``backward extra``: the
    attention backward's working set (flash: the output's gradient and the q, k, v gradients;
    eager: the probabilities' and the scores' gradients, ``2·c·b·heads/tp·s²``, measured).

    Args:
        model, plan, sizes: as :func:`layer_stored`.

    Returns:
        the three byte counts.

    >>> attention_working(preset("tiny"), Parallelism(), {})[0]
    0
    """
    d = _dims(model, plan, sizes)
    c, T, Tn, h, q, k = d["c"], d["T"], d["Tn"], d["h"], d["q"], d["k"]
    kept = c * Tn * h + 4 * Tn + c * T * h + _attention_set(model, plan.attention, d)
    if plan.attention == "eager":
        probs = c * model.micro_batch * d["a"] * d["s"] * d["s"] * d["cp"]
        return probs, kept, 2 * probs
    return 0, kept, c * T * (2 * q + 2 * k)


def embedding_bytes(model: Model, plan: Parallelism, sizes: Mapping[str, int]) -> int:
    """The first chunk's input kept for backward: the embedding's output (``c·Tn·h``); a later
    chunk keeps the activation it received, the same size.

    Args:
        model, plan, sizes: as :func:`layer_stored`.

    Returns:
        bytes.

    >>> embedding_bytes(preset("tiny"), Parallelism(), {})
    4096
    """
    d = _dims(model, plan, sizes)
    return d["c"] * d["Tn"] * d["h"]


def head_bytes(model: Model, plan: Parallelism, sizes: Mapping[str, int]) -> int:
    """What the final norm and the head keep: the norm's ``1/rms`` and the head's input
    (gathered over tp with sequence parallelism).

    Args:
        model, plan, sizes: as :func:`layer_stored`.

    Returns:
        bytes.

    >>> head_bytes(preset("tiny"), Parallelism(), {})
    4224
    """
    d = _dims(model, plan, sizes)
    return 4 * d["Tn"] + d["c"] * d["T"] * d["h"]


class LossBytes(NamedTuple):
    """The loss's bytes (see :func:`loss_bytes`): its forward's peak, what it keeps until its
    backward, its backward's peak, and the logits a pipeline stage keeps until the stage's
    backward has run."""

    forward: int
    held: int
    backward: int
    logits: int


def loss_bytes(
    model: Model, plan: Parallelism, sizes: Mapping[str, int], logits_held: bool = False
) -> LossBytes:
    """The loss's bytes as torch computes it, ``cross_entropy`` on fp32 logits (torchtitan's
    loss): its forward's peak, what it keeps until backward, its backward's peak, and the
    logits kept through the stage's backward (``logits_held``).

    With ``n = T × V'`` logits on the rank (``V' = vocab / tp`` when the vocabulary is cut over
    tp, else the whole vocabulary): the forward makes the logits (``c·n``), their fp32 copy
    and ``log_softmax``'s fp32 output, which backward keeps; backward adds the incoming fp32
    gradient and the outgoing one (``12·n`` at its peak with the logits dropped, as torchtitan
    drops them). torch's ``loss_parallel`` (vocabulary shards) keeps four fp32 ``n``-sized
    tensors at its backward peak. ``logits_held``: the logits stay until backward (a pipeline
    stage keeps its output).

    Args:
        model, plan, sizes: as :func:`layer_stored`. logits_held: see above.

    Returns:
        a :class:`LossBytes`.

    >>> loss_bytes(preset("tiny"), Parallelism(), {})
    LossBytes(forward=81920, held=32768, backward=98304, logits=0)
    """
    d = _dims(model, plan, sizes)
    c, t = d["c"], d["t"]
    n = d["T"] * (model.vocab // t if plan.vocab_parallel and t > 1 else model.vocab)
    logits = c * n
    upcast = 4 * n if c != 4 else 0
    kept = logits if logits_held else 0
    held = 4 * n + kept
    if plan.vocab_parallel and t > 1:
        return LossBytes(logits + 12 * n, held, 16 * n + kept, kept)
    return LossBytes(logits + upcast + 4 * n, held, held + 8 * n, kept)


def korthikanti_bytes_per_layer(
    model: Model, tp: int = 1, sequence_parallel: bool = False, recompute: Recompute = "none", cp: int = 1
) -> float:
    """Korthikanti et al. 2022, *Reducing Activation Recomputation in Large Transformer Models*
    (MLSys 2023, arXiv:2205.05198), Table 2: one layer's activation bytes for ``s`` tokens per
    rank (``seq_len / cp``), micro-batch ``b``, hidden ``h``, ``a`` heads and tp size ``t``,
    16-bit activations, 1-byte dropout masks, multi-head attention and a 4h MLP:

    - none: ``sbh(10 + 24/t + 5as/(ht))``; with sequence parallelism ``sbh(34/t + 5as/(ht))``;
    - selective: ``sbh(10 + 24/t)``; with sequence parallelism ``34·sbh/t``;
    - full: ``2sbh`` (with sequence parallelism ``2sbh/t``).

    Kept for reference: what torch keeps differs (:func:`layer_stored`), and the measurement wins.

    Args:
        model: the model. tp: t. sequence_parallel: with sequence parallelism. recompute:
            ``none``, ``selective`` or ``full``. cp: the context-parallel size.

    Returns:
        bytes (a float: the formulas divide by t).

    >>> korthikanti_bytes_per_layer(preset("gpt3-175b")) / (2048 * 12288)   # 34 + 5as/h
    114.0
    """
    s, b, h, a = model.seq_len / cp, model.micro_batch, model.hidden, model.heads
    sbh = s * b * h
    attention = 5 * a * s / (h * tp)
    if recompute == "full":
        return 2 * sbh / (tp if sequence_parallel else 1)
    if sequence_parallel:
        return sbh * (34 / tp + (0 if recompute == "selective" else attention))
    return sbh * (10 + 24 / tp + (0 if recompute == "selective" else attention))


def activation_bytes_per_layer(
    model: Model,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: Recompute = "none",
    cp: int = 1,
    attention: str = "flash",
) -> int:
    """One layer's kept bytes per micro-batch, :func:`layer_stored` for a layer the policy does
    not recompute whole (``layer``: one it does not pick), in 16-bit activations.

    Args:
        model: the model. tp, cp: sizes. sequence_parallel: with sequence parallelism.
        recompute: the policy. attention: ``flash`` or ``eager``.

    Returns:
        bytes.

    >>> activation_bytes_per_layer(preset("tiny"), recompute="full") == 2 * 32 * 64
    True
    """
    plan = Parallelism(sequence_parallel=sequence_parallel, recompute=recompute, attention=attention)  # type: ignore[arg-type]
    return layer_stored(model, plan, {"tp": tp, "cp": cp}, 0)
