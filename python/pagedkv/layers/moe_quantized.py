"""A mixture-of-experts layer's quantized experts, held as a checkpoint stores them (Qwen2-MoE,
Qwen3-MoE, OLMoE, Mixtral), each projection of every expert stacked over the experts:

    Fp8Experts   FP8 (FineGrainedFP8, compressed-tensors): e4m3 weights and their block scales
    Int4Experts  int4 (AWQ, GPTQ with or without desc_act, compressed-tensors W4A16): 4-bit values
                 two a byte, a scale and a zero point per group of input columns
    gate, up [E, I, D] each; down [E, D, I]

FP8 and int4 experts whose shapes the kernels take run a step that does not group by expert
through the quantized expert ops (layers/moe_quantized_ops.py): each chosen expert's stored bytes
read once, dequantized in registers to the dense ops' exact inputs. The rest (GPTQ desc_act's
column orders, odd widths) run by
dequantizing what a step needs into temporaries in the activations' dtype, with device ops only
(capturable) except where noted: a step of at most as many (token, expert) pairs as experts
(decode) gathers its pairs' experts (gathered_experts); a step of more pairs that does not group
(captured, or fewer than GROUPED_MIN_PAIRS) dequantizes every expert once (dequantize_all) and
runs the dense experts' kernels; an eager step of many pairs (prefill) dequantizes its experts
too, as many at a time as PREFILL_DEQUANTIZED_BYTES holds (every one of Qwen3-30B-A3B's at once),
and groups by expert as dense experts do (layers/moe.py).
"""

from __future__ import annotations

import dataclasses

import torch

from pagedkv import ops


@dataclasses.dataclass(slots=True)
class Fp8Experts:
    """One projection of every expert: expert e's W[j, c] = weight[e, j, c] * scales[e, j // block[0],
    c // block[1]], as quant.fp8's Fp8Weight per expert."""

    weight: torch.Tensor  # [E, R, C] float8_e4m3fn
    scales: torch.Tensor  # [E, ceil(R / block[0]), ceil(C / block[1])] float32
    block: tuple[int, int]

    def tensors(self) -> list[torch.Tensor]:
        return [self.weight, self.scales]


@dataclasses.dataclass(slots=True)
class Int4Experts:
    """One projection of every expert, as quant.int4's Int4Weight per expert with its values
    packed: expert e's W[j, perm[e, c]] = (q[e, j, c] - zeros[e, j, c // g]) * scales[e, j, c // g],
    q[e, j, 2i] the low and q[e, j, 2i + 1] the high nibble of packed[e, j, i]."""

    packed: torch.Tensor  # [E, R, C / 2] uint8
    scales: torch.Tensor  # [E, R, C / g], the checkpoint's float dtype
    zeros: torch.Tensor  # [E, R, C / g] uint8
    group_size: int  # g
    perm: torch.Tensor | None  # [E, C] int64 (desc_act), None: the identity for every expert

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.packed, self.scales, self.zeros, self.perm) if t is not None]


QuantizedExperts = Fp8Experts | Int4Experts


def stored_values(w: QuantizedExperts) -> torch.Tensor:
    """The stored values [E, R, ...] (e4m3 weights or packed int4)."""
    return w.weight if isinstance(w, Fp8Experts) else w.packed


def num_experts(w: QuantizedExperts) -> int:
    return stored_values(w).shape[0]


def dequantize_experts(w: QuantizedExperts, experts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weights [P, R, C] of experts [P] (int64, on w's device) computed in fp32 (one rounding
    per value, as the formats dequantize), then cast to dtype."""
    if isinstance(w, Int4Experts):
        return _dequantize_int4(w, experts, dtype)
    rows, cols = w.weight.shape[1:]
    # e4m3 values are exact in every float dtype, so the gathered values are cast to the output
    # dtype first, and one multiply (in fp32, the scales' dtype) writes that dtype: the fp32
    # product rounded once, ~9 bytes moved a weight where fp32 temporaries moved ~21.
    (bn, bk), q, scales = w.block, w.weight[experts].to(dtype), w.scales[experts]  # [P, R, C], [P, gR, gC]
    out = torch.empty_like(q)
    if rows % bn == 0 and cols % bk == 0:  # whole blocks: each scale broadcast over its block
        shape = (-1, rows // bn, bn, cols // bk, bk)
        torch.mul(q.view(shape), scales[:, :, None, :, None], out=out.view(shape))
        return out
    scales = scales.repeat_interleave(bn, 1)[:, :rows].repeat_interleave(bk, 2)[:, :, :cols]  # [P, R, C]
    return torch.mul(q, scales, out=out)


def dequantize_all(w: QuantizedExperts, dtype: torch.dtype, chunk: int = 16,
                   experts: range | None = None) -> torch.Tensor:
    """Every expert's weight [E, R, C] in dtype (or those of `experts`, a range: [len, R, C]),
    chunk experts at a time (so the fp32 temporary stays chunk experts large)."""
    experts = range(num_experts(w)) if experts is None else experts
    ids = torch.arange(experts.start, experts.stop, device=stored_values(w).device)
    first = dequantize_experts(w, ids[:chunk], dtype)
    out = first.new_empty((len(ids), *first.shape[1:]))
    out[:chunk] = first
    for start in range(chunk, len(ids), chunk):
        out[start:start + chunk] = dequantize_experts(w, ids[start:start + chunk], dtype)
    return out


def _dequantize_int4(w: Int4Experts, experts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    packed = w.packed[experts]  # [P, R, C / 2]
    pairs, rows, cols = packed.shape[0], packed.shape[1], 2 * packed.shape[2]
    q = torch.stack([packed & 0xF, packed >> 4], dim=-1).view(pairs, rows, cols // w.group_size, w.group_size)
    zeros, scales = w.zeros[experts].unsqueeze(-1), w.scales[experts].unsqueeze(-1)
    if scales.dtype == dtype:
        # q - z is a small integer, exact in dtype, and a product of two dtype tensors is computed
        # in fp32 and rounded once, as the fp32 form below: no fp32 temporaries (~12 bytes moved a
        # weight, not ~35)
        weight = (q.to(torch.int8) - zeros.to(torch.int8)).to(dtype) * scales
    else:
        weight = ((q.float() - zeros.float()) * scales.float()).to(dtype)
    weight = weight.view(pairs, rows, cols)  # [P, R, C], columns in group order
    if w.perm is not None:  # desc_act: column c multiplies input column perm[e, c]
        weight = torch.empty_like(weight).scatter_(2, w.perm[experts].unsqueeze(1).expand(-1, rows, -1), weight)
    return weight


def pack_int4_experts(q: list[torch.Tensor], scales: list[torch.Tensor], zeros: list[torch.Tensor],
                      group_size: int, perms: list[torch.Tensor | None], what: str) -> Int4Experts:
    """Each expert's canonical int4 values q [R, C] uint8 (0..15), scales and zeros [R, C / g], and
    column order (None: the identity), in expert order, as one Int4Experts. ValueError naming `what`
    for experts of other shapes."""
    _check_alike([(t.shape, s.shape) for t, s in zip(q, scales)], what)
    values = torch.stack(q)  # [E, R, C]
    packed = (values[..., 0::2] | (values[..., 1::2] << 4)).contiguous()
    perm = None
    if any(p is not None for p in perms):
        cols = values.shape[-1]
        perm = torch.stack([torch.arange(cols) if p is None else p.to(torch.int64) for p in perms])
    return Int4Experts(packed=packed, scales=torch.stack(scales), zeros=torch.stack(zeros), group_size=group_size,
                       perm=perm)


def stack_fp8_experts(weights: list[torch.Tensor], scales: list[torch.Tensor], block: tuple[int, int],
                      what: str) -> Fp8Experts:
    """Each expert's e4m3 weight [R, C] and fp32 scales (its block grid), in expert order, as one
    Fp8Experts. ValueError naming `what` for experts of other shapes."""
    _check_alike([(w.shape, s.shape) for w, s in zip(weights, scales)], what)
    return Fp8Experts(weight=torch.stack(weights), scales=torch.stack(scales), block=block)


def _check_alike(shapes: list[tuple], what: str) -> None:
    for e, (weight, scales) in enumerate(shapes):
        if (weight, scales) != shapes[0]:
            raise ValueError(f"{what}: expert {e} is stored as a {list(weight)} weight with {list(scales)} "
                             f"scales; expert 0 as {list(shapes[0][0])} with {list(shapes[0][1])}: the experts "
                             "of one layer must share them")


def gathered_experts(x: torch.Tensor, gate: QuantizedExperts, up: QuantizedExperts, down: QuantizedExperts,
                     ids: torch.Tensor) -> torch.Tensor:
    """Each (token, expert) pair's expert output [P, D] for x [T, D] and the routing ids [T, k]
    (int64; P = T k, pair p = token p // k), with HF's rounding (each projection rounded to x's
    dtype, silu(gate) * up as HF's act_fn): every pair's experts gathered and dequantized, device
    ops only (capturable). layers/moe.py weights and sums them."""
    flat = ids.reshape(-1)  # [P]
    column = x.repeat_interleave(ids.shape[1], dim=0).unsqueeze(-1)  # [P, D, 1]: each pair's token
    g = torch.bmm(dequantize_experts(gate, flat, x.dtype), column)  # [P, I, 1]
    u = torch.bmm(dequantize_experts(up, flat, x.dtype), column)
    act = ops.silu_and_mul(torch.cat([g, u], dim=1).squeeze(-1))  # [P, I]
    return torch.bmm(dequantize_experts(down, flat, x.dtype), act.unsqueeze(-1)).squeeze(-1)  # [P, D]
