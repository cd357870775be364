"""The FP8 formats' own dequantization formulas (transformers' _dequantize_fp8_weight,
compressed-tensors' ``x_q.to(dtype) * scale``), block by block, independently of pagedkv.quant's
reader, and compressed-tensors' FP8 writer (per channel / per tensor / per block). transformers'
FineGrainedFP8 writer (to_finegrained: block, per-tensor, UE8M0 scales) is shared with the
benchmarks: pagedkv.tools.quant_writers."""

from __future__ import annotations

import torch

from pagedkv.tools.quant_writers import FP8, FP8_MAX, to_finegrained


def finegrained_dequantize(weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                           block: tuple[int, int] | None) -> torch.Tensor:
    """transformers' _dequantize_fp8_weight in fp32: each tile times its scale_inv -> W [out, in]."""
    w = weight.float()
    s = weight_scale_inv.float()
    if block is None:
        return w * s
    bn, bk = block
    for r in range(s.shape[0]):
        for c in range(s.shape[1]):
            w[r * bn:(r + 1) * bn, c * bk:(c + 1) * bk] *= s[r, c]
    return w


def to_compressed_tensors(w: torch.Tensor, strategy: str, scale_dtype: torch.dtype = torch.float32,
                          block: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
    """compressed-tensors' float-quantized FP8 (symmetric, e4m3): weight [out, in] + weight_scale
    [out, 1] ("channel"), [1] ("tensor") or the block grid ("block"), scale = amax / 448 in
    scale_dtype, q = clamp(w / scale) as e4m3."""
    if strategy == "block":
        stored = to_finegrained(w, block)
        return {"weight": stored["weight"], "weight_scale": stored["weight_scale_inv"].to(scale_dtype)}
    amax = w.abs().amax(dim=1, keepdim=True) if strategy == "channel" else w.abs().amax().reshape(1)
    scale = (amax.clamp(min=1e-12) / FP8_MAX).to(scale_dtype)
    q = torch.clamp(w / scale.float().reshape(-1, 1), -FP8_MAX, FP8_MAX).to(FP8)
    return {"weight": q, "weight_scale": scale}


def compressed_tensors_dequantize(weight: torch.Tensor, weight_scale: torch.Tensor,
                                  block: tuple[int, int] | None = None) -> torch.Tensor:
    """compressed-tensors' dequantize in fp32: x_q * scale, the scale broadcast over its channel,
    the tensor or its block."""
    if block is not None:
        return finegrained_dequantize(weight, weight_scale, block)
    scale = weight_scale.float()
    return weight.float() * (scale.reshape(-1, 1) if scale.numel() > 1 else scale.reshape(()))
