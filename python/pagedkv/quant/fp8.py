"""FP8 weight checkpoints (transformers' FineGrainedFP8, compressed-tensors FP8) read into one
canonical form, which is also the kernel layout of `linear_fp8_weight` (quant/linear_fp8.py).

Every format stores the weight as float8_e4m3fn [out, in] and dequantizes ``w = q * scale`` in
fp32 with one scale per block of the weight; they differ only in the blocks:

    FineGrainedFP8      weight_scale_inv [ceil(out/bn), ceil(in/bk)] float32 (or float8_e8m0fnu,
                        powers of two: "ue8m0"), block (bn, bk) = weight_block_size, 128x128 in
                        the "-FP8" releases; no block size: one scalar scale (per tensor)
    compressed-tensors  weight_scale [out, 1] (strategy "channel"), [1] or [] ("tensor") or
                        [ceil(out/bn), ceil(in/bk)] ("block"), float32 or the model's 16-bit dtype

The canonical form (Fp8Weight) keeps the e4m3 weight as stored and every format's scales as one
fp32 grid with its block: per channel is block (1, in), per tensor (out, in). Widening a scale to
fp32 is exact, so W is the checkpoint's own dequantization.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

_E8M0 = getattr(torch, "float8_e8m0fnu", None)  # torch >= 2.7


@dataclasses.dataclass(slots=True)
class Fp8Weight:
    """One linear layer's FP8 weight: W[j, c] = weight[j, c] * scales[j // block[0], c // block[1]]
    (the arguments of linear_fp8_weight)."""

    weight: torch.Tensor  # [out, in] float8_e4m3fn, contiguous
    scales: torch.Tensor  # [ceil(out / block[0]), ceil(in / block[1])] float32, contiguous
    block: tuple[int, int]  # (output rows, input columns) under one scale


def dequantize_fp8(w: Fp8Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[out, in] weight, computed in fp32 (one rounding per value, as the formats do) then cast."""
    out_features, in_features = w.weight.shape
    scales = w.scales.repeat_interleave(w.block[0], 0)[:out_features]
    scales = scales.repeat_interleave(w.block[1], 1)[:, :in_features]
    return (w.weight.float() * scales).to(dtype)


def _check_weight(weight: torch.Tensor) -> None:
    if weight.dim() != 2 or weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"weight must be [out, in] of torch.float8_e4m3fn, got {list(weight.shape)} {weight.dtype}")


def _grid(weight: torch.Tensor, scales: torch.Tensor, block: tuple[int, int], name: str) -> Fp8Weight:
    """scales checked against the grid of `block` over weight, widened to fp32."""
    out_features, in_features = weight.shape
    if block[0] <= 0 or block[1] <= 0:
        raise ValueError(f"block size {list(block)} must be two positive sizes [rows, columns]")
    grid = (-(-out_features // block[0]), -(-in_features // block[1]))
    if tuple(scales.shape) != grid:
        raise ValueError(f"{name} must be {list(grid)} (ceil of weight {[out_features, in_features]} / block "
                         f"{list(block)}), got {list(scales.shape)}")
    return Fp8Weight(weight=weight.contiguous(), scales=scales.to(torch.float32).contiguous(), block=block)


def from_finegrained_fp8(weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                         block_size: Sequence[int] | None) -> Fp8Weight:
    """A transformers FineGrainedFP8 layer's tensors as stored -> Fp8Weight.

    weight [out, in] float8_e4m3fn; weight_scale_inv [ceil(out/bn), ceil(in/bk)] float32 or
    float8_e8m0fnu (scale_fmt "ue8m0"); block_size: the config's weight_block_size [bn, bk], or
    None for a per-tensor scalar scale.
    """
    _check_weight(weight)
    allowed = (torch.float32,) + ((_E8M0,) if _E8M0 is not None else ())
    if weight_scale_inv.dtype not in allowed:
        raise ValueError(f"weight_scale_inv has dtype {weight_scale_inv.dtype}; allowed: "
                         + ", ".join(str(d) for d in allowed))
    if block_size is None:
        if weight_scale_inv.numel() != 1:
            raise ValueError(f"weight_scale_inv must be one scalar without a block size, got "
                             f"{list(weight_scale_inv.shape)}")
        return _grid(weight, weight_scale_inv.reshape(1, 1), tuple(weight.shape), "weight_scale_inv")
    if len(block_size) != 2:
        raise ValueError(f"block size {list(block_size)} must be two positive sizes [rows, columns]")
    return _grid(weight, weight_scale_inv, (int(block_size[0]), int(block_size[1])), "weight_scale_inv")


def from_compressed_tensors_fp8(weight: torch.Tensor, weight_scale: torch.Tensor,
                                block_size: Sequence[int] | None = None) -> Fp8Weight:
    """A compressed-tensors "float-quantized" FP8 layer's tensors as stored -> Fp8Weight.

    weight [out, in] float8_e4m3fn; weight_scale float32/float16/bfloat16: [out, 1] (strategy
    "channel"), one value ("tensor"), or with block_size [bn, bk] (strategy "block") the
    [ceil(out/bn), ceil(in/bk)] grid. An input_scale (static activations) is not needed here.
    """
    _check_weight(weight)
    if weight_scale.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"weight_scale has dtype {weight_scale.dtype}; allowed: torch.float32, "
                         "torch.float16, torch.bfloat16")
    out_features, in_features = weight.shape
    if block_size is not None:
        if len(block_size) != 2:
            raise ValueError(f"block size {list(block_size)} must be two positive sizes [rows, columns]")
        return _grid(weight, weight_scale, (int(block_size[0]), int(block_size[1])), "weight_scale")
    if weight_scale.numel() == 1:
        return _grid(weight, weight_scale.reshape(1, 1), (out_features, in_features), "weight_scale")
    if tuple(weight_scale.shape) in ((out_features, 1), (out_features,)):
        return _grid(weight, weight_scale.reshape(out_features, 1), (1, in_features), "weight_scale")
    raise ValueError(f"weight_scale must be [{out_features}, 1] (per channel) or one value (per tensor), or "
                     f"pass block_size for a block grid; got {list(weight_scale.shape)}")
