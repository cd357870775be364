"""HF's arithmetic in plain PyTorch, where a model's rounding is not the fused ops' (which round
as Llama's modules do: the normed value rounded before the weight, the rotation in the dtype).
Exact in every dtype, on every device, inside CUDA graphs (no host sync)."""

from __future__ import annotations

import torch


def rms_norm_fp32_weight(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N], weight [N] -> [..., N] in x's dtype: HF's Olmo2RMSNorm and HeliumRMSNorm, the
    weight times the fp32 normed value, rounded once."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h).to(x.dtype)


def layer_norm_fp32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N], weight [..., N] (broadcast: [N], or Cohere's per-head [H, Dh]) -> x's shape and
    dtype: HF's CohereLayerNorm (no bias), in fp32, rounded once."""
    h = x.float()
    mean = h.mean(-1, keepdim=True)
    variance = (h - mean).pow(2).mean(-1, keepdim=True)
    h = (h - mean) * torch.rsqrt(variance + eps)
    return (weight.float() * h).to(x.dtype)


def rotate_fp32(x: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x [T, H, Dh] -> [T, H, Dh] in x's dtype: HF's apply_rotary_pos_emb in fp32
    (``x * cos + rotate_half(x) * sin``, rounded once). cos_sin [P, Dh] fp32: cos | sin halves
    (rounded to the dtype first where HF casts them: Cohere); positions [T]: each token's row."""
    half = x.shape[-1] // 2
    table = cos_sin[positions][:, None]  # [T, 1, Dh]
    cos, sin = table[..., :half], table[..., half:]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
