"""copy_blocks against block-by-block indexing in plain PyTorch, over every layer's K and V."""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICES
from pagedkv import ops

DTYPES = [torch.float32, torch.bfloat16, torch.uint8]  # uint8: an fp8-sized cache, 1-byte units
BLOCK_SIZES = [1, 16]
HEAD_DIMS = [64, 3]  # 3: block bytes not a multiple of 16, so narrower copy units
NUM_LAYERS = [1, 70]  # 70: more layers than one CUDA launch carries (64)
INDEX_DTYPES = [torch.int32, torch.int64]
NUM_BLOCKS = 12


def random_caches(num_layers, block_size, head_dim, dtype, device):
    shape = (NUM_BLOCKS, block_size, 2, head_dim)
    if dtype == torch.uint8:
        make = lambda: torch.randint(1, 256, shape, dtype=dtype, device=device)  # noqa: E731
    else:
        make = lambda: torch.randn(shape, dtype=dtype, device=device)  # noqa: E731
    return [make() for _ in range(num_layers)], [make() for _ in range(num_layers)]


def reference(caches, src, dst):
    expected = [c.clone() for c in caches]
    for e in expected:
        e[dst.long()] = e[src.long()]
    return expected


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("num_layers", NUM_LAYERS)
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
def test_copy_blocks(device, dtype, block_size, head_dim, num_layers, index_dtype):
    k_caches, v_caches = random_caches(num_layers, block_size, head_dim, dtype, device)
    perm = torch.randperm(NUM_BLOCKS)
    src, dst = perm[:4].to(index_dtype).to(device), perm[4:8].to(index_dtype).to(device)
    k_expected, v_expected = reference(k_caches, src, dst), reference(v_caches, src, dst)
    if dtype != torch.uint8:  # poison the destinations: a block left unwritten shows as NaN
        for c in k_caches + v_caches:
            c[dst.long()] = float("nan")

    ops.copy_blocks(k_caches, v_caches, src, dst)

    for got, want in zip(k_caches + v_caches, k_expected + v_expected):
        assert torch.equal(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_no_pairs_is_a_no_op(device):
    k_caches, v_caches = random_caches(2, 16, 64, torch.float32, device)
    before = [c.clone() for c in k_caches + v_caches]
    empty = torch.empty(0, dtype=torch.int32, device=device)
    ops.copy_blocks(k_caches, v_caches, empty, empty)
    assert all(torch.equal(a, b) for a, b in zip(k_caches + v_caches, before))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    k_caches, v_caches = random_caches(2, 4, 8, torch.float32, device)
    src = torch.tensor([0, 1], dtype=torch.int32, device=device)
    dst = torch.tensor([5, 6], dtype=torch.int32, device=device)
    torch.library.opcheck(torch.ops.pagedkv.copy_blocks.default, (k_caches, v_caches, src, dst))


@pytest.mark.parametrize("device", DEVICES)
def test_bad_calls_name_the_argument(device):
    k_caches, v_caches = random_caches(2, 4, 8, torch.float32, device)
    src = torch.tensor([0], dtype=torch.int32, device=device)
    with pytest.raises(RuntimeError, match=r"non-empty lists of equal length, got 2 and 1"):
        ops.copy_blocks(k_caches, v_caches[:1], src, src)
    with pytest.raises(RuntimeError, match=r"v_caches\[1\] has shape .* but k_caches\[0\] has shape"):
        ops.copy_blocks(k_caches, [v_caches[0], v_caches[1][:, :2]], src, src)
    with pytest.raises(RuntimeError, match=r"dst has dtype Long but src has Int"):
        ops.copy_blocks(k_caches, v_caches, src, src.long())
    with pytest.raises(RuntimeError, match=r"src has dtype Float; allowed: torch.int32 or torch.int64"):
        ops.copy_blocks(k_caches, v_caches, src.float(), src.float())
    if device == "cpu":  # the CUDA kernel skips out-of-range ids instead of raising
        with pytest.raises(RuntimeError, match=r"pair 0 \(0 -> 12\) is outside the cache's \[0, 12\) blocks"):
            ops.copy_blocks(k_caches, v_caches, src, torch.tensor([12], dtype=torch.int32))
