"""The sender's block-fp8 quantizer (torch): whole blocks of the last two axes, DeepSeek-V3's
and vLLM's format — per block of ``block = (rows, cols)`` elements,
``scale_inv = max(amax, 1e-4) / 448`` (``amax`` the block's largest magnitude, 448
float8_e4m3fn's largest finite value; the floor of ``1e-4`` gives an all-zero block a scale to
divide by), and the values ``clamp(x / scale_inv, -448, 448)`` cast to float8_e4m3fn; a partial
block at the end of an axis is a block of what it has::

    >>> import torch
    >>> q, s = quantize_blocks(torch.tensor([[1.0, -2.0], [0.5, 4.0]]), (1, 2))
    >>> s.flatten().tolist(), q.float().tolist()
    ([0.004464285913854837, 0.008928571827709675], [[224.0, -448.0], [56.0, 448.0]])

Computed in float32 from the trainer's values wherever they live (a sender's own shard: the
plan gives it whole blocks), so a rank's blocks equal those of the full tensor bit for bit.
"""

from __future__ import annotations

import torch

#: The largest finite float8_e4m3fn value.
FP8_MAX = 448.0
#: The least ``amax`` a block's scale is computed from (an all-zero block).
MIN_AMAX = 1e-4


def _blocks(x: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, tuple[int, int]]:
    """``x`` in float32, zero-padded to whole blocks and viewed ``[..., nr, br, nc, bc]``."""
    if x.dim() < 2:
        raise ValueError(f"block fp8 needs 2 or more axes, got shape {tuple(x.shape)}")
    rows, cols = x.shape[-2:]
    br, bc = block
    nr, nc = -(-rows // br), -(-cols // bc)
    x32 = x.to(torch.float32)
    if (nr * br, nc * bc) != (rows, cols):  # zeros change no block's amax
        x32 = torch.nn.functional.pad(x32, (0, nc * bc - cols, 0, nr * br - rows))
    return x32.reshape(*x.shape[:-2], nr, br, nc, bc), (nr, nc)


def block_scales(x: torch.Tensor, block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """The float32 ``scale_inv`` of each block of ``x``'s last two axes.

    Args:
        x: any float tensor of 2 or more axes.
        block: rows and columns of a block.

    Returns:
        ``[..., ceil(rows / block[0]), ceil(cols / block[1])]`` float32.

    Raises:
        ValueError: fewer than 2 axes.

    >>> block_scales(torch.full((3, 3), 448.0), (2, 2)).tolist()
    [[1.0, 1.0], [1.0, 1.0]]
    """
    v, _ = _blocks(x, block)
    amax = v.abs().amax(dim=(-3, -1)).clamp(min=MIN_AMAX)
    return amax / FP8_MAX


def quantize_blocks(
    x: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` as block-fp8 values and their scales, DeepSeek-V3's and vLLM's format: per block,
    ``scale_inv = amax / 448`` and the values ``clamp(x / scale_inv, -448, 448)`` as float8_e4m3fn.

    Args:
        x: any float tensor of 2 or more axes.
        block: rows and columns of a block.

    Returns:
        ``(values, scale_inv)``: float8_e4m3fn of ``x``'s shape, and :func:`block_scales`.

    Raises:
        ValueError: fewer than 2 axes.

    >>> q, s = quantize_blocks(torch.ones(2, 2))
    >>> q.dtype, s.shape
    (torch.float8_e4m3fn, torch.Size([1, 1]))
    """
    v, (nr, nc) = _blocks(x, block)
    scale = block_scales(x, block)
    q = (v / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    rows, cols = x.shape[-2:]
    q = q.reshape(*x.shape[:-2], nr * block[0], nc * block[1])[..., :rows, :cols]
    return q.to(torch.float8_e4m3fn), scale


__all__ = ["FP8_MAX", "MIN_AMAX", "block_scales", "quantize_blocks"]
