"""silu_and_mul against HF's LlamaMLP activation, ``act_fn(gate) * up``, in plain PyTorch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICES
from pagedkv import ops
from tolerance import assert_close_to_baseline

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
INTERMEDIATE_SIZES = [1, 13, 128, 3000]  # 1 and 13 take the scalar path
LEADING_SHAPES = [(1,), (5,), (2, 3)]


def reference(x: torch.Tensor) -> torch.Tensor:
    """HF: silu(gate) rounded to the dtype, times up, rounded again."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def random_x(leading, intermediate, dtype, device):
    return torch.randn(*leading, 2 * intermediate, dtype=dtype, device=device) * 3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("intermediate", INTERMEDIATE_SIZES)
@pytest.mark.parametrize("leading", LEADING_SHAPES)
def test_silu_and_mul(device, dtype, intermediate, leading):
    x = random_x(leading, intermediate, dtype, device)
    out = torch.full((*leading, intermediate), float("nan"), dtype=dtype, device=device)
    ops.silu_and_mul(x, out=out)
    assert_close_to_baseline(out, baseline=reference(x), reference=reference(x.double()))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_same_rounding_as_hf(device, dtype):
    """The same rounding steps as HF. On CUDA (torch's expf and IEEE division) every bit agrees.
    On the CPU torch's vectorized exp differs from std::exp by an ulp now and then: that flips a
    float16/bfloat16 rounding only rarely, and leaves float32 within a few ulps."""
    x = random_x((64,), 1024, dtype, device)
    out, expected = ops.silu_and_mul(x), reference(x)
    if device == "cpu" and dtype == torch.float32:
        torch.testing.assert_close(out, expected, atol=1e-30, rtol=4 * torch.finfo(dtype).eps)
        return
    same = (out == expected).float().mean().item()
    assert same >= (1.0 if device == "cuda" else 0.999), f"only {same:.5f} of the elements match HF's"


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    x = random_x((4,), 64, torch.float32, device)
    out = torch.empty(4, 64, device=device)
    torch.library.opcheck(torch.ops.pagedkv.silu_and_mul.default, (out, x))


def test_traces_under_torch_compile():
    x = random_x((4,), 32, torch.float32, "cpu")

    @torch.compile(backend="aot_eager", fullgraph=True)
    def mlp_activation(x):
        return ops.silu_and_mul(x)

    torch.testing.assert_close(mlp_activation(x), ops.silu_and_mul(x))


@pytest.mark.parametrize("device", DEVICES)
def test_bad_calls_name_the_argument(device):
    x = random_x((4,), 32, torch.float32, device)
    with pytest.raises(RuntimeError, match=r"x must have an even, non-empty last dimension"):
        ops.silu_and_mul(x[:, :63].contiguous(), out=torch.empty(4, 31, device=device))
    with pytest.raises(RuntimeError, match=r"out must have shape \[4, 32\]"):
        ops.silu_and_mul(x, out=torch.empty(4, 64, device=device))
    with pytest.raises(RuntimeError, match=r"out has dtype Half but x has Float"):
        ops.silu_and_mul(x, out=torch.empty(4, 32, device=device, dtype=torch.half))
    with pytest.raises(RuntimeError, match=r"x must be contiguous"):
        ops.silu_and_mul(x[:, ::2])
    with pytest.raises(RuntimeError, match=r"x has dtype Int"):
        ops.silu_and_mul(x.int())


def reference_gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """HF's gelu_pytorch_tanh MLP: gelu(gate, approximate="tanh") rounded, times up, rounded."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("intermediate", INTERMEDIATE_SIZES)
@pytest.mark.parametrize("leading", LEADING_SHAPES)
def test_gelu_tanh_and_mul(device, dtype, intermediate, leading):
    x = random_x(leading, intermediate, dtype, device)
    out = torch.full((*leading, intermediate), float("nan"), dtype=dtype, device=device)
    ops.silu_and_mul(x, out=out, activation="gelu_tanh")
    assert_close_to_baseline(out, baseline=reference_gelu_tanh(x), reference=reference_gelu_tanh(x.double()))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_same_rounding_as_hf(device, dtype):
    """HF's own activation module. On the CPU the op runs torch's gelu (its vectorized tanh
    differs from std::tanh by an ulp now and then, which 1 + tanh amplifies where it cancels):
    every bit agrees. On CUDA the kernel's fp32 formula is torch's, with libdevice's tanhf."""
    from transformers.activations import ACT2FN

    x = random_x((64,), 1024, dtype, device)
    gate, up = x.chunk(2, dim=-1)
    expected = ACT2FN["gelu_pytorch_tanh"](gate) * up
    out = ops.silu_and_mul(x, activation="gelu_tanh")
    if device == "cpu":
        assert torch.equal(out, expected)
        return
    same = (out == expected).float().mean().item()
    assert same >= 0.999, f"only {same:.5f} of the elements match HF's"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_gate_up_gelu_tanh(device, dtype, rows):
    x = torch.randn(rows, 64, dtype=dtype, device=device)
    gate_up = torch.randn(2 * 96, 64, dtype=dtype, device=device) / 8
    out = ops.gate_up_silu(x, gate_up, activation="gelu_tanh")
    h = ops.linear(x, gate_up)  # [rows, 2 * 96]: the GEMM is linear's own test's
    expected = ops.silu_and_mul(h, activation="gelu_tanh")
    assert_close_to_baseline(out, baseline=expected, reference=reference_gelu_tanh(h.double()))


@pytest.mark.parametrize("device", DEVICES)
def test_gelu_tanh_opcheck(device):
    x = random_x((4,), 64, torch.float32, device)
    out = torch.empty(4, 64, device=device)
    torch.library.opcheck(torch.ops.pagedkv.silu_and_mul.default, (out, x, "gelu_tanh"))


@pytest.mark.parametrize("device", DEVICES)
def test_unknown_activation_is_named(device):
    x = random_x((4,), 32, torch.float32, device)
    with pytest.raises(RuntimeError, match=r"activation must be 'silu' or 'gelu_tanh', got 'relu'"):
        ops.silu_and_mul(x, activation="relu")
