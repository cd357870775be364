"""FP8 weights: FineGrainedFP8 and compressed-tensors checkpoints read into pagedkv's canonical
form (against each format's own dequantization formula, tests/fp8_formats.py), and the
linear_fp8_weight op against a plain-PyTorch linear with the dequantized weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICES
from fp8_formats import compressed_tensors_dequantize, finegrained_dequantize, to_compressed_tensors
from pagedkv.quant import (Fp8Weight, dequantize_fp8, from_compressed_tensors_fp8, from_finegrained_fp8, linear_fp8,
                           linear_fp8_weight)
from pagedkv.tools.quant_writers import to_finegrained
from tolerance import assert_close_to_baseline

FORMAT_SHAPES = [(256, 128), (384, 200), (200, 72)]  # (in, out): partial edge blocks of 128
BLOCKS = [(128, 128), (64, 32), None]  # None: per tensor
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 17]
OP_SHAPES = [(256, 72), (1040, 33)]  # (in, out): out odd; 1040 = 8 blocks of 128 and a partial one


def random_weight(in_features: int, out_features: int) -> torch.Tensor:
    return torch.randn(out_features, in_features) * 0.05


def assert_faithful(weight: torch.Tensor, original: torch.Tensor) -> None:
    """The dequantized weight is the e4m3 rounding of the original: 3 mantissa bits, relative
    error at most 2^-4 (plus subnormals near 0 of a block)."""
    assert ((weight - original).abs() <= original.abs() / 16 + 1e-3 * original.abs().max()).all()


@pytest.mark.parametrize("in_features,out_features", FORMAT_SHAPES)
@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_finegrained_round_trip(in_features, out_features, block):
    w = random_weight(in_features, out_features)
    stored = to_finegrained(w, block)
    canonical = from_finegrained_fp8(**stored, block_size=None if block is None else list(block))
    got = dequantize_fp8(canonical)
    assert torch.equal(got, finegrained_dequantize(**stored, block=block))
    assert canonical.scales.dtype == torch.float32 and canonical.weight.dtype == torch.float8_e4m3fn
    assert_faithful(got, w)


def test_finegrained_ue8m0_scales():
    """scale_fmt "ue8m0": float8_e8m0fnu power-of-two scales widen exactly to fp32."""
    w = random_weight(256, 128)
    stored = to_finegrained(w, (128, 128), ue8m0=True)
    assert stored["weight_scale_inv"].dtype == torch.float8_e8m0fnu
    got = dequantize_fp8(from_finegrained_fp8(**stored, block_size=[128, 128]))
    assert torch.equal(got, finegrained_dequantize(**stored, block=(128, 128)))
    assert_faithful(got, w)


def test_finegrained_matches_transformers_own_dequantization():
    """Where transformers has its dequantization helper (5.24; not 5.17), it agrees with the reader."""
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    if not hasattr(fp8, "_dequantize_fp8_weight"):
        pytest.skip("this transformers has no _dequantize_fp8_weight")
    stored = to_finegrained(random_weight(384, 200), (128, 128))
    expected = fp8._dequantize_fp8_weight(stored["weight"], stored["weight_scale_inv"], [128, 128], torch.float32)
    assert torch.equal(dequantize_fp8(from_finegrained_fp8(**stored, block_size=[128, 128])), expected)


@pytest.mark.parametrize("in_features,out_features", FORMAT_SHAPES)
@pytest.mark.parametrize("strategy", ["channel", "tensor", "block"])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_compressed_tensors_round_trip(in_features, out_features, strategy, scale_dtype):
    w = random_weight(in_features, out_features)
    block = (128, 128) if strategy == "block" else None
    stored = to_compressed_tensors(w, strategy, scale_dtype, block)
    canonical = from_compressed_tensors_fp8(**stored, block_size=block)
    got = dequantize_fp8(canonical)
    assert torch.equal(got, compressed_tensors_dequantize(**stored, block=block))
    expected_block = {"channel": (1, in_features), "tensor": (out_features, in_features), "block": (128, 128)}
    assert canonical.block == expected_block[strategy]
    if scale_dtype == torch.float32:
        assert_faithful(got, w)


def test_bad_format_tensors_are_named():
    stored = to_finegrained(random_weight(256, 128), (128, 128))
    with pytest.raises(ValueError, match=r"weight_scale_inv must be \[1, 2\] \(ceil of weight \[128, 256\] / block "
                                         r"\[128, 128\]\), got \[1, 1\]"):
        from_finegrained_fp8(stored["weight"], stored["weight_scale_inv"][:, :1], [128, 128])
    with pytest.raises(ValueError, match=r"weight must be \[out, in\] of torch.float8_e4m3fn, got \[128, 256\] "
                                         r"torch.bfloat16"):
        from_finegrained_fp8(stored["weight"].bfloat16(), stored["weight_scale_inv"], [128, 128])
    with pytest.raises(ValueError, match=r"weight_scale_inv has dtype torch.float16; allowed: torch.float32"):
        from_finegrained_fp8(stored["weight"], stored["weight_scale_inv"].half(), [128, 128])
    with pytest.raises(ValueError, match=r"weight_scale_inv must be one scalar without a block size"):
        from_finegrained_fp8(stored["weight"], stored["weight_scale_inv"], None)
    with pytest.raises(ValueError, match=r"block size \[0, 128\] must be two positive sizes"):
        from_finegrained_fp8(stored["weight"], stored["weight_scale_inv"], [0, 128])
    ct = to_compressed_tensors(random_weight(256, 128), "channel")
    with pytest.raises(ValueError, match=r"weight_scale must be \[128, 1\] \(per channel\) or one value"):
        from_compressed_tensors_fp8(ct["weight"], ct["weight_scale"][:64])
    with pytest.raises(ValueError, match=r"weight_scale has dtype torch.int32"):
        from_compressed_tensors_fp8(ct["weight"], ct["weight_scale"].int())


def random_layer(in_features, out_features, block, device) -> Fp8Weight:
    canonical = from_finegrained_fp8(**to_finegrained(random_weight(in_features, out_features), block),
                                     block_size=None if block is None else list(block))
    return Fp8Weight(canonical.weight.to(device), canonical.scales.to(device), canonical.block)


def channel_layer(in_features, out_features, device) -> Fp8Weight:
    canonical = from_compressed_tensors_fp8(**to_compressed_tensors(random_weight(in_features, out_features),
                                                                    "channel"))
    return Fp8Weight(canonical.weight.to(device), canonical.scales.to(device), canonical.block)


def reference(x: torch.Tensor, layer: Fp8Weight, dtype: torch.dtype) -> torch.Tensor:
    """Plain PyTorch: the weight dequantized to `dtype`, then F.linear in that dtype."""
    return F.linear(x.to(dtype), dequantize_fp8(layer, dtype).to(x.device))


def assert_matches_reference(out: torch.Tensor, x: torch.Tensor, layer: Fp8Weight, dtype: torch.dtype) -> None:
    assert_close_to_baseline(out, baseline=reference(x, layer, dtype),
                             reference=reference(x.double(), layer, torch.float64))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [(128, 128), (1, 16), (32, 64), None], ids=str)
@pytest.mark.parametrize("in_features,out_features", OP_SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_linear_fp8_weight(device, dtype, block, in_features, out_features, rows):
    layer = random_layer(in_features, out_features, block, device)
    x = torch.randn(rows, in_features, dtype=dtype, device=device)
    out = torch.full((rows, out_features), float("nan"), dtype=dtype, device=device)
    linear_fp8(x, layer, out=out)
    assert_matches_reference(out, x, layer, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 8])
def test_every_e4m3_value_exactly(device, dtype, rows):
    """Each of the 254 finite e4m3 codes (subnormals, both zeros, +-448) comes out of the product
    exactly: W[j, c] = code[(j + c) % 254] under a scale of 1, x rows one-hot, so out[i, j] is one
    weight times 1 plus zeros, exact in any accumulation and in x's dtype (e4m3 fits both)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes = codes[(codes != 0x7F) & (codes != 0xFF)].view(torch.float8_e4m3fn)  # [254]
    n, k = 256, 256
    index = (torch.arange(n).unsqueeze(1) + torch.arange(k).unsqueeze(0)) % codes.numel()
    layer = Fp8Weight(codes[index].contiguous().to(device), torch.ones(1, 1, device=device), (n, k))
    x = torch.zeros(rows, k, dtype=dtype, device=device)
    x[torch.arange(rows), torch.arange(rows) * 31] = 1  # row i picks column 31 i
    out = linear_fp8(x, layer)
    expected = codes[index[:, torch.arange(rows) * 31].T].to(dtype)  # [rows, n]
    assert torch.equal(out.cpu(), expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 8])
def test_per_channel_and_unstreamable_shapes(device, dtype, rows):
    """Per-channel scales (compressed-tensors), and shapes the CUDA GEMV does not take (in not a
    multiple of 16, a block of 8 columns), which go to the dequantize + cuBLAS path."""
    for layer in (channel_layer(512, 24, device), random_layer(200, 24, (128, 128), device),
                  random_layer(256, 24, (16, 8), device)):
        x = torch.randn(rows, layer.weight.shape[1], dtype=dtype, device=device)
        assert_matches_reference(linear_fp8(x, layer), x, layer, dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_leading_dims_and_strided_rows(device):
    """x [2, 3, k] keeps its leading dims; x a column slice of a wider buffer (a fused
    projection's output): rows of any stride."""
    layer = random_layer(256, 40, (128, 128), device)
    x = torch.randn(2, 3, 256, dtype=torch.bfloat16, device=device)
    out = linear_fp8(x, layer)
    assert out.shape == (2, 3, 40)
    assert_matches_reference(out, x, layer, torch.bfloat16)
    wide = torch.randn(3, 264, dtype=torch.bfloat16, device=device)
    assert_matches_reference(linear_fp8(wide[:, 8:], layer), wide[:, 8:], layer, torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    layer = random_layer(256, 16, (128, 128), device)
    x = torch.randn(3, 256, device=device, dtype=torch.bfloat16)
    out = torch.empty(3, 16, device=device, dtype=torch.bfloat16)
    # test_schema compares inputs before and after with ops that have no float8 kernel on the CPU
    # (mul): it runs on the other three.
    torch.library.opcheck(torch.ops.pagedkv.linear_fp8_weight.default, (out, x, layer.weight, layer.scales, 128, 128),
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_traces_under_torch_compile():
    layer = random_layer(256, 16, (128, 128), "cpu")
    x = torch.randn(2, 256)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def project(x):
        return linear_fp8_weight(x, layer.weight, layer.scales, layer.block)

    torch.testing.assert_close(project(x), linear_fp8(x, layer))


@pytest.mark.parametrize("device", DEVICES)
def test_bad_calls_name_the_argument(device):
    layer = random_layer(256, 16, (128, 128), device)
    x = torch.randn(2, 256, device=device)
    w, s = layer.weight, layer.scales
    with pytest.raises(RuntimeError, match=r"weight has dtype BFloat16; it must be torch.float8_e4m3fn"):
        linear_fp8_weight(x, w.bfloat16(), s, (128, 128))
    with pytest.raises(RuntimeError, match=r"weight must be \[n, k\] with k = x.size\(-1\) = 128"):
        linear_fp8_weight(x[:, :128], w, s, (128, 128))
    with pytest.raises(RuntimeError, match=r"block \(0, 128\) must be two positive sizes"):
        linear_fp8_weight(x, w, s, (0, 128))
    with pytest.raises(RuntimeError, match=r"scales has dtype BFloat16; it must be torch.float32"):
        linear_fp8_weight(x, w, s.bfloat16(), (128, 128))
    with pytest.raises(RuntimeError, match=r"scales must be \[ceil\(n / block_n\), ceil\(k / block_k\)\] = \[1, 4\], "
                                           r"got \[1, 2\]"):
        linear_fp8_weight(x, w, s, (128, 64))
    with pytest.raises(RuntimeError, match=r"out must have shape \[2, 16\]"):
        linear_fp8_weight(x, w, s, (128, 128), out=torch.empty(2, 8, device=device))
    with pytest.raises(RuntimeError, match=r"out has dtype Half but x has Float"):
        linear_fp8_weight(x, w, s, (128, 128), out=torch.empty(2, 16, device=device, dtype=torch.half))
    with pytest.raises(RuntimeError, match=r"x has dtype Int"):
        linear_fp8_weight(x.int(), w, s, (128, 128))
