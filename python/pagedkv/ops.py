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
    input: torch.Tensor, weight: torch.Tensor, epsilon: float, out: torch.Tensor | None = None,
    gemma_style: bool = False,
) -> torch.Tensor:
    """RMSNorm with HF's rounding: ``weight * (input * rsqrt(mean(input**2) + eps)).to(dtype)``.

    input: [..., hidden] contiguous, float32/float16/bfloat16; weight: [hidden], same dtype and
    device; out: like input, or None to allocate one. Returns out. gemma_style: HF's
    GemmaRMSNorm instead, ``(normed_fp32 * (1 + weight.float())).to(dtype)``.
    """
    if out is None:
        out = torch.empty_like(input)
    _ops.rms_norm(out, input, weight, epsilon, gemma_style)
    return out


def fused_add_rms_norm(
    input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, epsilon: float,
    gemma_style: bool = False,
) -> None:
    """In place: ``residual += input`` (rounded to the dtype), then ``input = rms_norm(residual)``.

    input, residual: [..., hidden] contiguous, same dtype/device; weight: [hidden]; gemma_style
    as rms_norm's.
    """
    _ops.fused_add_rms_norm(input, residual, weight, epsilon, gemma_style)


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.linear``: x [..., K] (last dim contiguous) @ weight [N, K]^T + bias [N] -> [..., N].

    On CUDA, 1-8 rows of bf16/fp16 x use pagedkv's weight-streaming kernels (small-batch decode
    steps are bound by reading the weight once): CUDA cores for 1-2 rows, tensor cores for 3-8;
    more rows, or fp32, use cuBLAS.
    """
    if out is None:
        out = x.new_empty((*x.shape[:-1], weight.shape[0]))
    _ops.linear(out, x, weight, bias)
    return out


def gate_up_silu(x: torch.Tensor, gate_up: torch.Tensor, out: torch.Tensor | None = None,
                 activation: str = "silu") -> torch.Tensor:
    """The MLP's first half, HF's rounding: ``silu(x @ gate^T) * (x @ up^T)``.

    x: [..., K] (last dim contiguous); gate_up: [2 * I, K], the gate rows then the up rows (the
    fused weight); out: [..., I]. On CUDA, 1-8 rows of bf16/fp16 x run as one weight-streaming
    kernel (no [.., 2 * I] intermediate, no second launch); otherwise a GEMM + silu_and_mul.
    activation "gelu_tanh" (HF's gelu_pytorch_tanh, Gemma's) always runs as linear + silu_and_mul.
    """
    if out is None:
        out = x.new_empty((*x.shape[:-1], gate_up.shape[0] // 2))
    if activation != "silu":
        return silu_and_mul(linear(x, gate_up), out=out, activation=activation)
    _ops.gate_up_silu(out, x, gate_up)
    return out


@torch.library.register_fake("pagedkv::rms_norm")
def _rms_norm_fake(out, input, weight, epsilon, gemma_style=False) -> None:
    return None


@torch.library.register_fake("pagedkv::linear")
def _linear_fake(out, x, weight, bias) -> None:
    return None


@torch.library.register_fake("pagedkv::gate_up_silu")
def _gate_up_silu_fake(out, x, gate_up) -> None:
    return None


@torch.library.register_fake("pagedkv::fused_add_rms_norm")
def _fused_add_rms_norm_fake(input, residual, weight, epsilon, gemma_style=False) -> None:
    return None


def peer_all_reduce_add_rms_norm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                 epsilon: float, buffer: torch.Tensor, peer_buffers: list[int],
                                 rank: int, timeout_ms: int) -> None:
    """In place, one launch: ``residual += sum over ranks of input`` (the sum rounded to the
    dtype), then ``input = rms_norm(residual)``. Every rank calls it with its partial sums;
    buffer: this rank's peer buffer (uint8; runtime/peer_all_reduce.py makes them);
    peer_buffers: every rank's buffer address as this rank sees it. A peer that does not come
    within timeout_ms fails the call (CUDA: the context) rather than wait forever."""
    _ops.peer_all_reduce_add_rms_norm(input, residual, weight, epsilon, buffer, peer_buffers, rank, timeout_ms)


@torch.library.register_fake("pagedkv::peer_all_reduce_add_rms_norm")
def _peer_all_reduce_add_rms_norm_fake(input, residual, weight, epsilon, buffer, peer_buffers, rank,
                                       timeout_ms) -> None:
    return None


# --- paged decode attention -------------------------------------------------------------------


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
    """
    if out is None:
        out = torch.empty_like(q)
    if workspace is None:
        workspace = paged_decode_workspace(q, k_cache, block_tables, num_splits)
    k_scale, v_scale = _kv_scales(k_cache, v_cache, k_scale, v_scale)
    _ops.paged_decode_attention(
        out, q, k_cache, v_cache, block_tables, context_lens, scale, workspace, num_splits,
        sliding_window, logit_softcap, k_scale, v_scale)
    return out


# --- Decode-step kernels: RoPE + KV write, SiLU*mul, sampling, block copy -----------------------


def rope_and_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    epsilon: float = 1e-6,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Rotary embedding of q and k in place, then k and v written into their cache slots.

    q: [num_tokens, num_q_heads, head_dim], k, v: [num_tokens, num_kv_heads, head_dim] (heads
    packed, token stride free: views of one fused QKV output work), float32/float16/bfloat16.
    positions, slot_mapping: [num_tokens] int32; a negative slot writes nothing (padding), its
    q/k are still rotated. cos_sin_cache: [max_position, rot_dim] float32 from
    ``pagedkv.layers.rotary.build_cos_sin_cache`` (rot_dim <= head_dim; dims past rot_dim are not
    rotated). k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], slot
    s = block * block_size + offset. q_norm_weight / k_norm_weight: [head_dim], Qwen3's per-head
    RMSNorm applied before the rotation. Rounding as HF's ``apply_rotary_pos_emb`` in the dtype.
    An fp8 cache stores e4m3 of ``(x.float() / scale).clamp(-448, 448)``: see layers/attention.py.
    """
    k_scale, v_scale = _kv_scales(k_cache, v_cache, k_scale, v_scale)
    _ops.rope_and_write_kv(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                           q_norm_weight, k_norm_weight, epsilon, k_scale, v_scale)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None, activation: str = "silu") -> torch.Tensor:
    """``act(x[..., :I]) * x[..., I:]`` rounded as HF's ``act_fn(gate) * up`` in the dtype.

    x: [..., 2 * I] contiguous (gate, then up), float32/float16/bfloat16; out: [..., I] or None
    to allocate one; activation: "silu" or "gelu_tanh" (HF's gelu_pytorch_tanh, torch's
    ``gelu(approximate="tanh")``). Returns out.
    """
    if out is None:
        out = x.new_empty(*x.shape[:-1], x.shape[-1] // 2)
    _ops.silu_and_mul(out, x, activation)
    return out


def sample(
    logits: torch.Tensor,
    temperatures: torch.Tensor | None = None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    seeds: torch.Tensor | None = None,
    offsets: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token id per row of logits [batch, vocab] (last dim contiguous), written to out.

    Without temperatures every row is greedy: exactly ``logits.argmax(-1)``. Per-row [batch]
    tensors on logits' device: temperatures float32 (<= 0 means greedy), top_k int32 (0 = off),
    top_p float32 (1.0 = off), seeds int64 and offsets int64 (both needed with temperatures).
    A sampled row draws from softmax(logits / T) restricted to HF's top-k then top-p sets; the
    draw depends only on (seed, offset) and the logits, never on global RNG state. A sampled row
    whose largest logit is NaN or +-inf (a NaN anywhere, or every logit -inf) has no softmax: it
    gets -1, an invalid token for the caller to raise on (HF's multinomial raises there); a
    greedy row keeps torch.argmax's answer (NaN counts as the largest). out: [batch] int64 or
    int32, or None to allocate int64. Returns out.
    """
    if out is None:
        out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    _ops.sample(out, logits, temperatures, top_k, top_p, seeds, offsets)
    return out


def copy_blocks(
    k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor
) -> None:
    """Copy-on-write of whole cache blocks: ``cache[dst[i]] = cache[src[i]]`` in every layer.

    k_caches, v_caches: one [num_blocks, block_size, num_kv_heads, head_dim] tensor per layer, all
    of one shape/dtype/device; src, dst: [N] int32 or int64 block ids on that device, dst blocks
    distinct and not among src. One CUDA launch per 64 layers.
    """
    _ops.copy_blocks(k_caches, v_caches, src, dst)


def advance_decode_rows(
    next_tokens: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
    context_lens: torch.Tensor, generated: torch.Tensor, offsets: torch.Tensor,
    slot_mapping: torch.Tensor, block_tables: torch.Tensor, block_size: int,
) -> None:
    """One decode step on for a batch whose rows have all their blocks reserved, in one kernel.

    In place: ``tokens = next_tokens`` (0 for an invalid -1 from ``sample``); rows with ``context_lens > 0`` (live) get positions,
    context_lens and generated + 1; offsets + 1 for every row; slot_mapping = the cache slot of
    the new position, ``block_tables[b, pos // block_size] * block_size + pos % block_size``, or
    -1 for padding rows and for a position past the row's table. block_tables: [B, max_blocks]
    int32; next_tokens, tokens, offsets: [B] int64; the rest [B] int32; one device.
    """
    _ops.advance_decode_rows(next_tokens, tokens, positions, context_lens, generated, offsets,
                             slot_mapping, block_tables, block_size)


@torch.library.register_fake("pagedkv::silu_and_mul")
def _silu_and_mul_fake(out, x, activation="silu") -> None:
    return None


@torch.library.register_fake("pagedkv::sample")
def _sample_fake(out, logits, temperatures, top_k, top_p, seeds, offsets) -> None:
    return None


@torch.library.register_fake("pagedkv::copy_blocks")
def _copy_blocks_fake(k_caches, v_caches, src, dst) -> None:
    return None


@torch.library.register_fake("pagedkv::advance_decode_rows")
def _advance_decode_rows_fake(next_tokens, tokens, positions, context_lens, generated, offsets,
                              slot_mapping, block_tables, block_size) -> None:
    return None


# --- paged prefill attention --------------------------------------------------------------------


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
    paged_decode_attention. Returns out.
    """
    if out is None:
        out = torch.empty_like(q)
    k_scale, v_scale = _kv_scales(k_cache, v_cache, k_scale, v_scale)
    if workspace is None and q.device.type == "cuda" and k_scale is None:  # fp8, CPU: no splits
        workspace = paged_prefill_workspace(q, k_cache, block_tables, max_query_len)
    _ops.paged_prefill_attention(
        out, q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, max_query_len,
        workspace, sliding_window, logit_softcap, k_scale, v_scale)
    return out


def _kv_scales(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale, v_scale) -> tuple:
    """An fp8 cache's scales: given, else its views' ``kv_scale`` (set by KVCache): model code passes caches."""
    return (getattr(k_cache, "kv_scale", None) if k_scale is None else k_scale,
            getattr(v_cache, "kv_scale", None) if v_scale is None else v_scale)
