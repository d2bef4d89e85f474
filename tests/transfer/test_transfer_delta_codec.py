"""The delta codec (``meshgroups.transfer._run.delta_codec``), in one process: every encoding
leaves the receiver bit-exact, on any strides and dtypes; the smallest one is chosen; the
digest sees any one changed element."""

from __future__ import annotations

import pytest
import torch

from meshgroups.transfer._run.delta_codec import (
    BLOCKS,
    DENSE,
    SPARSE,
    apply,
    bits,
    digest,
    encode,
    encoded_bytes,
    index_bytes,
)

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn]


def _changed(old: torch.Tensor, where: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """``old`` with new random values at ``where`` (bits differ there)."""
    new = old.clone()
    fresh = (torch.randn(int(where.sum()), generator=gen) * 3).to(old.dtype)
    bits(new).view(-1)[where.view(-1)] = bits(fresh)  # as integers: float8 has no index kernels
    return new


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("density", [0.0, 0.002, 0.03, 0.4, 1.0])
def test_every_encoding_is_bit_exact(dtype: torch.dtype, density: float) -> None:
    gen = torch.Generator().manual_seed(int(density * 1000) + len(str(dtype)))
    old = torch.randn(37, 70, generator=gen).to(dtype)
    where = torch.rand(37, 70, generator=gen) < density
    new = _changed(old, where, gen)
    mode, count, payload = encode(new, old, block=16)
    target = old.clone()
    apply(target, mode, count, payload, block=16)
    assert torch.equal(bits(target), bits(new)), (dtype, density, mode)
    # the smallest of the three encodings, and never more than dense
    assert payload.numel() <= new.numel() * new.element_size()
    if not bool((bits(new) != bits(old)).any()):
        assert (mode, count, payload.numel()) == (SPARSE, 0, 0)


def test_clustered_changes_go_as_blocks_and_spread_ones_as_positions() -> None:
    old = torch.zeros(64, 64, dtype=torch.bfloat16)
    rows = old.clone()
    rows[5] = 1.0  # a whole row: one embedding row of a token seen
    rows[40] = 2.0
    mode, count, payload = encode(rows, old, block=64)
    assert (mode, count, payload.numel()) == (BLOCKS, 2, 2 * 4 + 2 * 64 * 2)
    spread = old.clone()
    spread.view(-1)[::97] = 1.0  # 43 isolated elements
    mode, count, payload = encode(spread, old, block=64)
    assert (mode, count, payload.numel()) == (SPARSE, 43, 43 * 6)
    everything = torch.ones(64, 64, dtype=torch.bfloat16)
    assert encode(everything, old)[0] == DENSE
    assert encoded_bytes(SPARSE, 43, 64 * 64, 2) == 43 * 6 and index_bytes(2**31) == 8


def test_a_short_last_block_and_non_contiguous_views() -> None:
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(10, 13, generator=gen).to(torch.bfloat16)
    old = base[:, 2:11]  # a column box of a tensor: not contiguous (rows of 9 out of 13)
    new = old.clone()
    new[9, 5:] = 7.0  # the slice's last 4 elements: its short last block (90 = 5 * 16 + 10)
    new[0, 0] = -0.0  # bits differ from 0.0 only if old held 0.0; old is random
    mode, count, payload = encode(new, old.contiguous(), block=16)
    assert mode in (SPARSE, BLOCKS)
    target = base.clone()
    apply(target[:, 2:11], mode, count, payload, block=16)
    assert torch.equal(bits(target[:, 2:11]), bits(new))
    assert torch.equal(target[:, :2], base[:, :2]) and torch.equal(target[:, 11:], base[:, 11:])
    # the payload may be a piece at any offset of a packed buffer
    packed = torch.cat([torch.zeros(3, dtype=torch.uint8), payload])
    again = base.clone()
    apply(again[:, 2:11], mode, count, packed[3:], block=16)
    assert torch.equal(again, target)


def test_signed_zero_and_nan_by_bits() -> None:
    old = torch.tensor([0.0, float("nan"), 1.0] * 4, dtype=torch.bfloat16)
    new = torch.tensor([-0.0, float("nan"), 1.0] + [0.0, float("nan"), 1.0] * 3, dtype=torch.bfloat16)
    mode, count, payload = encode(new, old)
    assert (mode, count) == (SPARSE, 1)  # -0.0 is a change; the same NaN is not
    apply(old, mode, count, payload)
    assert torch.equal(bits(old), bits(new))


def test_scalar_and_refusals() -> None:
    old, new = torch.tensor(1.0), torch.tensor(2.0)
    mode, count, payload = encode(new, old)
    apply(old, mode, count, payload)
    assert old.item() == 2.0
    with pytest.raises(ValueError, match="one shape and dtype"):
        encode(torch.zeros(2), torch.zeros(3))
    with pytest.raises(ValueError, match="needs 8 bytes"):
        apply(torch.zeros(2), DENSE, 0, torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(TypeError, match="no delta encoding"):
        bits(torch.zeros(2, dtype=torch.complex128))


def test_digest_sees_any_one_element_and_ignores_strides() -> None:
    gen = torch.Generator().manual_seed(5)
    t = torch.randn(50, 123, generator=gen).to(torch.bfloat16)
    d = digest(t)
    assert digest(t.clone()) == d
    assert digest(t.t().contiguous().t()) == d  # the same values in other strides
    for pos in (0, 4095, 4096, 50 * 123 - 1):
        u = t.clone()
        flat = u.view(-1)
        flat[pos] = torch.tensor(float(flat[pos]) + 1.0).to(torch.bfloat16)
        assert digest(u) != d, pos
    swapped = t.clone().view(-1)
    swapped[0], swapped[1] = t.view(-1)[1].clone(), t.view(-1)[0].clone()
    assert digest(swapped) != d or bool(torch.equal(t.view(-1)[0], t.view(-1)[1]))
    fp8 = torch.randn(300, generator=gen).to(torch.float8_e4m3fn)
    assert digest(fp8) == digest(fp8.clone())
