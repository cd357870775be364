"""RMSNorm, alone and fused with the residual add (HF's rounding; Gemma's variant)."""

from __future__ import annotations

import torch

from pagedkv.ops._common import _ops


def rms_norm(
    input: torch.Tensor, weight: torch.Tensor, epsilon: float, out: torch.Tensor | None = None,
    gemma_style: bool = False,
) -> torch.Tensor:
    """RMSNorm with HF's rounding: ``weight * (input * rsqrt(mean(input**2) + eps)).to(dtype)``.

    input: [..., hidden] contiguous, float32/float16/bfloat16; weight: [hidden], same dtype and
    device; out: like input, or None to allocate one. Returns out. gemma_style: HF's
    GemmaRMSNorm instead, ``(normed_fp32 * (1 + weight.float())).to(dtype)``.
    """
    if out is None:
        out = torch.empty_like(input)
    _ops.rms_norm(out, input, weight, epsilon, gemma_style)
    return out


def fused_add_rms_norm(
    input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, epsilon: float,
    gemma_style: bool = False,
) -> None:
    """In place: ``residual += input`` (rounded to the dtype), then ``input = rms_norm(residual)``.

    input, residual: [..., hidden] contiguous, same dtype/device; weight: [hidden]; gemma_style
    as rms_norm's.
    """
    _ops.fused_add_rms_norm(input, residual, weight, epsilon, gemma_style)


@torch.library.register_fake("pagedkv::rms_norm")
def _rms_norm_fake(out, input, weight, epsilon, gemma_style=False) -> None:
    return None


@torch.library.register_fake("pagedkv::fused_add_rms_norm")
def _fused_add_rms_norm_fake(input, residual, weight, epsilon, gemma_style=False) -> None:
    return None
