"""Typed wrappers over ``torch.ops.pagedkv.*`` with fake (meta) implementations for torch.compile.

Every op writes into tensors it is given and returns nothing, so it allocates nothing and can be
captured in a CUDA graph. Wrappers that return a tensor allocate it only when ``out`` is None.
Shapes and dtypes are checked in C++; a bad call raises RuntimeError naming the argument.
"""

from __future__ import annotations

import torch

from pagedkv._ext import _C  # noqa: F401  (registers torch.ops.pagedkv)

_ops = torch.ops.pagedkv


def rms_norm(
    input: torch.Tensor, weight: torch.Tensor, epsilon: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm with HF's rounding: ``weight * (input * rsqrt(mean(input**2) + eps)).to(dtype)``.

    input: [..., hidden] contiguous, float32/float16/bfloat16; weight: [hidden], same dtype and
    device; out: like input, or None to allocate one. Returns out.
    """
    if out is None:
        out = torch.empty_like(input)
    _ops.rms_norm(out, input, weight, epsilon)
    return out


def fused_add_rms_norm(
    input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, epsilon: float
) -> None:
    """In place: ``residual += input`` (rounded to the dtype), then ``input = rms_norm(residual)``.

    input, residual: [..., hidden] contiguous, same dtype/device; weight: [hidden].
    """
    _ops.fused_add_rms_norm(input, residual, weight, epsilon)


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.linear``: x [..., K] (last dim contiguous) @ weight [N, K]^T + bias [N] -> [..., N].

    On CUDA, 1-2 rows of bf16/fp16 x use pagedkv's weight-streaming kernel (small-batch decode
    steps are bound by reading the weight once; it beats cuBLAS there); more rows, or fp32, use
    cuBLAS.
    """
    if out is None:
        out = x.new_empty((*x.shape[:-1], weight.shape[0]))
    _ops.linear(out, x, weight, bias)
    return out


@torch.library.register_fake("pagedkv::rms_norm")
def _rms_norm_fake(out, input, weight, epsilon) -> None:
    return None


@torch.library.register_fake("pagedkv::linear")
def _linear_fake(out, x, weight, bias) -> None:
    return None


@torch.library.register_fake("pagedkv::fused_add_rms_norm")
def _fused_add_rms_norm_fake(input, residual, weight, epsilon) -> None:
    return None


# --- paged decode attention -------------------------------------------------------------------


def paged_decode_num_splits(q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor) -> int:
    """How many splits of each sequence's context ``paged_decode_attention`` uses on q's device
    when ``num_splits=0``: chosen from shapes and the SM count only, never from context_lens.
    1 on the CPU, which never splits."""
    if q.device.type != "cuda":
        return 1
    num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    return _ops.paged_decode_num_splits(
        q.shape[0], q.shape[1], k_cache.shape[2], k_cache.shape[1], block_tables.shape[1], num_sms
    )


def paged_decode_workspace(
    q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor, num_splits: int = 0
) -> torch.Tensor:
    """The fp32 workspace ``paged_decode_attention`` needs for these shapes: allocate it once
    (e.g. per CUDA graph bucket) and pass it to every call. Empty when no split is used.

    num_splits: the value that will be passed to paged_decode_attention (0 = automatic).
    """
    splits = num_splits or paged_decode_num_splits(q, k_cache, block_tables)
    batch, num_q_heads, head_dim = q.shape
    numel = batch * num_q_heads * splits * (head_dim + 2) if splits > 1 else 0
    return torch.empty(numel, dtype=torch.float32, device=q.device)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    num_splits: int = 0,
) -> torch.Tensor:
    """Decode attention over a paged KV cache: for each sequence b and query head h,
    ``out[b, h] = softmax(scale * K_b @ q[b, h]) @ V_b`` where K_b, V_b are the first
    ``context_lens[b]`` tokens of kv head ``h // (Hq // Hkv)`` read through ``block_tables[b]``.

    q: [B, Hq, D] (head_dim contiguous; other strides free), D in {64, 128, 256},
    float32/float16/bfloat16; k_cache, v_cache: [num_blocks, block_size, Hkv, D] contiguous, same
    dtype, block_size a power of two in [8, 128], Hq a multiple of Hkv; block_tables:
    [B, max_blocks] int32 (entries past a sequence's blocks are never read); context_lens: [B]
    int32, at most max_blocks * block_size, 0 for a padding row (its output is zeros).
    out: like q, or None to allocate one. workspace: from ``paged_decode_workspace`` (allocated
    here when None; pass it under CUDA graphs and torch.compile). num_splits: 0 = automatic.
    Returns out.
    """
    if out is None:
        out = torch.empty_like(q)
    if workspace is None:
        workspace = paged_decode_workspace(q, k_cache, block_tables, num_splits)
    _ops.paged_decode_attention(
        out, q, k_cache, v_cache, block_tables, context_lens, scale, workspace, num_splits
    )
    return out


@torch.library.register_fake("pagedkv::paged_decode_attention")
def _paged_decode_attention_fake(
    out, q, k_cache, v_cache, block_tables, context_lens, scale, workspace, num_splits=0
) -> None:
    return None
