"""Attention over the paged KV cache, as a model layer calls it: which kernel one step's metadata
asks for, and the split workspace both kernels share across a forward's layers.

Two kinds of step, both reading K/V through block tables (nothing gathered, nothing concatenated):
- decode (`query_start_loc` None): one new token per row, attending to its row's whole context
  (ops.paged_decode_attention; long contexts split over thread blocks);
- mixed (`query_start_loc` given): row b's new tokens are [qsl[b], qsl[b + 1]) and each attends
  causally to its row's cache up to itself: prompts, prefill chunks after cached context,
  prefix-cache hits and decode rows of one token, in one flat batch (ops.paged_prefill_attention).

An fp8 cache (torch.float8_e4m3fn, pagedkv.KVCache(dtype=...), cache/kv_dtype.py): the three ops
take k_scale, v_scale (one-element fp32 tensors on the device; default: the cache views'
``kv_scale``, which KVCache sets, so model code passes caches only). ops.rope_and_write_kv stores
``(x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)``; both attention ops read
``float(x) * scale`` and accumulate in fp32 as for a 16-bit cache (online softmax over the keys).
On CUDA fp8 runs a simple CUDA-core kernel (kernels/paged_decode_attention_fp8.cu: one warp per
query row and head, no splits): correct first, fast later; the 16-bit kernels are unchanged.
The ops' fake (meta) implementations for torch.compile sit beside them in pagedkv/ops/.
"""

from __future__ import annotations

import dataclasses

import torch

from pagedkv import ops


@dataclasses.dataclass(slots=True)
class ForwardMetadata:
    """Where one forward's T new tokens go and what they attend to; B rows (sequences)."""

    positions: torch.Tensor  # [T] int32: position of each new token in its sequence
    slot_mapping: torch.Tensor  # [T] int32: cache slot of each new token's K/V, -1 = padding
    block_tables: torch.Tensor  # [B, max_blocks] int32
    context_lens: torch.Tensor  # [B] int32: tokens each row attends to, its new ones included
    query_start_loc: torch.Tensor | None = None  # [B + 1] int32 (mixed steps)
    max_query_len: int = 1  # host bound of one row's new tokens (mixed steps)
    # [T] int64: each token's S for a length-dependent rope (layers/rotary.py RopeByLength);
    # None: its position + 1 (a decode token of a sequence run alone)
    rope_lens: torch.Tensor | None = None
    # [B] int32 (decode steps of several waves of CTAs on CUDA): rows by descending context, set
    # by attention_workspace once a forward, so the longest rows' CTAs launch first
    row_order: torch.Tensor | None = None


def attention_workspace(q: torch.Tensor, k_cache: torch.Tensor,
                        meta: ForwardMetadata) -> torch.Tensor | None:
    """The split workspace of this step's kernel (None when it does not split), made once per
    forward and shared by its layers: q [T, Hq, Dh], k_cache [num_blocks, block_size, Hkv, Dh]."""
    if meta.query_start_loc is not None:
        return ops.paged_prefill_workspace(q, k_cache, meta.block_tables, meta.max_query_len)
    meta.row_order = None
    if q.is_cuda and meta.context_lens.shape[0] * k_cache.shape[2] > 4 * ops._num_sms(q.device):
        meta.row_order = torch.argsort(meta.context_lens, descending=True).to(torch.int32)
    return ops.paged_decode_workspace(q, k_cache, meta.block_tables)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: ForwardMetadata, scale: float,
                    workspace: torch.Tensor | None, *, sliding_window: int = 0,
                    logit_softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, Hq, Dh] (K/V of the new tokens already written) -> [T, Hq, Dh]. sliding_window > 0:
    a token at position p sees keys j with p - j < sliding_window (HF's window mask);
    logit_softcap > 0: scaled scores become cap * tanh(score / cap) (Gemma-2); 0 = off.
    sinks: [Hq] float32 attention sinks (GPT-OSS) or None."""
    if meta.query_start_loc is not None:
        return ops.paged_prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                           meta.query_start_loc, scale, meta.max_query_len,
                                           workspace=workspace, sliding_window=sliding_window,
                                           logit_softcap=logit_softcap, sinks=sinks)
    return ops.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                      scale, workspace=workspace, sliding_window=sliding_window,
                                      logit_softcap=logit_softcap, sinks=sinks, row_order=meta.row_order)
