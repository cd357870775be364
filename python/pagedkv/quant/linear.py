"""pagedkv's int4 kernel layout and the `linear_w4a16` op's typed wrapper and fake.

The layout (W4A16Weight) is the canonical form (int4.Int4Weight) with q packed along the input
dimension, 8 values an int32 word, column 8w + e of a row in bits 4e..4e+3 of its word w: each
output row is a contiguous run of k/2 bytes, which the CUDA kernel streams in 16-byte pieces of
32 columns (one group's scale and zero each, since g is a multiple of 32). Scales stay in the
checkpoint's 16-bit dtype, zeros are bytes (4.19 bits a weight at g = 128), or float zeros in the
scales' dtype (torchao's tinygemm form, W = (q - 8) * scales + zeros: 4.25 bits a weight).
"""

from __future__ import annotations

import dataclasses

import torch

from pagedkv._ext import _C  # noqa: F401  (registers torch.ops.pagedkv)
from pagedkv.quant.int4 import Int4Weight

_ops = torch.ops.pagedkv


@dataclasses.dataclass(slots=True)
class W4A16Weight:
    """One linear layer's int4 weight in the kernel layout (arguments of linear_w4a16)."""

    packed: torch.Tensor  # [out, in / 8] int32
    scales: torch.Tensor  # [out, in / g] float16 or bfloat16
    zeros: torch.Tensor  # [out, in / g] uint8, or the scales' dtype (float zeros)
    group_size: int
    perm: torch.Tensor | None  # [in] int64: x's columns in the order of the packed columns (desc_act)


def pack_w4a16(w: Int4Weight) -> W4A16Weight:
    """The canonical form -> the kernel layout (on w's device; nothing dequantized)."""
    q = w.q
    if q.shape[1] % 32 or w.group_size % 32:
        raise ValueError(f"linear_w4a16 needs in_features {q.shape[1]} and group_size {w.group_size} "
                         "to be multiples of 32")
    # Two columns a byte (the even one low), little-endian bytes -> int32 words: column 8w + e
    # lands in bits 4e..4e+3 of word w.
    nibble_pairs = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()  # [out, in / 2] uint8
    perm = None if w.perm is None else w.perm.to(torch.int64)
    return W4A16Weight(packed=nibble_pairs.view(torch.int32), scales=w.scales.contiguous(),
                       zeros=(w.zeros if w.zeros.is_floating_point() else w.zeros.to(torch.uint8)).contiguous(),
                       group_size=w.group_size, perm=perm)


def linear_w4a16(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int, perm: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """out = x @ W^T with W [n, k] = (q - zeros) * scales per group of group_size input columns
    (zeros uint8), or (q - 8) * scales + zeros (zeros in the scales' dtype: torchao's form).

    x: [..., k] float32/float16/bfloat16 (last dim contiguous); packed: [n, k / 8] int32 (see
    the module docstring); scales: [n, k / g] float16/bfloat16; zeros: [n, k / g] uint8 or scales' dtype;
    group_size: a multiple of 32 dividing k; perm: [k] int64 or None: x's columns are taken in
    this order first (desc_act layers: a gather, then the op); out: [..., n] in x's dtype or
    None. fp32 accumulation. On CUDA, 1-8 rows of 16-bit x stream the packed weight through
    pagedkv's GEMV; more rows (or fp32) dequantize it to x's dtype for cuBLAS.
    """
    if perm is not None:
        x = x.index_select(-1, perm)
    if out is None:
        out = x.new_empty((*x.shape[:-1], packed.shape[0]))
    _ops.linear_w4a16(out, x, packed, scales, zeros, group_size)
    return out


def linear_w4a16_weight(x: torch.Tensor, w: W4A16Weight, out: torch.Tensor | None = None) -> torch.Tensor:
    """linear_w4a16 with the arguments of one packed layer."""
    return linear_w4a16(x, w.packed, w.scales, w.zeros, w.group_size, perm=w.perm, out=out)


@torch.library.register_fake("pagedkv::linear_w4a16")
def _linear_w4a16_fake(out, x, packed, scales, zeros, group_size) -> None:
    torch._check(out.shape == (*x.shape[:-1], packed.shape[0]))
    torch._check(packed.shape[1] * 8 == x.shape[-1])
    torch._check(scales.shape == zeros.shape)
