"""Matrix products: ``F.linear`` and the MLP's fused gate/up projection with its activation."""

from __future__ import annotations

import torch

from pagedkv.ops._common import _ops
from pagedkv.ops.activation import GATED_ACTIVATIONS


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.linear``: x [..., K] (last dim contiguous) @ weight [N, K]^T + bias [N] -> [..., N].

    On CUDA, 1-8 rows of bf16/fp16 x use pagedkv's weight-streaming kernels (small-batch decode
    steps are bound by reading the weight once): CUDA cores for 1-2 rows, tensor cores for 3-8;
    more rows, or fp32, use cuBLAS.
    """
    if out is None:
        out = x.new_empty((*x.shape[:-1], weight.shape[0]))
    _ops.linear(out, x, weight, bias)
    return out


def gate_up_silu(x: torch.Tensor, gate_up: torch.Tensor, out: torch.Tensor | None = None,
                 activation: str = "silu") -> torch.Tensor:
    """The MLP's first half, HF's rounding: ``act(x @ gate^T) * (x @ up^T)``.

    x: [..., K] (last dim contiguous), float32/float16/bfloat16; gate_up: [2 * I, K] in x's dtype,
    the gate rows then the up rows (the fused weight); out: [..., I] or None to allocate one;
    activation: "silu" (Llama's) or "gelu_tanh" (HF's gelu_pytorch_tanh, Gemma's), rounded as
    silu_and_mul rounds it. On CUDA, 1-8 rows of bf16/fp16 x run as one weight-streaming kernel
    with either activation (no [..., 2 * I] intermediate, no second launch); otherwise a GEMM +
    silu_and_mul. Returns out; ValueError for another activation.
    """
    if activation not in GATED_ACTIVATIONS:
        raise ValueError(f"pagedkv: activation must be 'silu' or 'gelu_tanh', got {activation!r}")
    if out is None:
        out = x.new_empty((*x.shape[:-1], gate_up.shape[0] // 2))
    _ops.gate_up_silu(out, x, gate_up, activation)
    return out


@torch.library.register_fake("pagedkv::linear")
def _linear_fake(out, x, weight, bias) -> None:
    return None


@torch.library.register_fake("pagedkv::gate_up_silu")
def _gate_up_silu_fake(out, x, gate_up, activation="silu") -> None:
    return None
