"""Int4 weight-only: AWQ/GPTQ checkpoints read into pagedkv's canonical form (against each
format's own dequantization formula, tests/int4_formats.py), and the linear_w4a16 op against a
plain-PyTorch linear with the dequantized weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICES
from int4_formats import awq_dequantize, gptq_dequantize, quantize, to_awq, to_gptq
from pagedkv.quant import Int4Weight, dequantize, from_awq, from_gptq, linear_w4a16, linear_w4a16_weight, pack_w4a16
from tolerance import assert_close_to_baseline

FORMAT_SHAPES = [(64, 16), (256, 96), (384, 40)]  # (in, out)
GROUP_SIZES = [32, 64, 128]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SCALE_DTYPES = [torch.float16, torch.bfloat16]
ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 17]
OP_SHAPES = [(256, 72), (1024, 33)]  # (in, out): out not a multiple of the kernel's 4 warps


def random_weight(in_features: int, out_features: int) -> torch.Tensor:
    return torch.randn(out_features, in_features) * 0.05


def assert_faithful(weight: torch.Tensor, original: torch.Tensor, scales: torch.Tensor, group_size: int) -> None:
    """The dequantized weight is the quantization of the original: off by at most a step (half
    for rounding, up to half more where the rounded zero point pushes a range end past 0..15)."""
    step = scales.float().repeat_interleave(group_size, dim=-1)
    assert ((weight - original).abs() <= step + 1e-6).all()


@pytest.mark.parametrize("in_features,out_features", [s for s in FORMAT_SHAPES if s[0] % 128 == 0 or s[0] == 64])
@pytest.mark.parametrize("group_size", GROUP_SIZES)
def test_awq_round_trip(in_features, out_features, group_size):
    if in_features % group_size:
        pytest.skip("group does not divide in_features")
    w = random_weight(in_features, out_features)
    q, scales, zeros = quantize(w, group_size)
    stored = to_awq(q, scales, zeros)
    canonical = from_awq(**stored, group_size=group_size)
    got = dequantize(canonical)
    assert torch.equal(got, awq_dequantize(**stored, group_size=group_size))
    assert torch.equal(canonical.q.long(), q) and torch.equal(canonical.zeros.long(), zeros)
    assert_faithful(got, w, scales, group_size)


def test_awq_nibble_order():
    """Known bits: word 0x76543210 holds nibble e = e, and AWQ puts nibble e at column
    AWQ_ORDER[e], so the 8 columns read 0, 4, 1, 5, 2, 6, 3, 7."""
    qweight = torch.full((32, 1), 0x76543210, dtype=torch.int32)
    canonical = from_awq(qweight, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, 8, dtype=torch.half), 32)
    assert canonical.q[:, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


@pytest.mark.parametrize("in_features,out_features", FORMAT_SHAPES)
@pytest.mark.parametrize("group_size", GROUP_SIZES)
@pytest.mark.parametrize("desc_act", [False, True], ids=["groups", "desc_act"])
@pytest.mark.parametrize("zero_offset", [True, False], ids=["gptq", "gptq_v2"])
def test_gptq_round_trip(in_features, out_features, group_size, desc_act, zero_offset):
    if in_features % group_size:
        pytest.skip("group does not divide in_features")
    w = random_weight(in_features, out_features)
    stored = to_gptq(w, group_size, zero_offset, desc_act)
    canonical = from_gptq(**stored, group_size=group_size, zero_offset=zero_offset)
    got = dequantize(canonical)
    assert torch.equal(got, gptq_dequantize(stored["qweight"], stored["qzeros"], stored["scales"],
                                            stored["g_idx"], zero_offset))
    assert (canonical.perm is not None) == (desc_act and in_features > group_size)  # one group: no order
    assert_faithful(got[:, stored["g_idx"].argsort(stable=True)], w[:, stored["g_idx"].argsort(stable=True)],
                    canonical.scales, group_size)


def test_gptq_zero_offset_reaches_16():
    """The historical format reads a stored nibble 15 as a zero of 16 (AutoGPTQ adds 1 unmasked)."""
    stored = to_gptq(random_weight(64, 8), 32, zero_offset=True, desc_act=False)
    stored["qzeros"] = torch.full_like(stored["qzeros"], -1)  # every nibble 15
    canonical = from_gptq(**stored, group_size=32, zero_offset=True)
    assert (canonical.zeros == 16).all()
    assert torch.equal(dequantize(canonical), gptq_dequantize(stored["qweight"], stored["qzeros"], stored["scales"],
                                                              stored["g_idx"], True))


def test_bad_format_tensors_are_named():
    stored = to_gptq(random_weight(64, 8), 32, zero_offset=False, desc_act=False)
    with pytest.raises(ValueError, match=r"qzeros must be \[2, 1\] of torch.int32"):
        from_gptq(stored["qweight"], stored["qzeros"][:1], stored["scales"], None, 32, False)
    with pytest.raises(ValueError, match=r"group_size 48 must be -1 or a positive divisor of in_features 64"):
        from_gptq(stored["qweight"], stored["qzeros"], stored["scales"], None, 48, False)
    g_idx = stored["g_idx"].clone()
    g_idx[0] = 1  # group 1 gets 33 rows
    with pytest.raises(ValueError, match=r"g_idx must give each of the 2 groups exactly 32 input rows"):
        from_gptq(stored["qweight"], stored["qzeros"], stored["scales"], g_idx, 32, False)
    awq = to_awq(*quantize(random_weight(64, 8), 32))
    with pytest.raises(ValueError, match=r"scales must be \[2, 8\] of torch.float16, torch.bfloat16"):
        from_awq(awq["qweight"], awq["qzeros"], awq["scales"].float(), 32)


def random_layer(in_features, out_features, group_size, scale_dtype, device, desc_act=False):
    """A packed layer of a random weight and its canonical form (desc_act: read from a GPTQ
    checkpoint; otherwise straight from the quantizer, so any out_features)."""
    w = random_weight(in_features, out_features)
    if desc_act:
        canonical = from_gptq(**to_gptq(w, group_size, False, True), group_size=group_size, zero_offset=False)
    else:
        q, scales, zeros = quantize(w, group_size)
        canonical = Int4Weight(q.to(torch.uint8), scales, zeros.to(torch.uint8), group_size, None)
    canonical.scales = canonical.scales.to(scale_dtype)
    layer = pack_w4a16(canonical)
    for name in ("packed", "scales", "zeros", "perm"):
        if getattr(layer, name) is not None:
            setattr(layer, name, getattr(layer, name).to(device))
    return layer, canonical


def reference(x: torch.Tensor, canonical, dtype: torch.dtype) -> torch.Tensor:
    """Plain PyTorch: the weight dequantized to `dtype`, then F.linear in that dtype."""
    return F.linear(x.to(dtype), dequantize(canonical, dtype).to(x.device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
@pytest.mark.parametrize("group_size", GROUP_SIZES)
@pytest.mark.parametrize("in_features,out_features", OP_SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_linear_w4a16(device, dtype, scale_dtype, group_size, in_features, out_features, rows):
    layer, canonical = random_layer(in_features, out_features, group_size, scale_dtype, device)
    x = torch.randn(rows, in_features, dtype=dtype, device=device)
    out = torch.full((rows, out_features), float("nan"), dtype=dtype, device=device)
    linear_w4a16_weight(x, layer, out=out)
    assert_close_to_baseline(out, baseline=reference(x, canonical, dtype),
                             reference=reference(x.double(), canonical, torch.float64))


def launch_plan_widths() -> list[int]:
    """Output widths that take each launch plan of the 4-bit tensor-core kernel (its tile count
    against the SMs: <= 2 tiles of 16 rows an SM, <= 4, more), the last tile partial."""
    sms = torch.cuda.get_device_properties("cuda").multi_processor_count
    return [2 * sms * 16 - 5, 4 * sms * 16 - 5, 4 * sms * 16 + 40]


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [1, 5, 8])
def test_every_launch_plan(rows):
    for out_features in launch_plan_widths():
        layer, canonical = random_layer(384, out_features, 128, torch.bfloat16, "cuda")
        x = torch.randn(rows, 384, dtype=torch.bfloat16, device="cuda")
        assert_close_to_baseline(linear_w4a16_weight(x, layer), baseline=reference(x, canonical, torch.bfloat16),
                                 reference=reference(x.double(), canonical, torch.float64))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group_size", [128, 256, 512])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_groups_of_whole_steps(dtype, group_size, rows):
    """Groups of 128 << j k, where the kernel multiplies each 128-k step's fp32 sums by the scale
    and bf16 adds the zero point as a second mma on M + q: zero points up to 16, and x with a
    large common offset, the case where M + q's sums cancel most, stay within the baseline. Widths
    of both its launch plans (<= 2 tiles an SM, > 4); 2-4 go to the previous kernel."""
    widths = launch_plan_widths()
    for out_features in (widths[0], widths[2]):
        layer, canonical = random_layer(1024, out_features, group_size, dtype, "cuda")
        canonical.zeros = torch.randint(0, 17, canonical.zeros.shape, dtype=torch.uint8)
        layer.zeros = canonical.zeros.cuda()
        x = torch.randn(rows, 1024, dtype=dtype, device="cuda") + 16
        assert_close_to_baseline(linear_w4a16_weight(x, layer), baseline=reference(x, canonical, dtype),
                                 reference=reference(x.double(), canonical, torch.float64))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 8, 17])
def test_desc_act_permutes_x(device, dtype, rows):
    """A desc_act layer: x's columns gathered in the packed order give the layer's own product."""
    layer, canonical = random_layer(256, 40, 64, torch.float16, device, desc_act=True)
    x = torch.randn(2, rows, 256, dtype=dtype, device=device)  # leading dims kept
    out = linear_w4a16_weight(x, layer)
    assert out.shape == (2, rows, 40)
    assert_close_to_baseline(out, baseline=reference(x, canonical, dtype),
                             reference=reference(x.double(), canonical, torch.float64))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("in_features", [32, 160, 416])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_k_not_a_multiple_of_128(device, dtype, in_features, rows):
    """k of 1, 5 and 13 pieces of 32 (the tensor-core kernel's lanes take 128 k a step), with
    zero points up to 16 (GPTQ's offset) and scales in x's dtype, which route there on CUDA."""
    layer, canonical = random_layer(in_features, 24, 32, dtype, device)
    canonical.zeros = torch.randint(0, 17, canonical.zeros.shape, dtype=torch.uint8)
    layer.zeros = canonical.zeros.to(device)
    x = torch.randn(rows, in_features, dtype=dtype, device=device)
    assert_close_to_baseline(linear_w4a16_weight(x, layer), baseline=reference(x, canonical, dtype),
                             reference=reference(x.double(), canonical, torch.float64))


@pytest.mark.parametrize("device", DEVICES)
def test_strided_rows(device):
    """x a column slice of a wider buffer (a fused projection's output): rows of any stride."""
    layer, canonical = random_layer(128, 16, 32, torch.float16, device)
    wide = torch.randn(3, 136, dtype=torch.bfloat16, device=device)
    x = wide[:, 8:]
    assert_close_to_baseline(linear_w4a16_weight(x, layer), baseline=reference(x, canonical, torch.bfloat16),
                             reference=reference(x.double(), canonical, torch.float64))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    layer, _ = random_layer(128, 16, 32, torch.float16, device)
    x = torch.randn(3, 128, device=device, dtype=torch.bfloat16)
    out = torch.empty(3, 16, device=device, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.pagedkv.linear_w4a16.default,
                          (out, x, layer.packed, layer.scales, layer.zeros, layer.group_size))


def test_traces_under_torch_compile():
    layer, _ = random_layer(128, 16, 32, torch.float16, "cpu")
    x = torch.randn(2, 128)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def project(x):
        return linear_w4a16(x, layer.packed, layer.scales, layer.zeros, layer.group_size)

    torch.testing.assert_close(project(x), linear_w4a16_weight(x, layer))


@pytest.mark.parametrize("device", DEVICES)
def test_bad_calls_name_the_argument(device):
    layer, _ = random_layer(128, 16, 32, torch.float16, device)
    x = torch.randn(2, 128, device=device)
    p, s, z = layer.packed, layer.scales, layer.zeros
    with pytest.raises(RuntimeError, match=r"group_size 48 must be a positive multiple of 32 that divides k"):
        linear_w4a16(x, p, s, z, 48)
    with pytest.raises(RuntimeError, match=r"group_size 256 must be .* divides k = x.size\(-1\) = 128"):
        linear_w4a16(x, p, s, z, 256)
    with pytest.raises(RuntimeError, match=r"packed has dtype Long; it must be torch.int32"):
        linear_w4a16(x, p.long(), s, z, 32)
    with pytest.raises(RuntimeError, match=r"packed must be \[n, k / 8\] with k = x.size\(-1\) = 64"):
        linear_w4a16(x[:, :64], p, s, z, 32)
    with pytest.raises(RuntimeError, match=r"scales has dtype Float; allowed: torch.float16, torch.bfloat16"):
        linear_w4a16(x, p, s.float(), z, 32)
    with pytest.raises(RuntimeError, match=r"scales must be \[n, k / group_size\] = \[16, 4\], got \[16, 2\]"):
        linear_w4a16(x, p, s[:, :2].contiguous(), z, 32)
    with pytest.raises(RuntimeError, match=r"zeros has dtype Int; allowed: torch.uint8 \(zero points\) or the "
                       r"scales' dtype Half \(float zeros"):
        linear_w4a16(x, p, s, z.int(), 32)
    with pytest.raises(RuntimeError, match=r"out must have shape \[2, 16\]"):
        linear_w4a16(x, p, s, z, 32, out=torch.empty(2, 8, device=device))
    with pytest.raises(RuntimeError, match=r"out has dtype Half but x has Float"):
        linear_w4a16(x, p, s, z, 32, out=torch.empty(2, 16, device=device, dtype=torch.half))
    with pytest.raises(RuntimeError, match=r"x has dtype Int"):
        linear_w4a16(x.int(), p, s, z, 32)
    with pytest.raises(ValueError, match=r"in_features 48 and group_size 16 to be multiples of 32"):
        pack_w4a16(from_awq(*to_awq(*quantize(random_weight(48, 8), 16)).values(), group_size=16))
