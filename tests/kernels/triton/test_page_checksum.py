"""page_checksum: Triton kernel == torch reference bit for bit, and the sum moves with any change of a page."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, on_device

from edgeinfer import kernels
from edgeinfer.kernels.page_checksum import page_checksum_reference, page_checksum_triton

# (pages, bytes per page): one word, a partial last block, several blocks, no pages
SHAPES = [(1, 4), (3, 1028), (5, 3 * 4096 + 12), (0, 64)]


def pages(n: int, nbytes: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, nbytes), dtype=torch.uint8, generator=g)


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{b}" for n, b in SHAPES])
def test_kernel_matches_reference(shape):
    buf = pages(*shape)
    buf[:, :4] = 255                  # words with the top bit set (negative as int32) and extremes
    if shape[0] > 1:
        buf[1] = 0
    want = page_checksum_reference(buf)
    got = page_checksum_triton(on_device(buf)).cpu()
    assert torch.equal(got, want)
    assert kernels.page_checksum(buf).tolist() == want.tolist()      # CPU tensors: the reference
    if DEVICE == "cuda":
        assert torch.equal(kernels.page_checksum(on_device(buf)).cpu(), want)


def test_every_kind_of_damage_changes_the_sum():
    buf = pages(6, 2048, seed=1)
    base = page_checksum_reference(buf).tolist()
    assert len(set(base)) == 6                                     # distinct pages, distinct sums
    cases = []
    one_bit = buf.clone()
    one_bit[0, 777] ^= 0x10                                        # a flipped bit
    cases.append(one_bit)
    swapped = buf.clone()
    swapped[0, 0:4], swapped[0, 4:8] = buf[0, 4:8].clone(), buf[0, 0:4].clone()   # two words swapped
    cases.append(swapped)
    other = buf.clone()
    other[0, 1024:] = buf[1, 1024:]                                # half of another page
    cases.append(other)
    zeroed = buf.clone()
    zeroed[0, :512] = 0
    cases.append(zeroed)
    for damaged in cases:
        got = page_checksum_triton(on_device(damaged)).cpu().tolist()
        assert got[0] != base[0] and got[1:] == base[1:]


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="multiple of 4"):
        page_checksum_reference(torch.zeros(2, 6, dtype=torch.uint8))
    with pytest.raises(ValueError, match="dtype must be one of"):
        page_checksum_reference(torch.zeros(2, 8, dtype=torch.int32))
