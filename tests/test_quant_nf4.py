"""NF4 weights: bitsandbytes' serialized Params4bit (with and without double quantization) read
into pagedkv's canonical form (against bitsandbytes' own dequantization, tests/nf4_formats.py),
and the linear_nf4 op against a plain-PyTorch linear with the dequantized weight."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICES
from nf4_formats import bnb_dequantize
from pagedkv.quant import Nf4Packed, Nf4Weight, dequantize_nf4, from_bnb_nf4, linear_nf4, linear_nf4_weight, pack_nf4
from pagedkv.tools.quant_writers import NF4_CODE, to_bnb_nf4
from test_quant_int4 import launch_plan_widths
from tolerance import assert_close_to_baseline

FORMAT_SHAPES = [(64, 8), (128, 24), (320, 17)]  # (in, out): at 17 rows, nested blocks of 32 (3, the last partial)
BLOCK_SIZES = [64, 128]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 17]
OP_SHAPES = [(256, 72), (1024, 33)]  # (in, out): out odd


def random_weight(in_features: int, out_features: int) -> torch.Tensor:
    return torch.randn(out_features, in_features) * 0.05


@pytest.mark.parametrize("in_features,out_features", FORMAT_SHAPES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("double_quant", [True, False], ids=["double_quant", "fp32_absmax"])
def test_bnb_round_trip(in_features, out_features, block_size, double_quant):
    if in_features % block_size:
        pytest.skip("block does not divide in_features")
    w = random_weight(in_features, out_features)
    state = to_bnb_nf4(w, block_size, double_quant, nested_block=256 if out_features != 17 else 32)
    canonical = from_bnb_nf4(state["weight"], {k: v for k, v in state.items() if k != "weight"})
    got = dequantize_nf4(canonical)
    assert torch.equal(got, bnb_dequantize(state))
    # Faithful: each value within half the widest NF4 step (0.28 of the absmax) of the original.
    assert ((got - w).abs() <= 0.16 * canonical.absmax.repeat_interleave(block_size, 1) + 1e-6).all()
    assert torch.equal(pack_nf4(canonical).packed.reshape(-1), state["weight"].reshape(-1))  # bnb's bytes as they are


def test_nibble_order():
    """Known bits: byte 0x1E holds the first value's code 1 in its high nibble, the second's 14
    in its low one (bitsandbytes' order)."""
    state = to_bnb_nf4(random_weight(64, 1), 64, double_quant=False)
    state["weight"] = torch.full_like(state["weight"], 0x1E)
    canonical = from_bnb_nf4(state["weight"], state)
    assert canonical.q[0, :4].tolist() == [1, 14, 1, 14]


def test_bad_quant_state_is_named():
    state = to_bnb_nf4(random_weight(128, 8), 64)
    weight = state.pop("weight")
    with pytest.raises(ValueError, match=r"weight must hold 512 bytes \(shape \[8, 128\], two values a byte\), "
                                         r"got 256"):
        from_bnb_nf4(weight[:256], state)
    with pytest.raises(ValueError, match=r"the quant state has no 'nested_quant_map'"):
        from_bnb_nf4(weight, {k: v for k, v in state.items() if "nested_quant_map" not in k})
    with pytest.raises(ValueError, match=r"quant_map must be 16 values of torch.float32"):
        from_bnb_nf4(weight, {**state, "weight.quant_map": state["weight.quant_map"].half()})
    meta = json.loads(bytes(state["weight.quant_state.bitsandbytes__nf4"].tolist()))
    fp4 = {k: v for k, v in state.items() if not k.endswith("bitsandbytes__nf4")}
    fp4["weight.quant_state.bitsandbytes__fp4"] = torch.tensor(list(json.dumps({**meta, "quant_type": "fp4"}).encode()),
                                                               dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"must hold 'quant_state.bitsandbytes__nf4' \(an NF4 layer\), found "
                                         r"\['bitsandbytes__fp4'\]"):
        from_bnb_nf4(weight, fp4)
    odd = {**state, "weight.quant_state.bitsandbytes__nf4": torch.tensor(
        list(json.dumps({**meta, "shape": [16, 64], "blocksize": 128}).encode()), dtype=torch.uint8)}
    with pytest.raises(ValueError, match=r"in_features 64 must be a multiple of the even blocksize 128"):
        from_bnb_nf4(weight, odd)


def random_layer(in_features, out_features, block_size, device) -> tuple[Nf4Packed, Nf4Weight]:
    """Random codes and absmax (any NF4 weight: no quantizer needed), packed, on `device`."""
    canonical = Nf4Weight(q=torch.randint(0, 16, (out_features, in_features), dtype=torch.uint8),
                          absmax=torch.rand(out_features, in_features // block_size) * 0.1 + 0.01,
                          code=torch.tensor(NF4_CODE), block_size=block_size)
    layer = pack_nf4(canonical)
    return Nf4Packed(layer.packed.to(device), layer.absmax.to(device), layer.code.to(device), block_size), canonical


def reference(x: torch.Tensor, canonical: Nf4Weight, dtype: torch.dtype) -> torch.Tensor:
    """Plain PyTorch: the weight dequantized to `dtype`, then F.linear in that dtype."""
    return F.linear(x.to(dtype), dequantize_nf4(canonical, dtype).to(x.device))


def assert_matches_reference(out, x, canonical, dtype) -> None:
    assert_close_to_baseline(out, baseline=reference(x, canonical, dtype),
                             reference=reference(x.double(), canonical, torch.float64))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [32, 64, 256])
@pytest.mark.parametrize("in_features,out_features", OP_SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_linear_nf4(device, dtype, block_size, in_features, out_features, rows):
    layer, canonical = random_layer(in_features, out_features, block_size, device)
    x = torch.randn(rows, in_features, dtype=dtype, device=device)
    out = torch.full((rows, out_features), float("nan"), dtype=dtype, device=device)
    linear_nf4_weight(x, layer, out=out)
    assert_matches_reference(out, x, canonical, dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [1, 5, 8])
def test_every_launch_plan(rows):
    """Output widths that take each launch plan of the 4-bit tensor-core kernel (see
    test_quant_int4.launch_plan_widths)."""
    for out_features in launch_plan_widths():
        layer, canonical = random_layer(384, out_features, 64, "cuda")
        x = torch.randn(rows, 384, dtype=torch.float16, device="cuda")
        assert_matches_reference(linear_nf4_weight(x, layer), x, canonical, torch.float16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("in_features,block_size", [(32, 32), (96, 32), (416, 32), (64, 64), (192, 64), (448, 64)])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_k_not_a_multiple_of_128(device, dtype, in_features, block_size, rows):
    """k of 1, 3 and 13 pieces of 32 codes (the tensor-core kernels' lanes take 128 k a step),
    and of an odd number of 64-code blocks (the block-scaled kernel's last step half inside)."""
    layer, canonical = random_layer(in_features, 40, block_size, device)
    x = torch.randn(rows, in_features, dtype=dtype, device=device)
    assert_matches_reference(linear_nf4_weight(x, layer), x, canonical, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [1, 8])
def test_unstreamable_block_and_leading_dims(device, rows):
    """A block of 16 (not a multiple of the kernel's 32-code pieces) goes to the dequantize +
    cuBLAS path; x [2, rows, k] keeps its leading dims; x a column slice of a wider buffer."""
    layer, canonical = random_layer(128, 24, 16, device)
    x = torch.randn(2, rows, 128, dtype=torch.bfloat16, device=device)
    out = linear_nf4_weight(x, layer)
    assert out.shape == (2, rows, 24)
    assert_matches_reference(out, x, canonical, torch.bfloat16)
    layer, canonical = random_layer(128, 24, 64, device)
    wide = torch.randn(rows, 136, dtype=torch.float16, device=device)
    assert_matches_reference(linear_nf4_weight(wide[:, 8:], layer), wide[:, 8:], canonical, torch.float16)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    layer, _ = random_layer(128, 16, 64, device)
    x = torch.randn(3, 128, device=device, dtype=torch.bfloat16)
    out = torch.empty(3, 16, device=device, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.pagedkv.linear_nf4.default,
                          (out, x, layer.packed, layer.absmax, layer.code, layer.block_size))


def test_traces_under_torch_compile():
    layer, _ = random_layer(128, 16, 64, "cpu")
    x = torch.randn(2, 128)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def project(x):
        return linear_nf4(x, layer.packed, layer.absmax, layer.code, layer.block_size)

    torch.testing.assert_close(project(x), linear_nf4_weight(x, layer))


@pytest.mark.parametrize("device", DEVICES)
def test_bad_calls_name_the_argument(device):
    layer, _ = random_layer(128, 16, 64, device)
    x = torch.randn(2, 128, device=device)
    p, a, c = layer.packed, layer.absmax, layer.code
    with pytest.raises(RuntimeError, match=r"block_size 48 must be a positive even number that divides k"):
        linear_nf4(x, p, a, c, 48)
    with pytest.raises(RuntimeError, match=r"packed has dtype Int; it must be torch.uint8"):
        linear_nf4(x, p.int(), a, c, 64)
    with pytest.raises(RuntimeError, match=r"packed must be \[n, k / 2\] with k = x.size\(-1\) = 64"):
        linear_nf4(x[:, :64], p, a, c, 64)
    with pytest.raises(RuntimeError, match=r"absmax has dtype Half; it must be torch.float32"):
        linear_nf4(x, p, a.half(), c, 64)
    with pytest.raises(RuntimeError, match=r"absmax must be \[n, k / block_size\] = \[16, 4\], got \[16, 2\]"):
        linear_nf4(x, p, a, c, 32)
    with pytest.raises(RuntimeError, match=r"code must be the \[16\] float32 codebook, got \[8\]"):
        linear_nf4(x, p, a, c[:8], 64)
    with pytest.raises(RuntimeError, match=r"out must have shape \[2, 16\]"):
        linear_nf4(x, p, a, c, 64, out=torch.empty(2, 8, device=device))
    with pytest.raises(RuntimeError, match=r"x has dtype Int"):
        linear_nf4(x.int(), p, a, c, 64)
