"""The `linear_int8` op's typed wrapper and fake. Its layout is the canonical form
(int8.Int8Weight): each output row a contiguous run of `in` int8 values under the row's absmax,
which the CUDA kernel streams in 16-byte pieces of 16 columns (`in` a multiple of 16; else the
dequantize + cuBLAS path)."""

from __future__ import annotations

import torch

from pagedkv._ext import _C  # noqa: F401  (registers torch.ops.pagedkv)
from pagedkv.quant.int8 import Int8Weight

_ops = torch.ops.pagedkv


def linear_int8(x: torch.Tensor, q: torch.Tensor, scb: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """out = x @ W^T with W [n, k] = q * scb[row] / 127 (bitsandbytes' LLM.int8 weight).

    x: [..., k] float32/float16/bfloat16 (last dim contiguous); q: [n, k] int8; scb: [n] float32;
    out: [..., n] in x's dtype or None. fp32 accumulation. On CUDA, 1-8 rows of 16-bit x stream
    the int8 weight through pagedkv's GEMV (converted in registers, each row's scale applied to
    its sums); more rows (or fp32) dequantize it to x's dtype for cuBLAS. The activations are
    not quantized.
    """
    if out is None:
        out = x.new_empty((*x.shape[:-1], q.shape[0]))
    _ops.linear_int8(out, x, q, scb)
    return out


def linear_int8_weight(x: torch.Tensor, w: Int8Weight, out: torch.Tensor | None = None) -> torch.Tensor:
    """linear_int8 with the arguments of one layer."""
    return linear_int8(x, w.q, w.scb, out=out)


@torch.library.register_fake("pagedkv::linear_int8")
def _linear_int8_fake(out, x, q, scb) -> None:
    torch._check(out.shape == (*x.shape[:-1], q.shape[0]))
    torch._check(q.shape[1] == x.shape[-1])
