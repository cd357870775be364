"""A tiny reference quantizer that writes one linear layer's random fp weight in the exact on-disk
FP8 formats (transformers' FineGrainedFP8 with block scales, per tensor, or UE8M0 power-of-two
scales; compressed-tensors per channel / per tensor / per block), and each format's own
dequantization formula (transformers' Fp8Quantize / _dequantize_fp8_weight, compressed-tensors'
``x_q.to(dtype) * scale``). Written block by block, independently of pagedkv.quant's reader."""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def _quantize_block(block: torch.Tensor, ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' Fp8Quantize for one tile: scale = 448 / amax, q = clamp(x * scale) as e4m3,
    stored scale_inv = 1 / scale (a power of two, rounded up, for ue8m0)."""
    amax = block.abs().amax().float()
    scale = FP8_MAX / amax if amax > 0 else torch.tensor(1.0)
    inv = (1.0 / scale).float()
    if ue8m0:
        inv = torch.pow(2.0, torch.ceil(torch.log2(inv)))
        scale = 1.0 / inv
    q = torch.clamp(block.float() * scale, -FP8_MAX, FP8_MAX).to(FP8)
    return q, inv


def to_finegrained(w: torch.Tensor, block: tuple[int, int] | None, ue8m0: bool = False) -> dict[str, torch.Tensor]:
    """weight [out, in] e4m3 + weight_scale_inv [ceil(out/bn), ceil(in/bk)] float32 (float8_e8m0fnu
    when ue8m0), edge tiles partial as in the "-FP8" releases; block None: one scalar scale."""
    if block is None:
        q, inv = _quantize_block(w)
        return {"weight": q, "weight_scale_inv": inv.reshape(())}
    bn, bk = block
    out_features, in_features = w.shape
    rows, cols = -(-out_features // bn), -(-in_features // bk)
    weight = torch.empty(out_features, in_features, dtype=FP8)
    scale_inv = torch.empty(rows, cols)
    for r in range(rows):
        for c in range(cols):
            tile = w[r * bn:(r + 1) * bn, c * bk:(c + 1) * bk]
            q, inv = _quantize_block(tile, ue8m0)
            weight[r * bn:(r + 1) * bn, c * bk:(c + 1) * bk] = q
            scale_inv[r, c] = inv
    if ue8m0:
        scale_inv = scale_inv.to(torch.float8_e8m0fnu)
    return {"weight": weight, "weight_scale_inv": scale_inv}


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
