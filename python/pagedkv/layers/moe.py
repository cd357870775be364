"""Mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE) on pagedkv ops, with HF's routing and
rounding, and the router top-k's and the two expert ops' typed wrappers.

    router logits = x @ router^T -> softmax in fp32 -> top-k -> renormalise (Mixtral always,
    Qwen: norm_topk_prob) -> cast to the model dtype (Qwen; Mixtral keeps fp32)
    -> per chosen expert: silu(x @ gate^T) * (x @ up^T) -> @ down^T -> times its weight -> sum
    (+ Qwen2-MoE's shared expert times sigmoid(x @ shared_gate^T))

Few tokens (decode steps, and any step inside CUDA-graph capture) run the expert kernels, which
read only the chosen experts' rows and read the expert ids on the device; many tokens (prefill)
sort the (token, expert) pairs by expert and run each projection of every hit expert as one
grouped GEMM (torch's grouped_mm: one launch, no host sync), as HF's grouped_mm experts forward
(transformers' default `experts_implementation`) does. Where torch's grouped GEMM does not run
(see grouped_mm_runs), each hit expert's GEMMs run one after another.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from pagedkv import ops
from pagedkv.layers.moe_quantized import (Int4Experts, QuantizedExperts, dequantize_all, gathered_experts, num_experts,
                                          stored_values)
from pagedkv.layers.moe_quantized_ops import moe_down_sum_quantized, moe_gate_up_silu_quantized, quantized_kernels_take

_ops = torch.ops.pagedkv
# Above this many (token, expert) pairs outside graph capture, group by expert (one GEMM per hit
# expert reads its weights once) instead of one GEMV per pair.
GROUPED_MIN_PAIRS = 256
# Types whose router keeps the top-k weights in fp32 (HF's Mixtral never casts them back), so
# each weighted expert output is fp32 before the sum.
FP32_ROUTING_WEIGHTS = ("mixtral",)
# A prefill step of a quantized checkpoint's experts dequantizes them into a temporary of at most
# this many bytes at a time (bf16: all 128 of Qwen3-30B-A3B's, 1.2 GB; Mixtral-8x7B's 6 of 8).
PREFILL_DEQUANTIZED_BYTES = 2 << 30
# Up to this many tokens, route() runs pagedkv's linear (on CUDA the weight-streaming GEMV, the
# router read once over many SMs) then the moe_topk op (one launch instead of torch's ~6); more
# (prefill) keep torch's ops after the GEMM, HF's own kernels. moe_topk's limits: E and k.
TOPK_MAX_TOKENS = 128
TOPK_MAX_EXPERTS = 4096
TOPK_MAX_K = 32


@dataclasses.dataclass(slots=True)
class MoEWeights:
    """One MoE layer's weights, HF's own tensors as stored (no copy)."""

    router: torch.Tensor  # [E, D]
    # [E, 2 * I, D]: each expert's gate rows, then its up rows; or a quantized checkpoint's
    # experts (layers/moe_quantized.py): (gate [E, I, D], up [E, I, D])
    gate_up: torch.Tensor | tuple[QuantizedExperts, QuantizedExperts]
    down: torch.Tensor | QuantizedExperts  # [E, D, I]
    top_k: int
    normalize: bool  # renormalise the top-k probabilities to sum to 1
    fp32_weights: bool  # the top-k weights stay fp32 (Mixtral), else the model dtype
    shared_gate: torch.Tensor | None  # [1, D]: Qwen2-MoE's sigmoid gate of its shared expert


def moe_weights(mlp: torch.nn.Module, model_type: str) -> MoEWeights | None:
    """The MoE weights of an HF decoder layer's `mlp` (transformers 5's 3D expert parameters),
    or None for a dense MLP. A shared expert's own gate_up/down are the layer's dense MLP weights
    (models/llama.py takes them)."""
    experts = mlp._modules.get("experts")
    if experts is None:
        return None
    router = mlp._modules["gate"]
    shared_gate = mlp._modules.get("shared_expert_gate")
    return MoEWeights(
        router=router.weight.detach(), gate_up=experts.gate_up_proj.detach(), down=experts.down_proj.detach(),
        top_k=int(router.top_k), normalize=bool(getattr(router, "norm_topk_prob", True)),
        fp32_weights=model_type in FP32_ROUTING_WEIGHTS,
        shared_gate=None if shared_gate is None else shared_gate.weight.detach())


def moe_weight_tensors(w: MoEWeights) -> list[torch.Tensor]:
    """The tensors of `w` (for counting weight bytes)."""
    if isinstance(w.down, torch.Tensor):
        experts = [w.gate_up, w.down]
    else:  # quantized: each projection's packed tensors
        experts = [t for e in (*w.gate_up, w.down) for t in e.tensors()]
    return [t for t in (w.router, *experts, w.shared_gate) if t is not None]


def route(x: torch.Tensor, w: MoEWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] -> (expert ids [T, k] int64, weights [T, k] fp32 or x's dtype), HF's order of
    operations. Device ops only (capturable). The logits in the model dtype (HF's nn.Linear); up to
    TOPK_MAX_TOKENS tokens the moe_topk op takes them, more: torch's ops."""
    logits = ops.linear(x, w.router)  # [T, E], the model dtype
    if x.shape[0] <= TOPK_MAX_TOKENS and w.router.shape[0] <= TOPK_MAX_EXPERTS and w.top_k <= TOPK_MAX_K:
        return moe_topk(logits, w.top_k, w.normalize, w.fp32_weights)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, ids = torch.topk(probs, w.top_k, dim=-1)
    if w.normalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return ids, top if w.fp32_weights else top.to(x.dtype)


def moe_mlp(x: torch.Tensor, w: MoEWeights, shared: torch.Tensor | None = None) -> torch.Tensor:
    """The MoE MLP of x [T, D] -> [T, D], x's dtype. shared [T, D]: a shared expert's output for x
    (Qwen2-MoE; the caller runs it, in whatever form its weights are held), gated by
    w.shared_gate."""
    ids, weights = route(x, w)
    pairs = ids.numel()
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    quantized = not isinstance(w.down, torch.Tensor)  # a quantized checkpoint's (layers/moe_quantized.py)
    if pairs >= GROUPED_MIN_PAIRS and not capturing:
        out = _grouped_experts(x, w, ids, weights)
    elif quantized and quantized_kernels_take(x, *w.gate_up, w.down):  # the stored bytes read once
        out = moe_down_sum_quantized(moe_gate_up_silu_quantized(x, *w.gate_up, ids), w.down, ids, weights)
    elif quantized and pairs > num_experts(w.down):
        # More pairs than experts (captured, or under GROUPED_MIN_PAIRS): every expert dequantized
        # once (a temporary of the layer's size, however many rows the step has), then the kernels.
        dense = dequantized(w, x.dtype)
        out = moe_down_sum(moe_gate_up_silu(x, dense.gate_up, ids), dense.down, ids, weights)
    elif quantized:  # only the pairs' experts
        out = _weighted_sum(gathered_experts(x, *w.gate_up, w.down, ids), weights, x.dtype)
    else:
        out = moe_down_sum(moe_gate_up_silu(x, w.gate_up, ids), w.down, ids, weights)
    if shared is not None:
        out = out + torch.sigmoid(ops.linear(x, w.shared_gate)) * shared
    return out


def dequantized(w: MoEWeights, dtype: torch.dtype, experts: range | None = None) -> MoEWeights:
    """w with the experts of a quantized checkpoint (all, or those of `experts`) dequantized to
    dtype (device ops): gate_up [E, 2 I, D], down [E, D, I], as dense experts are held."""
    gate_up = torch.cat([dequantize_all(e, dtype, experts=experts) for e in w.gate_up], dim=1)  # [E, 2 I, D]
    return dataclasses.replace(w, gate_up=gate_up, down=dequantize_all(w.down, dtype, experts=experts))


def grouped_mm_runs(x: torch.Tensor, w: MoEWeights) -> bool:
    """Whether torch's grouped GEMM (F.grouped_mm, torch >= 2.10) takes the experts of `w` for
    activations like x: on CUDA bf16 only, from compute capability 8.0, rows of 16-byte
    multiples; on the CPU any float dtype. Both want 16-byte aligned weights (torch 2.10's CPU
    kernel asks for it; the activations it gets are fresh tensors)."""
    if not isinstance(w.down, torch.Tensor) or not hasattr(F, "grouped_mm"):  # quantized experts
        return False
    if w.gate_up.data_ptr() % 16 or w.down.data_ptr() % 16:
        return False
    if x.is_cuda:
        rows_aligned = w.gate_up.shape[-1] % 8 == 0 and w.down.shape[-1] % 8 == 0
        return x.dtype == torch.bfloat16 and rows_aligned and torch.cuda.get_device_capability(x.device) >= (8, 0)
    return x.device.type == "cpu"


def _grouped_experts(x: torch.Tensor, w: MoEWeights, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """HF's grouped_mm experts forward: the (token, expert) pairs sorted by expert, each projection
    of every hit expert one grouped GEMM, HF's activation rounding between them, the weighted
    outputs summed per token in fp32 and rounded. Device ops only where grouped_mm runs on dense
    experts; otherwise the counts are read back to the host (not capturable)."""
    top_k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # [T * k] pairs by expert
    x_sorted = x[order // top_k]  # [T * k, D]
    if isinstance(w.down, torch.Tensor):
        y_sorted = _sorted_expert_rows(x_sorted, w, flat[order], 0)
    else:
        y_sorted = _sorted_quantized_expert_rows(x_sorted, w, flat[order])
    y = torch.empty_like(y_sorted)
    y[order] = y_sorted
    return _weighted_sum(y, weights, x.dtype)


def _sorted_expert_rows(x_sorted: torch.Tensor, w: MoEWeights, sorted_ids: torch.Tensor, first: int) -> torch.Tensor:
    """The expert outputs [P, D] of pairs sorted by expert (x_sorted [P, D], their experts
    sorted_ids [P]), w's dense experts being experts first, first + 1, ... of the layer. One
    grouped GEMM a projection where grouped_mm runs, else one GEMM per hit expert."""
    count = w.gate_up.shape[0]
    if grouped_mm_runs(x_sorted, w):
        # ends[e]: one past expert first + e's last pair in the sorted order (grouped_mm's offs)
        experts = torch.arange(first, first + count, device=x_sorted.device, dtype=sorted_ids.dtype)
        ends = torch.searchsorted(sorted_ids, experts, right=True).to(torch.int32)  # [E]
        gate_up = F.grouped_mm(x_sorted, w.gate_up.transpose(-2, -1), offs=ends)  # [P, 2 I]
        return F.grouped_mm(ops.silu_and_mul(gate_up), w.down.transpose(-2, -1), offs=ends)  # [P, D]
    count_of = torch.bincount(sorted_ids - first, minlength=count).tolist()
    y_sorted = x_sorted.new_empty(x_sorted.shape[0], w.down.shape[1])  # [P, D]
    start = 0
    for e, rows in enumerate(count_of):
        if rows:
            act = ops.gate_up_silu(x_sorted[start:start + rows], w.gate_up[e])  # [rows, I]
            ops.linear(act, w.down[e], out=y_sorted[start:start + rows])
            start += rows
    return y_sorted


def _sorted_quantized_expert_rows(x_sorted: torch.Tensor, w: MoEWeights, sorted_ids: torch.Tensor) -> torch.Tensor:
    """_sorted_expert_rows for a quantized checkpoint's experts, dequantized (device ops) as many
    at a time as PREFILL_DEQUANTIZED_BYTES holds: all of them in one temporary where they fit,
    else a chunk of experts after another, their pairs' row ranges read back once. (One expert at
    a time was ~2,000 small launches a step behind a host sync a layer: hundreds of ms, swinging
    with the host's load.)"""
    count = num_experts(w.down)
    per_expert = sum(stored_values(e)[0].numel() * (2 if isinstance(e, Int4Experts) else 1)
                     for e in (*w.gate_up, w.down)) * x_sorted.element_size()
    chunk = max(1, PREFILL_DEQUANTIZED_BYTES // per_expert)
    if chunk >= count:
        return _sorted_expert_rows(x_sorted, dequantized(w, x_sorted.dtype), sorted_ids, 0)
    ends = torch.bincount(sorted_ids, minlength=count).cumsum(0).tolist()  # the one read-back
    y_sorted = x_sorted.new_empty(x_sorted.shape)  # [P, D]
    for first in range(0, count, chunk):
        last = min(first + chunk, count)
        rows = slice(ends[first - 1] if first else 0, ends[last - 1])
        if rows.start < rows.stop:
            dense = dequantized(w, x_sorted.dtype, range(first, last))
            y_sorted[rows] = _sorted_expert_rows(x_sorted[rows], dense, sorted_ids[rows], first)
    return y_sorted


def _weighted_sum(y: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """sum_j y[t k + j] * weights[t, j] -> [T, D] in dtype: each expert output [T k, D] times its
    weight in the weights' dtype (fp32 for Mixtral, else the model's), summed in fp32 (HF's
    grouped experts forward)."""
    num_tokens, top_k = weights.shape
    return (y.view(num_tokens, top_k, -1) * weights.unsqueeze(-1)).sum(dim=1).to(dtype)


def moe_topk(logits: torch.Tensor, top_k: int, normalize: bool, fp32_weights: bool,
             expert_ids: torch.Tensor | None = None, weights: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's router after its linear in one op: logits [T, E] (the model dtype, E <= TOPK_MAX_EXPERTS)
    -> (expert_ids [T, k] int64, weights [T, k] fp32 if fp32_weights else logits' dtype), k <=
    TOPK_MAX_K: torch.topk of softmax(logits) in fp32, each divided by their fp32 sum if normalize.
    CPU: HF's own ATen ops, bit for bit. CUDA: one block a token reproducing torch's CUDA kernels
    (csrc/kernels/moe_topk.cu): torch.topk's ids and order, ties included."""
    if expert_ids is None:
        expert_ids = torch.empty((logits.shape[0], top_k), dtype=torch.int64, device=logits.device)
    if weights is None:
        weights = torch.empty((logits.shape[0], top_k), dtype=torch.float32 if fp32_weights else logits.dtype,
                              device=logits.device)
    _ops.moe_topk(expert_ids, weights, logits, normalize)
    return expert_ids, weights


def moe_gate_up_silu(x: torch.Tensor, gate_up: torch.Tensor, expert_ids: torch.Tensor,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """out[t, j] = silu(x[t] @ gate^T) * (x[t] @ up^T) of expert e = expert_ids[t, j], each product
    rounded to the dtype (HF's). x [T, D]; gate_up [E, 2 * I, D] (HF's experts.gate_up_proj);
    expert_ids [T, k] int64; out [T, k, I]. Reads only the chosen experts' rows."""
    if out is None:
        out = x.new_empty((x.shape[0], expert_ids.shape[1], gate_up.shape[1] // 2))
    _ops.moe_gate_up_silu(out, x, gate_up, expert_ids)
    return out


def moe_down_sum(act: torch.Tensor, down: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """out[t] = sum_j (act[t, j] @ down[e]^T) * weights[t, j], e = expert_ids[t, j]: each expert's
    output rounded to the dtype, weighted in weights' dtype (float32 or act's), summed in fp32,
    rounded (HF's grouped experts forward). act [T, k, I]; down [E, D, I]; out [T, D]."""
    if out is None:
        out = act.new_empty((act.shape[0], down.shape[1]))
    _ops.moe_down_sum(out, act, down, expert_ids, weights)
    return out


@torch.library.register_fake("pagedkv::moe_gate_up_silu")
def _moe_gate_up_silu_fake(out, x, gate_up, expert_ids) -> None:
    torch._check(out.shape == (x.shape[0], expert_ids.shape[1], gate_up.shape[1] // 2))


@torch.library.register_fake("pagedkv::moe_down_sum")
def _moe_down_sum_fake(out, act, down, expert_ids, weights) -> None:
    torch._check(out.shape == (act.shape[0], down.shape[1]))


@torch.library.register_fake("pagedkv::moe_topk")
def _moe_topk_fake(expert_ids, weights, logits, normalize) -> None:
    torch._check(expert_ids.shape == weights.shape and expert_ids.shape[0] == logits.shape[0])
