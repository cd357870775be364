"""pagedkv's NF4 kernel layout and the `linear_nf4` op's typed wrapper and fake.

The layout (Nf4Packed) is the canonical form (nf4.Nf4Weight) with the codes packed two a byte in
bitsandbytes' own order (column 2b in the high nibble of byte b, 2b + 1 in the low one): each
output row is a contiguous run of in/2 bytes, which the CUDA kernel streams in 16-byte pieces of
32 codes (one absmax each, since block_size is a multiple of 32 there; other block sizes go to
the dequantize + cuBLAS path). The absmax stays dequantized in fp32: 4.5 bits a weight at
block_size 64.
"""

from __future__ import annotations

import dataclasses

import torch

from pagedkv._ext import _C  # noqa: F401  (registers torch.ops.pagedkv)
from pagedkv.quant.nf4 import Nf4Weight

_ops = torch.ops.pagedkv


@dataclasses.dataclass(slots=True)
class Nf4Packed:
    """One linear layer's NF4 weight in the kernel layout (arguments of linear_nf4)."""

    packed: torch.Tensor  # [out, in / 2] uint8
    absmax: torch.Tensor  # [out, in / block_size] float32
    code: torch.Tensor  # [16] float32
    block_size: int


def pack_nf4(w: Nf4Weight) -> Nf4Packed:
    """The canonical form -> the kernel layout (on w's device; nothing dequantized)."""
    q = w.q.to(torch.uint8)
    return Nf4Packed(packed=((q[:, 0::2] << 4) | q[:, 1::2]).contiguous(), absmax=w.absmax.float().contiguous(),
                     code=w.code.float().contiguous(), block_size=w.block_size)


def linear_nf4(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, block_size: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """out = x @ W^T with W [n, k] = code[q] * absmax per block of block_size input columns.

    x: [..., k] float32/float16/bfloat16 (last dim contiguous); packed: [n, k / 2] uint8 (see
    the module docstring); absmax: [n, k / block_size] float32; code: [16] float32; block_size:
    an even divisor of k; out: [..., n] in x's dtype or None. fp32 accumulation. On CUDA, 1-8
    rows of 16-bit x stream the packed weight through pagedkv's GEMV (codebook lookups in
    registers); more rows (or fp32) dequantize it to x's dtype for cuBLAS.
    """
    if out is None:
        out = x.new_empty((*x.shape[:-1], packed.shape[0]))
    _ops.linear_nf4(out, x, packed, absmax, code, block_size)
    return out


def linear_nf4_weight(x: torch.Tensor, w: Nf4Packed, out: torch.Tensor | None = None) -> torch.Tensor:
    """linear_nf4 with the arguments of one packed layer."""
    return linear_nf4(x, w.packed, w.absmax, w.code, w.block_size, out=out)


@torch.library.register_fake("pagedkv::linear_nf4")
def _linear_nf4_fake(out, x, packed, absmax, code, block_size) -> None:
    torch._check(out.shape == (*x.shape[:-1], packed.shape[0]))
    torch._check(packed.shape[1] * 2 == x.shape[-1])
