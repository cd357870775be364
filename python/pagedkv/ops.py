"""Typed wrappers over ``torch.ops.pagedkv.*`` with fake (meta) implementations for torch.compile.

Every op writes into tensors it is given and returns nothing, so it allocates nothing and can be
captured in a CUDA graph. Wrappers that return a tensor allocate it only when ``out`` is None.
Shapes and dtypes are checked in C++; a bad call raises RuntimeError naming the argument.
"""

from __future__ import annotations

import torch

from pagedkv._ext import _C  # noqa: F401  (registers torch.ops.pagedkv)

_ops = torch.ops.pagedkv


def rms_norm(
    input: torch.Tensor, weight: torch.Tensor, epsilon: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm with HF's rounding: ``weight * (input * rsqrt(mean(input**2) + eps)).to(dtype)``.

    input: [..., hidden] contiguous, float32/float16/bfloat16; weight: [hidden], same dtype and
    device; out: like input, or None to allocate one. Returns out.
    """
    if out is None:
        out = torch.empty_like(input)
    _ops.rms_norm(out, input, weight, epsilon)
    return out


def fused_add_rms_norm(
    input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, epsilon: float
) -> None:
    """In place: ``residual += input`` (rounded to the dtype), then ``input = rms_norm(residual)``.

    input, residual: [..., hidden] contiguous, same dtype/device; weight: [hidden].
    """
    _ops.fused_add_rms_norm(input, residual, weight, epsilon)


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.linear``: x [..., K] (last dim contiguous) @ weight [N, K]^T + bias [N] -> [..., N].

    On CUDA, up to 8 rows of bf16/fp16 x use pagedkv's weight-streaming kernel (batch-1..8 decode
    steps are bound by reading the weight once); more rows, or fp32, use cuBLAS.
    """
    if out is None:
        out = x.new_empty((*x.shape[:-1], weight.shape[0]))
    _ops.linear(out, x, weight, bias)
    return out


@torch.library.register_fake("pagedkv::rms_norm")
def _rms_norm_fake(out, input, weight, epsilon) -> None:
    return None


@torch.library.register_fake("pagedkv::linear")
def _linear_fake(out, x, weight, bias) -> None:
    return None


@torch.library.register_fake("pagedkv::fused_add_rms_norm")
def _fused_add_rms_norm_fake(input, residual, weight, epsilon) -> None:
    return None
