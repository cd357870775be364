"""The `linear_fp8_weight` op's typed wrapper and fake. Its layout is the canonical form
(fp8.Fp8Weight): each output row a contiguous run of `in` bytes, which the CUDA kernel streams in
16-byte pieces of 16 columns under one scale (block[1] a multiple of 16; other blocks, and in
not a multiple of 16, go to the dequantize + cuBLAS path)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedkv._ext import _C  # noqa: F401  (registers torch.ops.pagedkv)
from pagedkv.quant.fp8 import Fp8Weight

_ops = torch.ops.pagedkv


def linear_fp8_weight(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, block: Sequence[int],
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """out = x @ W^T with W [n, k] = weight * scales over blocks of block = (rows, columns).

    x: [..., k] float32/float16/bfloat16 (last dim contiguous); weight: [n, k] float8_e4m3fn;
    scales: [ceil(n / block[0]), ceil(k / block[1])] float32; out: [..., n] in x's dtype or None.
    fp32 accumulation. On CUDA, 1-8 rows of 16-bit x stream the fp8 weight through pagedkv's
    GEMV (converted in registers); more rows (or fp32) dequantize it to x's dtype for cuBLAS.
    """
    if out is None:
        out = x.new_empty((*x.shape[:-1], weight.shape[0]))
    _ops.linear_fp8_weight(out, x, weight, scales, int(block[0]), int(block[1]))
    return out


def linear_fp8(x: torch.Tensor, w: Fp8Weight, out: torch.Tensor | None = None) -> torch.Tensor:
    """linear_fp8_weight with the arguments of one layer."""
    return linear_fp8_weight(x, w.weight, w.scales, w.block, out=out)


@torch.library.register_fake("pagedkv::linear_fp8_weight")
def _linear_fp8_weight_fake(out, x, weight, scales, block_n, block_k) -> None:
    torch._check(out.shape == (*x.shape[:-1], weight.shape[0]))
    torch._check(weight.shape[1] == x.shape[-1])
