"""The expert ops on a quantized checkpoint's experts as stored (layers/moe_quantized.py's
Fp8Experts, Int4Experts without a desc_act column order): moe_gate_up_silu_fp8 / _int4 and
moe_down_sum_fp8 / _int4 read each chosen expert's stored bytes once and dequantize them in
registers (csrc/kernels/moe_expert_rows.cuh), giving bit for bit layers/moe.py's dense ops on the
experts dequantized to the activations' dtype (dequantize_all). quantized_kernels_take says
whether a layer's experts qualify; layers/moe.py's moe_mlp asks it each step.
"""

from __future__ import annotations

import torch

from pagedkv.layers.moe_quantized import Fp8Experts, Int4Experts, QuantizedExperts, stored_values

_ops = torch.ops.pagedkv
# The kernels read 16 bytes of activations under one scale at a time: input widths, FP8 block_k
# and int4 group sizes multiples of this, tensors 16-byte aligned (csrc/moe_quantized_checks.h).
KERNEL_ALIGN = 16


def quantized_kernels_take(x: torch.Tensor, gate: QuantizedExperts, up: QuantizedExperts,
                           down: QuantizedExperts) -> bool:
    """Whether the quantized expert ops take these projections for activations x: all three FP8 or
    all int4 (no desc_act column order), gate and up in one block shape / group size, each input
    width and block_k / group size a multiple of KERNEL_ALIGN (a group size dividing the width),
    x and the stored values 16-byte aligned."""
    kind = type(down)
    if not all(type(p) is kind for p in (gate, up)):
        return False
    if kind is Fp8Experts:
        fits = gate.block == up.block and all(p.block[1] % KERNEL_ALIGN == 0 for p in (gate, down))
    else:
        fits = (gate.group_size == up.group_size and all(p.perm is None for p in (gate, up, down))
                and all(p.group_size % KERNEL_ALIGN == 0 and _width(p) % p.group_size == 0 for p in (gate, down)))
    widths_ok = all(_width(p) % KERNEL_ALIGN == 0 for p in (gate, down))
    return fits and widths_ok and all(t.data_ptr() % 16 == 0 for t in (x, *(stored_values(p) for p in (gate, up, down))))


def _width(w: QuantizedExperts) -> int:
    """The input columns C of a projection [E, R, C]."""
    return w.weight.shape[-1] if isinstance(w, Fp8Experts) else 2 * w.packed.shape[-1]


def moe_gate_up_silu_quantized(x: torch.Tensor, gate: QuantizedExperts, up: QuantizedExperts,
                               expert_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """moe_gate_up_silu_fp8 or moe_gate_up_silu_int4, by the experts' format."""
    if isinstance(gate, Fp8Experts):
        return moe_gate_up_silu_fp8(x, gate, up, expert_ids, out)
    return moe_gate_up_silu_int4(x, gate, up, expert_ids, out)


def moe_down_sum_quantized(act: torch.Tensor, down: QuantizedExperts, expert_ids: torch.Tensor,
                           weights: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """moe_down_sum_fp8 or moe_down_sum_int4, by the experts' format."""
    if isinstance(down, Fp8Experts):
        return moe_down_sum_fp8(act, down, expert_ids, weights, out)
    return moe_down_sum_int4(act, down, expert_ids, weights, out)


def moe_gate_up_silu_fp8(x: torch.Tensor, gate: Fp8Experts, up: Fp8Experts, expert_ids: torch.Tensor,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """layers.moe.moe_gate_up_silu with FP8 experts: out [T, k, I] = silu(x @ gate_e^T) * (x @ up_e^T),
    e = expert_ids[t, j], on the weights dequantized to x's dtype (dequantize_experts), each
    product rounded to it. Reads only the chosen experts' stored bytes."""
    if out is None:
        out = x.new_empty((x.shape[0], expert_ids.shape[1], gate.weight.shape[1]))
    _ops.moe_gate_up_silu_fp8(out, x, gate.weight, gate.scales, up.weight, up.scales, expert_ids, *gate.block)
    return out


def moe_down_sum_fp8(act: torch.Tensor, down: Fp8Experts, expert_ids: torch.Tensor, weights: torch.Tensor,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """layers.moe.moe_down_sum with FP8 experts: out [T, D] = sum_j (act[t, j] @ down_e^T) *
    weights[t, j], on the weights dequantized to act's dtype, HF's rounding."""
    if out is None:
        out = act.new_empty((act.shape[0], down.weight.shape[1]))
    _ops.moe_down_sum_fp8(out, act, down.weight, down.scales, expert_ids, weights, *down.block)
    return out


def moe_gate_up_silu_int4(x: torch.Tensor, gate: Int4Experts, up: Int4Experts, expert_ids: torch.Tensor,
                          out: torch.Tensor | None = None) -> torch.Tensor:
    """moe_gate_up_silu_fp8 with int4 experts (no desc_act column order): the weights dequantized
    as dequantize_experts does, read as stored."""
    if out is None:
        out = x.new_empty((x.shape[0], expert_ids.shape[1], gate.packed.shape[1]))
    _ops.moe_gate_up_silu_int4(out, x, gate.packed, gate.scales, gate.zeros, up.packed, up.scales, up.zeros,
                               expert_ids, gate.group_size)
    return out


def moe_down_sum_int4(act: torch.Tensor, down: Int4Experts, expert_ids: torch.Tensor, weights: torch.Tensor,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """moe_down_sum_fp8 with int4 experts (no desc_act column order)."""
    if out is None:
        out = act.new_empty((act.shape[0], down.packed.shape[1]))
    _ops.moe_down_sum_int4(out, act, down.packed, down.scales, down.zeros, expert_ids, weights, down.group_size)
    return out


@torch.library.register_fake("pagedkv::moe_gate_up_silu_fp8")
def _moe_gate_up_silu_fp8_fake(out, x, gate, gate_scales, up, up_scales, expert_ids, block_n, block_k) -> None:
    torch._check(out.shape == (x.shape[0], expert_ids.shape[1], gate.shape[1]))


@torch.library.register_fake("pagedkv::moe_down_sum_fp8")
def _moe_down_sum_fp8_fake(out, act, down, down_scales, expert_ids, weights, block_n, block_k) -> None:
    torch._check(out.shape == (act.shape[0], down.shape[1]))


@torch.library.register_fake("pagedkv::moe_gate_up_silu_int4")
def _moe_gate_up_silu_int4_fake(out, x, gate, gate_scales, gate_zeros, up, up_scales, up_zeros, expert_ids,
                                group_size) -> None:
    torch._check(out.shape == (x.shape[0], expert_ids.shape[1], gate.shape[1]))


@torch.library.register_fake("pagedkv::moe_down_sum_int4")
def _moe_down_sum_int4_fake(out, act, down, down_scales, down_zeros, expert_ids, weights, group_size) -> None:
    torch._check(out.shape == (act.shape[0], down.shape[1]))
