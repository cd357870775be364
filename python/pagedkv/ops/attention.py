"""Paged attention, decode and prefill: the ops, their split counts and split workspaces."""

from __future__ import annotations

import torch

from pagedkv.ops._common import _kv_scales, _ops


def _num_sms(device: torch.device) -> int:
    """SMs of a CUDA device: the split rules of both attention ops plan with it."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def paged_decode_num_splits(q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor) -> int:
    """How many splits of each sequence's context ``paged_decode_attention`` uses on q's device
    when ``num_splits=0``: chosen from shapes and the SM count only, never from context_lens.
    1 on the CPU, which never splits."""
    if q.device.type != "cuda":
        return 1
    return _ops.paged_decode_num_splits(
        q.shape[0], q.shape[1], k_cache.shape[2], k_cache.shape[1], block_tables.shape[1],
        _num_sms(q.device), q.shape[2], q.dtype,
    )


def paged_decode_workspace(
    q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor, num_splits: int = 0
) -> torch.Tensor:
    """The fp32 workspace ``paged_decode_attention`` needs for these shapes: allocate it once
    (e.g. per decode step, shared by the layers) and pass it to every call of these shapes (or
    of a smaller batch). Empty when no split is used.

    Layout: B * Hq int32 merge counters (padded to 4) that must be zero before the first call
    (this returns zeros; every call leaves them zero), then the split partials and their softmax
    stats, which a call of a larger batch would read as counters: hence "these shapes".

    num_splits: the value that will be passed to paged_decode_attention (0 = automatic).
    """
    splits = num_splits or paged_decode_num_splits(q, k_cache, block_tables)
    numel = _ops.paged_decode_workspace_floats(*q.shape, splits)  # q: [B, Hq, D]
    return torch.zeros(numel, dtype=torch.float32, device=q.device)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    num_splits: int = 0, *, sliding_window: int = 0, logit_softcap: float = 0.0,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None, row_order: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention over a paged KV cache: for each sequence b and query head h,
    ``out[b, h] = softmax(scale * K_b @ q[b, h]) @ V_b`` where K_b, V_b are the first
    ``context_lens[b]`` tokens of kv head ``h // (Hq // Hkv)`` read through ``block_tables[b]``.

    q: [B, Hq, D] (head_dim contiguous; other strides free), D a multiple of 16 up to 256,
    float32/float16/bfloat16; k_cache, v_cache: [num_blocks, block_size, Hkv, D], same dtype,
    head_dim contiguous and the same strides (e.g. a head-major [num_blocks, Hkv, block_size, D]
    store passed as its transpose(1, 2) view), block_size a power of two in [8, 128], Hq a
    multiple of Hkv; block_tables: [B, max_blocks] int32 (entries past a sequence's blocks are
    never used); context_lens: [B] int32, at most max_blocks * block_size, 0 for a padding row
    (its output is zeros).
    out: like q, or None to allocate one. workspace: from ``paged_decode_workspace`` (allocated
    here when None; pass it under CUDA graphs and torch.compile). num_splits: 0 = automatic. Returns
    out. sliding_window > 0: the last sliding_window tokens only; logit_softcap > 0: scaled scores
    become ``cap * tanh(score / cap)`` (Gemma-2). Both on the CPU and CUDA.
    An fp8 cache (float8_e4m3fn) reads as ``float(x) * k_scale/v_scale``: see layers/attention.py.
    sinks: [Hq] float32 attention sinks (GPT-OSS): head h's softmax denominator gains
    ``exp(sinks[h])``, its output nothing (``softmax([scores, sink])[:-1] @ V``).
    row_order: [B] int32, a permutation of the rows: the order their thread blocks are launched in
    (e.g. longest context first, so ragged rows' last wave is not one long row alone). The output
    is the same with or without it; the CPU checks it is a permutation, CUDA trusts it as it
    trusts block_tables.
    """
    if out is None:
        out = torch.empty_like(q)
    if workspace is None:
        workspace = paged_decode_workspace(q, k_cache, block_tables, num_splits)
    k_scale, v_scale = _kv_scales(k_cache, v_cache, k_scale, v_scale)
    _ops.paged_decode_attention(
        out, q, k_cache, v_cache, block_tables, context_lens, scale, workspace, num_splits,
        sliding_window, logit_softcap, k_scale, v_scale, sinks, row_order)
    return out


@torch.library.register_fake("pagedkv::paged_decode_attention")
def _paged_decode_attention_fake(out, q, k_cache, v_cache, block_tables, context_lens, scale, workspace,
                                 num_splits=0, sliding_window=0, logit_softcap=0.0, k_scale=None,
                                 v_scale=None, sinks=None, row_order=None) -> None:
    return None


def paged_prefill_num_splits(
    q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor, max_query_len: int
) -> int:
    """How many splits of each query tile's keys ``paged_prefill_attention`` uses on q's device:
    chosen from shapes and the SM count only (a batch of few new tokens over a long context
    splits, so that every SM has work). 1 on the CPU, which never splits."""
    if q.device.type != "cuda":
        return 1
    return _ops.paged_prefill_num_splits(
        q.shape[0], block_tables.shape[0], max_query_len, q.shape[1], k_cache.shape[2], q.shape[2],
        q.dtype, block_tables.shape[1] * k_cache.shape[1], _num_sms(q.device),
    )


def paged_prefill_workspace(
    q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor, max_query_len: int
) -> torch.Tensor | None:
    """The fp32 workspace ``paged_prefill_attention`` needs for these shapes (its key splits'
    partial outputs), or None when it does not split them. Allocate it once per forward and pass
    it to every layer's call: the op allocates nothing itself when given one."""
    splits = paged_prefill_num_splits(q, k_cache, block_tables, max_query_len)
    numel = _ops.paged_prefill_workspace_floats(q.shape[0], q.shape[1], q.shape[2], splits)
    return torch.empty(numel, dtype=torch.float32, device=q.device) if numel else None


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None, *, sliding_window: int = 0, logit_softcap: float = 0.0,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of a flat batch of new tokens (prefill chunks of several sequences) over
    a paged KV cache that already holds them.

    Sequence b's new tokens are rows ``[query_start_loc[b], query_start_loc[b + 1])`` of q; they
    are the last ``q_len_b`` of its ``context_lens[b]`` tokens, so row i sits at position
    ``context_lens[b] - q_len_b + i`` and attends to cache positions 0 .. that position of kv
    head ``h // (Hq // Hkv)``, read through ``block_tables[b]`` (write the new K/V with
    ``rope_and_write_kv`` first). A row before position 0 (a CUDA-graph padding row: context 0,
    one token) gets zeros; q_len 0 does nothing; rows of q outside every sequence are not written.

    q: [T, Hq, D] (head_dim contiguous; token/head strides free, e.g. a view of a fused QKV
    output), D a multiple of 16 up to 256, float32/float16/bfloat16; k_cache, v_cache:
    [num_blocks, block_size, Hkv, D], same dtype, head_dim contiguous and the same strides (as
    paged_decode_attention), block_size a power of two in [8, 128]; block_tables:
    [B, max_blocks] int32; context_lens: [B] int32 (at most max_blocks * block_size);
    query_start_loc: [B + 1] int32, non-decreasing.
    max_query_len: host int >= every q_len_b; with T it bounds the CUDA grid without reading the
    device (the CPU raises if a sequence has more rows; on CUDA such rows may stay unwritten).
    out: like q, or None to allocate one. workspace: from ``paged_prefill_workspace`` when
    ``paged_prefill_num_splits`` > 1 (on CUDA allocated here if None; under torch.compile or in
    a CUDA graph pass one in). sliding_window, logit_softcap: as paged_decode_attention (a row
    at position p sees keys j with p - j < sliding_window). k_scale, v_scale: an fp8 cache's, as
    paged_decode_attention. sinks: as paged_decode_attention. Returns out.
    """
    if out is None:
        out = torch.empty_like(q)
    k_scale, v_scale = _kv_scales(k_cache, v_cache, k_scale, v_scale)
    if workspace is None and q.device.type == "cuda":  # the CPU never splits
        workspace = paged_prefill_workspace(q, k_cache, block_tables, max_query_len)
    _ops.paged_prefill_attention(
        out, q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, max_query_len,
        workspace, sliding_window, logit_softcap, k_scale, v_scale, sinks)
    return out


@torch.library.register_fake("pagedkv::paged_prefill_attention")
def _paged_prefill_attention_fake(out, q, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                                  scale, max_query_len, workspace=None, sliding_window=0,
                                  logit_softcap=0.0, k_scale=None, v_scale=None, sinks=None) -> None:
    return None
