"""norm_add_rms_norm (Gemma-2/3's post-norm, residual add and next pre-norm in one launch) against
the unfused ops it replaces (bit for bit: the same rounding at each step) and against plain PyTorch."""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICES
from pagedkv import ops
from test_rms_norm import EPS, HIDDEN_SIZES, NUM_TOKENS, random_gemma_weight, reference_gemma_rms_norm, reference_rms_norm
from tolerance import assert_close_to_baseline

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def weights(hidden: int, dtype: torch.dtype, device: str, gemma_style: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if gemma_style:
        return random_gemma_weight(hidden, dtype, device), random_gemma_weight(hidden, dtype, device)
    return (torch.rand(hidden, dtype=dtype, device=device) + 0.5,
            torch.rand(hidden, dtype=dtype, device=device) + 0.5)


def reference(x, residual, input_weight, weight, gemma_style):
    """Plain PyTorch in x's dtype (float64 for the exact reference): HF's norms and add."""
    norm = reference_gemma_rms_norm if gemma_style else reference_rms_norm
    new_residual = residual + norm(x, input_weight, EPS)
    return norm(new_residual, weight, EPS), new_residual


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("gemma_style", [True, False], ids=["gemma", "llama"])
def test_equals_the_unfused_ops(device, dtype, hidden, num_tokens, gemma_style):
    x = torch.randn(num_tokens, hidden, dtype=dtype, device=device) * 3 + 0.5
    residual = torch.randn_like(x) * 2
    input_weight, weight = weights(hidden, dtype, device, gemma_style)

    unfused_x = ops.rms_norm(x, input_weight, EPS, gemma_style=gemma_style)
    unfused_residual = residual.clone()
    ops.fused_add_rms_norm(unfused_x, unfused_residual, weight, EPS, gemma_style=gemma_style)

    fused_x, fused_residual = x.clone(), residual.clone()
    ops.norm_add_rms_norm(fused_x, fused_residual, input_weight, weight, EPS, gemma_style=gemma_style)

    assert torch.equal(fused_residual, unfused_residual)
    assert torch.equal(fused_x, unfused_x)
    base_out, base_residual = reference(x, residual, input_weight, weight, gemma_style)
    exact_out, exact_residual = reference(x.double(), residual.double(), input_weight.double(), weight.double(),
                                          gemma_style)
    assert_close_to_baseline(fused_residual, base_residual, exact_residual, name="residual")
    assert_close_to_baseline(fused_x, base_out, exact_out, name="input")


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    x = torch.randn(3, 64, device=device)
    input_weight, weight = weights(64, torch.float32, device, True)
    torch.library.opcheck(torch.ops.pagedkv.norm_add_rms_norm.default,
                          (x, torch.randn_like(x), input_weight, weight, EPS, True))


@pytest.mark.parametrize("device", DEVICES)
def test_bad_input_weight_is_named(device):
    x = torch.randn(4, 64, device=device)
    input_weight, weight = weights(64, torch.float32, device, True)
    with pytest.raises(RuntimeError, match=r"input_weight must have shape \[hidden\] = \[64\]"):
        ops.norm_add_rms_norm(x, torch.randn_like(x), input_weight[:32], weight, EPS)
    with pytest.raises(RuntimeError, match=r"input_weight has dtype Half but input has Float"):
        ops.norm_add_rms_norm(x, torch.randn_like(x), input_weight.half(), weight, EPS)
