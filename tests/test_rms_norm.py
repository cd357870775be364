"""rms_norm and fused_add_rms_norm against HF's RMSNorm written in plain PyTorch."""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICES
from pagedkv import ops
from tolerance import assert_close_to_baseline

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HIDDEN_SIZES = [1, 7, 64, 1000, 1027, 3584, 8192]  # odd ones take the scalar path
NUM_TOKENS = [1, 3, 17]
EPS = 1e-6


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: normalize in fp32, cast back, then scale by the weight."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def random_inputs(num_tokens, hidden, dtype, device):
    x = torch.randn(num_tokens, hidden, dtype=dtype, device=device) * 3 + 0.5
    weight = torch.rand(hidden, dtype=dtype, device=device) + 0.5
    return x, weight


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
def test_rms_norm(device, dtype, hidden, num_tokens):
    x, weight = random_inputs(num_tokens, hidden, dtype, device)
    out = torch.full_like(x, float("nan"))
    ops.rms_norm(x, weight, EPS, out=out)
    assert_close_to_baseline(
        out,
        baseline=reference_rms_norm(x, weight, EPS),
        reference=reference_rms_norm(x.double(), weight.double(), EPS),
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
def test_fused_add_rms_norm(device, dtype, hidden, num_tokens):
    x, weight = random_inputs(num_tokens, hidden, dtype, device)
    residual = torch.randn_like(x)
    base_residual = x + residual  # rounded to dtype, as HF adds the residual
    ref_residual = x.double() + residual.double()

    ops.fused_add_rms_norm(x, residual, weight, EPS)

    assert_close_to_baseline(residual, base_residual, ref_residual, name="residual")
    assert_close_to_baseline(
        x,
        baseline=reference_rms_norm(base_residual, weight, EPS),
        reference=reference_rms_norm(ref_residual, weight.double(), EPS),
        name="input",
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_hf_bitwise_for_aligned_rows(device, dtype):
    """Same rounding steps as HF, so the outputs agree to the last bit but for the sum order."""
    x, weight = random_inputs(5, 256, dtype, device)
    out = ops.rms_norm(x, weight, EPS)
    torch.testing.assert_close(out, reference_rms_norm(x, weight, EPS), atol=0, rtol=2 ** -7)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    x, weight = random_inputs(4, 128, torch.float32, device)
    out = torch.empty_like(x)
    torch.library.opcheck(torch.ops.pagedkv.rms_norm.default, (out, x, weight, EPS))
    residual = torch.randn_like(x)
    torch.library.opcheck(torch.ops.pagedkv.fused_add_rms_norm.default, (x, residual, weight, EPS))


def test_traces_under_torch_compile():
    x, weight = random_inputs(4, 64, torch.float32, "cpu")

    @torch.compile(backend="aot_eager", fullgraph=True)
    def norm(x, weight):
        return ops.rms_norm(x, weight, EPS)

    torch.testing.assert_close(norm(x, weight), ops.rms_norm(x, weight, EPS))


@pytest.mark.parametrize("device", DEVICES)
def test_bad_calls_name_the_argument(device):
    x, weight = random_inputs(4, 64, torch.float32, device)
    with pytest.raises(RuntimeError, match=r"input has dtype Int.*allowed: torch.float32"):
        ops.rms_norm(x.int(), weight.int(), EPS)
    with pytest.raises(RuntimeError, match=r"weight has dtype Half but input has Float"):
        ops.rms_norm(x, weight.half(), EPS)
    with pytest.raises(RuntimeError, match=r"weight must have shape \[hidden\] = \[64\]"):
        ops.rms_norm(x, weight[:32], EPS)
    with pytest.raises(RuntimeError, match=r"out has shape \[4, 32\] but input has shape \[4, 64\]"):
        ops.rms_norm(x, weight, EPS, out=torch.empty(4, 32, device=device))
    with pytest.raises(RuntimeError, match=r"input must be contiguous"):
        ops.rms_norm(x.t().contiguous().t(), weight, EPS)
    with pytest.raises(RuntimeError, match=r"residual has shape"):
        ops.fused_add_rms_norm(x, x[:2].clone(), weight, EPS)
    with pytest.raises(RuntimeError, match=r"epsilon must be >= 0"):
        ops.rms_norm(x, weight, -1.0)


@pytest.mark.cuda
def test_cpu_gpu_mix_is_rejected():
    x, weight = random_inputs(4, 64, torch.float32, "cuda")
    with pytest.raises(RuntimeError, match=r"weight is on cpu but input is on cuda:0"):
        ops.rms_norm(x, weight.cpu(), EPS)
    with pytest.raises(RuntimeError, match=r"residual is on cpu but input is on cuda:0"):
        ops.fused_add_rms_norm(x, x.cpu().clone(), weight, EPS)


def reference_gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF GemmaRMSNorm: normalize in fp32, times (1 + weight) in fp32, one cast at the end."""
    h = x.float() if x.dtype != torch.float64 else x
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.to(h.dtype))).to(x.dtype)


def random_gemma_weight(hidden, dtype, device):
    # Gemma's weights are offsets from 1 and may be negative: around 0, not around 1.
    return torch.randn(hidden, dtype=dtype, device=device) * 0.5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
def test_gemma_style_rms_norm(device, dtype, hidden, num_tokens):
    x, _ = random_inputs(num_tokens, hidden, dtype, device)
    weight = random_gemma_weight(hidden, dtype, device)
    out = torch.full_like(x, float("nan"))
    ops.rms_norm(x, weight, EPS, out=out, gemma_style=True)
    assert_close_to_baseline(
        out,
        baseline=reference_gemma_rms_norm(x, weight, EPS),
        reference=reference_gemma_rms_norm(x.double(), weight.double(), EPS),
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
def test_gemma_style_fused_add_rms_norm(device, dtype, hidden, num_tokens):
    x, _ = random_inputs(num_tokens, hidden, dtype, device)
    weight = random_gemma_weight(hidden, dtype, device)
    residual = torch.randn_like(x)
    base_residual = x + residual
    ref_residual = x.double() + residual.double()

    ops.fused_add_rms_norm(x, residual, weight, EPS, gemma_style=True)

    assert_close_to_baseline(residual, base_residual, ref_residual, name="residual")
    assert_close_to_baseline(
        x,
        baseline=reference_gemma_rms_norm(base_residual, weight, EPS),
        reference=reference_gemma_rms_norm(ref_residual, weight.double(), EPS),
        name="input",
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_style_matches_hf_bitwise_for_aligned_rows(device, dtype):
    """GemmaRMSNorm rounds once, after the (1 + weight) product; Llama's rounding would differ
    from it in a share of bfloat16 elements."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    x, _ = random_inputs(5, 256, dtype, device)
    norm = GemmaRMSNorm(256, eps=EPS).to(device=device, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(random_gemma_weight(256, dtype, device))
        expected = norm(x)
    out = ops.rms_norm(x, norm.weight.detach(), EPS, gemma_style=True)
    torch.testing.assert_close(out, expected, atol=0, rtol=2 ** -7)


@pytest.mark.parametrize("device", DEVICES)
def test_gemma_style_opcheck(device):
    x, _ = random_inputs(4, 128, torch.float32, device)
    weight = random_gemma_weight(128, torch.float32, device)
    out = torch.empty_like(x)
    torch.library.opcheck(torch.ops.pagedkv.rms_norm.default, (out, x, weight, EPS, True))
