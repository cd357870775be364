"""LLM.int8 weights: bitsandbytes' serialized Linear8bitLt read into pagedkv's canonical form
(against bitsandbytes' own dequantization, tests/int8_formats.py), and the linear_int8 op against a
plain-PyTorch linear with the dequantized weight, on the CPU and CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICES
from int8_formats import bnb_int8_dequantize
from pagedkv.quant import Int8Weight, dequantize_int8, from_bnb_int8, linear_int8, linear_int8_weight
from pagedkv.tools.quant_writers import to_bnb_int8
from tolerance import assert_close_to_baseline

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ROWS = [1, 2, 3, 5, 8, 9, 17]
OP_SHAPES = [(256, 72), (1040, 33), (40, 16)]  # (in, out): out odd; in 40 not a multiple of 16


@pytest.mark.parametrize("weight_format", [True, False])
@pytest.mark.parametrize("in_features,out_features", [(64, 8), (96, 17)])
def test_bnb_round_trip(weight_format, in_features, out_features):
    w = torch.randn(out_features, in_features) * 0.05
    state = to_bnb_int8(w, weight_format)
    canonical = from_bnb_int8(state["weight"], state["SCB"], state.get("weight_format"))
    got = dequantize_int8(canonical)
    assert torch.equal(got, bnb_int8_dequantize(state))
    assert ((got - w).abs() <= 0.5 / 127 * state["SCB"].unsqueeze(-1) * 1.0001).all()  # faithful: half a step
    assert torch.equal(canonical.q, state["weight"])  # the stored values as they are


def test_bad_state_is_named():
    state = to_bnb_int8(torch.randn(8, 64))
    with pytest.raises(ValueError, match=r"weight must be \[out, in\] int8, got \[8, 64\] torch.uint8"):
        from_bnb_int8(state["weight"].view(torch.uint8), state["SCB"])
    with pytest.raises(ValueError, match=r"SCB must be 8 float32 row absmaxes, got \[4\] torch.float32"):
        from_bnb_int8(state["weight"], state["SCB"][:4])
    with pytest.raises(ValueError, match=r"weight_format \[1\] must be 0 \('row'"):
        from_bnb_int8(state["weight"], state["SCB"], torch.tensor(1, dtype=torch.uint8))


def random_layer(in_features: int, out_features: int, device) -> Int8Weight:
    """Random int8 values and row absmaxes (any LLM.int8 weight: no quantizer needed), on `device`."""
    q = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8)
    return Int8Weight(q=q.to(device), scb=(torch.rand(out_features) * 0.1 + 0.01).to(device))


def assert_matches_reference(out, x, layer, dtype) -> None:
    """Plain PyTorch: the weight dequantized to `dtype`, F.linear in that dtype (and in float64)."""
    w = dequantize_int8(layer)
    assert_close_to_baseline(out, baseline=F.linear(x.to(dtype), w.to(dtype)),
                             reference=F.linear(x.double(), w.double()))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("in_features,out_features", OP_SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_linear_int8(device, dtype, in_features, out_features, rows):
    layer = random_layer(in_features, out_features, device)
    x = torch.randn(rows, in_features, dtype=dtype, device=device)
    out = torch.full((rows, out_features), float("nan"), dtype=dtype, device=device)
    linear_int8_weight(x, layer, out=out)
    assert_matches_reference(out, x, layer, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 8])
def test_every_int8_value_exactly(device, dtype, rows):
    """Each int8 value -128..127 comes out of the product exactly: q[j, c] = (j + c) % 256 - 128
    under scb = 127 (a row scale of 1), x rows one-hot, so out[i, j] is one value times 1 plus
    zeros, exact in any accumulation and in x's dtype."""
    n, k = 256, 256
    q = ((torch.arange(n).unsqueeze(1) + torch.arange(k).unsqueeze(0)) % 256 - 128).to(torch.int8)
    layer = Int8Weight(q=q.to(device), scb=torch.full((n,), 127.0, device=device))
    x = torch.zeros(rows, k, dtype=dtype, device=device)
    x[torch.arange(rows), torch.arange(rows) * 31] = 1  # row i picks column 31 i
    out = linear_int8_weight(x, layer)
    expected = dequantize_int8(layer).cpu()[:, torch.arange(rows) * 31].T.to(dtype)  # [rows, n]
    assert torch.equal(out.cpu(), expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [1, 8])
def test_leading_dims_and_strided_rows(device, rows):
    """x [2, rows, k] keeps its leading dims; x a column slice of a wider buffer (row stride 136)."""
    layer = random_layer(128, 24, device)
    x = torch.randn(2, rows, 128, dtype=torch.bfloat16, device=device)
    out = linear_int8_weight(x, layer)
    assert out.shape == (2, rows, 24)
    assert_matches_reference(out, x, layer, torch.bfloat16)
    wide = torch.randn(rows, 136, dtype=torch.float16, device=device)
    assert_matches_reference(linear_int8_weight(wide[:, 8:], layer), wide[:, 8:], layer, torch.float16)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    layer = random_layer(128, 16, device)
    x = torch.randn(3, 128, device=device, dtype=torch.bfloat16)
    out = torch.empty(3, 16, device=device, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.pagedkv.linear_int8.default, (out, x, layer.q, layer.scb))


def test_traces_under_torch_compile():
    layer = random_layer(128, 16, "cpu")
    x = torch.randn(2, 128)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def project(x):
        return linear_int8(x, layer.q, layer.scb)

    torch.testing.assert_close(project(x), linear_int8_weight(x, layer))


@pytest.mark.parametrize("device", DEVICES)
def test_bad_calls_name_the_argument(device):
    layer = random_layer(128, 16, device)
    x = torch.randn(2, 128, device=device)
    q, scb = layer.q, layer.scb
    with pytest.raises(RuntimeError, match=r"q has dtype Byte; it must be torch.int8"):
        linear_int8(x, q.view(torch.uint8), scb)
    with pytest.raises(RuntimeError, match=r"q must be \[n, k\] with k = x.size\(-1\) = 64"):
        linear_int8(x[:, :64], q, scb)
    with pytest.raises(RuntimeError, match=r"scb has dtype Half; it must be torch.float32"):
        linear_int8(x, q, scb.half())
    with pytest.raises(RuntimeError, match=r"scb must be \[n\] = \[16\], got \[8\]"):
        linear_int8(x, q, scb[:8])
    with pytest.raises(RuntimeError, match=r"out must have shape \[2, 16\]"):
        linear_int8(x, q, scb, out=torch.empty(2, 8, device=device))
    with pytest.raises(RuntimeError, match=r"x has dtype Int"):
        linear_int8(x.int(), q, scb)
