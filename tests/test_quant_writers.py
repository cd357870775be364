"""pagedkv.tools.quant_writers (the vectorized writers that tests and bench_quantized.py share):
what each writes, read back by the format's own dequantization formula transcribed loop by loop
from its package (tests/fp8_formats.py, int4_formats.py, nf4_formats.py), is the weight it was
given up to that format's rounding, on CPU and CUDA (where the benchmark writes), for shapes with
partial edge tiles. A misplaced nibble, tile or scale would be off by the weight's own size."""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICES
from fp8_formats import finegrained_dequantize
from int4_formats import compressed_tensors_int4_dequantize
from nf4_formats import bnb_dequantize
from pagedkv.tools.quant_writers import to_bnb_nf4, to_compressed_tensors_int4, to_finegrained

SHAPES = [(256, 512), (200, 320), (96, 64)]  # [out, in]: partial 128x128 edge tiles in the second


def random_weight(shape: tuple[int, int], device: str) -> torch.Tensor:
    torch.manual_seed(sum(shape))
    return (torch.randn(shape) * 0.05).to(device)


def tile_max(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Each value's tile's amax, [out, in]."""
    bn, bk = block
    out = torch.empty_like(w)
    for r in range(0, w.shape[0], bn):
        for c in range(0, w.shape[1], bk):
            out[r:r + bn, c:c + bk] = w[r:r + bn, c:c + bk].abs().amax()
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("block", [(128, 128), None], ids=["block128", "tensor"])
def test_finegrained_fp8_reads_back_within_e4m3_rounding(device, shape, block):
    w = random_weight(shape, device)
    stored = {k: v.cpu() for k, v in to_finegrained(w, block).items()}
    assert stored["weight"].dtype == torch.float8_e4m3fn and stored["weight"].shape == shape
    w = w.cpu()
    if block is not None:
        assert stored["weight_scale_inv"].shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    back = finegrained_dequantize(stored["weight"], stored["weight_scale_inv"], block)
    amax = tile_max(w, block) if block is not None else w.abs().amax()
    # e4m3: 3 mantissa bits (half an ulp is 1/16 of the value), subnormals spaced 2^-9 of 448 / amax
    assert ((back - w).abs() <= w.abs() / 16 + amax / 448 * 2**-9).all()
    assert (back - w).abs().max() > 0  # rounded, not copied


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("group", [32, 64])
def test_compressed_tensors_int4_reads_back_within_half_a_step(device, shape, group):
    w = random_weight(shape, device)
    stored = {k: v.cpu() for k, v in to_compressed_tensors_int4(w, group).items()}
    assert stored["weight_packed"].dtype == torch.int32 and stored["weight_packed"].shape == (shape[0], shape[1] // 8)
    back = compressed_tensors_int4_dequantize(**stored)
    step = stored["weight_scale"].float().repeat_interleave(group, dim=1)
    # half a step; 0.55: the bf16-rounded scale may leave amax just past 7.5 steps, clamped to 7
    assert ((back - w.cpu()).abs() <= 0.55 * step).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("double_quant", [True, False])
def test_bnb_nf4_reads_back_within_half_a_code_gap(device, shape, double_quant):
    w = random_weight(shape, device)
    state = {k: v.cpu() for k, v in to_bnb_nf4(w, 64, double_quant, nested_block=256).items()}
    assert state["weight"].shape == (shape[0] * shape[1] // 2, 1) and state["weight"].dtype == torch.uint8
    back = bnb_dequantize(state)
    absmax = w.cpu().reshape(-1, 64).abs().amax(-1, keepdim=True)
    # NF4's widest gap (-1 to -0.696) halved; double quantization's absmax error (8-bit dynamic
    # code of absmax - mean) adds ~1% of absmax
    bound = (0.153 + (0.02 if double_quant else 1e-6)) * absmax
    assert ((back.reshape(-1, 64) - w.cpu().reshape(-1, 64)).abs() <= bound).all()
