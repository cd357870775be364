"""A mixture-of-experts layer's FP8 experts (FineGrainedFP8 or compressed-tensors checkpoints of
Qwen2-MoE, Qwen3-MoE, OLMoE, Mixtral), held as stored: each projection of every expert e4m3 with
its block scales, stacked over the experts.

    gate, up  Fp8Experts [E, I, D] each      down  Fp8Experts [E, D, I]

They run by dequantizing only what a step needs (fp8_experts_mlp): a step of few (token, expert)
pairs (decode, CUDA graphs) gathers its pairs' experts and dequantizes them into a temporary in
the activations' dtype (device ops only: capturable); a step of many pairs (prefill) takes each
hit expert once. Correct on every device; no FP8 expert kernel yet, so a decode step moves each
chosen expert's bytes about three times (gather, dequantize, product) where a kernel would once.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from pagedkv import ops


@dataclasses.dataclass(slots=True)
class Fp8Experts:
    """One projection of every expert: expert e's W[j, c] = weight[e, j, c] * scales[e, j // block[0],
    c // block[1]], as Fp8Weight per expert."""

    weight: torch.Tensor  # [E, R, C] float8_e4m3fn
    scales: torch.Tensor  # [E, ceil(R / block[0]), ceil(C / block[1])] float32
    block: tuple[int, int]

    def tensors(self) -> list[torch.Tensor]:
        return [self.weight, self.scales]


def stack_experts(weights: list[torch.Tensor], scales: list[torch.Tensor], block: tuple[int, int],
                  what: str) -> Fp8Experts:
    """Each expert's e4m3 weight [R, C] and fp32 scales (its block grid), in expert order, as one
    Fp8Experts. They must share shapes (one checkpoint's experts do); ValueError naming `what`."""
    for e, (w, s) in enumerate(zip(weights, scales)):
        if w.shape != weights[0].shape or s.shape != scales[0].shape:
            raise ValueError(f"{what}: expert {e} is stored as a {list(w.shape)} weight with {list(s.shape)} "
                             f"scales; expert 0 as {list(weights[0].shape)} with {list(scales[0].shape)}: the "
                             "experts of one layer must share them")
    return Fp8Experts(weight=torch.stack(weights), scales=torch.stack(scales), block=block)


def dequantize_experts(w: Fp8Experts, experts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weights [P, R, C] of experts [P] (int64, on w's device) in fp32 (one rounding per value,
    as the formats dequantize), then cast to dtype."""
    rows, cols = w.weight.shape[1:]
    (bn, bk), q, scales = w.block, w.weight[experts].float(), w.scales[experts]  # [P, R, C], [P, gR, gC]
    if rows % bn == 0 and cols % bk == 0:  # whole blocks: each scale broadcast over its block
        blocks = q.view(-1, rows // bn, bn, cols // bk, bk) * scales[:, :, None, :, None]
        return blocks.view(-1, rows, cols).to(dtype)
    scales = scales.repeat_interleave(bn, 1)[:, :rows].repeat_interleave(bk, 2)[:, :, :cols]  # [P, R, C]
    return (q * scales).to(dtype)


def fp8_experts_mlp(x: torch.Tensor, gate: Fp8Experts, up: Fp8Experts, down: Fp8Experts, ids: torch.Tensor,
                    weights: torch.Tensor, grouped: bool) -> torch.Tensor:
    """The experts' sum of x [T, D] -> [T, D] (x's dtype) for the routing ids [T, k] (int64) and
    weights [T, k], with HF's rounding (each projection rounded to the dtype, silu(gate) * up as
    HF's act_fn, each expert's output times its weight in the weights' dtype, summed in fp32).
    grouped: take each hit expert once (the counts read back: not capturable); else gather
    every pair's experts (device ops only)."""
    num_tokens, top_k = ids.shape
    flat = ids.reshape(-1)  # [P]
    x_pairs = x.repeat_interleave(top_k, dim=0)  # [P, D]: each pair's token
    if grouped:
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=gate.weight.shape[0]).tolist()
        y_sorted = x.new_empty(flat.numel(), x.shape[1])  # [P, D] by expert
        start = 0
        for e, count in enumerate(counts):
            if count:
                rows, one = order[start:start + count], torch.tensor([e], device=x.device)
                g = F.linear(x_pairs[rows], dequantize_experts(gate, one, x.dtype)[0])  # [count, I]
                u = F.linear(x_pairs[rows], dequantize_experts(up, one, x.dtype)[0])
                act = ops.silu_and_mul(torch.cat([g, u], dim=-1))
                y_sorted[start:start + count] = F.linear(act, dequantize_experts(down, one, x.dtype)[0])
                start += count
        y = torch.empty_like(y_sorted)
        y[order] = y_sorted
    else:
        column = x_pairs.unsqueeze(-1)  # [P, D, 1]
        g = torch.bmm(dequantize_experts(gate, flat, x.dtype), column)  # [P, I, 1]
        u = torch.bmm(dequantize_experts(up, flat, x.dtype), column)
        act = ops.silu_and_mul(torch.cat([g, u], dim=1).squeeze(-1))  # [P, I]
        y = torch.bmm(dequantize_experts(down, flat, x.dtype), act.unsqueeze(-1)).squeeze(-1)  # [P, D]
    weighted = y.view(num_tokens, top_k, -1) * weights.unsqueeze(-1)  # fp32 (Mixtral) or the dtype
    return weighted.sum(dim=1).to(x.dtype)
