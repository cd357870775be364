"""The one place a decoder's linear picks its kernel by its weight's form.

A linear's weight (LinearWeight) is a dense tensor [N, K] (HF's own, or fused), a W4A16Weight
(an int4 checkpoint's layer, quant/linear.py), an Fp8Weight (quant/fp8.py), an Nf4Packed
(quant/linear_nf4.py), an Int8Weight (quant/int8.py), or a tuple of parts whose outputs are
concatenated: fused layers (QKV, gate/up) whose parts cannot share one packed weight (a desc_act
checkpoint whose q/k/v columns were sorted differently, FP8 blocks that straddle two parts, or a
part left unquantized).
A dense tensor takes exactly the ops it took before (ops.linear, ops.gate_up_silu).
"""

from __future__ import annotations

from typing import Union

import torch

from pagedkv import ops
from pagedkv.quant.fp8 import Fp8Weight
from pagedkv.quant.int8 import Int8Weight
from pagedkv.quant.linear import W4A16Weight, linear_w4a16_weight
from pagedkv.quant.linear_fp8 import linear_fp8
from pagedkv.quant.linear_int8 import linear_int8_weight
from pagedkv.quant.linear_nf4 import Nf4Packed, linear_nf4_weight

LinearWeight = Union[torch.Tensor, W4A16Weight, Fp8Weight, Nf4Packed, Int8Weight, tuple["LinearWeight", ...]]


def apply_linear(x: torch.Tensor, w: LinearWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias [N]) -> [..., N] in x's dtype, whatever form W is held in."""
    if isinstance(w, torch.Tensor):
        return ops.linear(x, w, bias)
    if isinstance(w, W4A16Weight):
        out = linear_w4a16_weight(x, w)
    elif isinstance(w, Fp8Weight):
        out = linear_fp8(x, w)
    elif isinstance(w, Nf4Packed):
        out = linear_nf4_weight(x, w)
    elif isinstance(w, Int8Weight):
        out = linear_int8_weight(x, w)
    else:  # parts side by side along N
        out = torch.cat([apply_linear(x, part) for part in w], dim=-1)
    return out if bias is None else out.add_(bias)


def apply_gate_up_silu(x: torch.Tensor, gate_up: LinearWeight) -> torch.Tensor:
    """silu(x @ gate^T) * (x @ up^T) -> [..., I] for gate_up [2 * I, K] (gate rows, then up)."""
    if isinstance(gate_up, torch.Tensor):
        return ops.gate_up_silu(x, gate_up)
    return ops.silu_and_mul(apply_linear(x, gate_up))


def linear_tensors(w: object) -> list[torch.Tensor]:
    """The tensors a linear's weight holds (what its bytes are), in any form; [] for anything
    else (None, a layer's other fields)."""
    if isinstance(w, torch.Tensor):
        return [w]
    if isinstance(w, W4A16Weight):
        return [t for t in (w.packed, w.scales, w.zeros, w.perm) if t is not None]
    if isinstance(w, Fp8Weight):
        return [w.weight, w.scales]
    if isinstance(w, Nf4Packed):
        return [w.packed, w.absmax, w.code]
    if isinstance(w, Int8Weight):
        return [w.q, w.scb]
    if isinstance(w, tuple):
        return [t for part in w for t in linear_tensors(part)]
    return []
