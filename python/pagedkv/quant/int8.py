"""bitsandbytes LLM.int8 checkpoints (a serialized Linear8bitLt, `load_in_8bit`) read into one
canonical form, which is also the `linear_int8` op's layout.

bitsandbytes rounds each output row of the [out, in] weight to int8 under the row's absmax, and
stores, under the layer's names:

    weight         [out, in] int8: round(127 * W / SCB[row])
    SCB            [out] float32: each row's absmax
    weight_format  optional uint8 scalar, 0 = "row" (the only layout a saved layer has)

and dequantizes (int8_vectorwise_dequant) in fp32: W = q * SCB[row] * (1 / 127), the two products
in that order. Its LLM.int8 forward also quantizes the activations (to int8 per row, outlier
columns above llm_int8_threshold kept in 16 bits); pagedkv does not: it computes x @ W^T with the
dequantized W in fp32, the product LLM.int8 approximates.
"""

from __future__ import annotations

import dataclasses

import torch

# bitsandbytes' 1 / 127 as the fp32 multiplier it uses
INV_127 = 7.874015718698502e-3


@dataclasses.dataclass(slots=True)
class Int8Weight:
    """One linear layer's LLM.int8 weight: W[j, c] = q[j, c] * scb[j] * INV_127 (fp32)."""

    q: torch.Tensor  # [out, in] int8
    scb: torch.Tensor  # [out] float32: each row's absmax


def dequantize_int8(w: Int8Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[out, in] weight, computed in fp32 as bitsandbytes does, then cast."""
    return (w.q.float() * w.scb.unsqueeze(-1) * INV_127).to(dtype)


def from_bnb_int8(weight: torch.Tensor, scb: torch.Tensor, weight_format: torch.Tensor | None = None) -> Int8Weight:
    """A bitsandbytes Linear8bitLt as serialized (its `weight`, `SCB` and optional
    `weight_format`) -> Int8Weight. Raises ValueError naming what does not fit."""
    if weight.dtype != torch.int8 or weight.dim() != 2:
        raise ValueError(f"weight must be [out, in] int8, got {list(weight.shape)} {weight.dtype}")
    if scb.dtype != torch.float32 or scb.numel() != weight.shape[0]:
        raise ValueError(f"SCB must be {weight.shape[0]} float32 row absmaxes, got {list(scb.shape)} {scb.dtype}")
    if weight_format is not None and (weight_format.numel() != 1 or int(weight_format.reshape(-1)[0]) != 0):
        raise ValueError(f"weight_format {weight_format.reshape(-1).tolist()} must be 0 ('row'; the tiled GPU "
                         "layouts are never saved)")
    return Int8Weight(q=weight.contiguous(), scb=scb.reshape(-1).contiguous())
