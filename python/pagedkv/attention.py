"""Attention of new tokens over context already in the paged cache (prefill chunks, prefix-cache
hits, mixed prefill + decode steps): ``paged_prefill_attention``, with the signature of the op
``ops.paged_prefill_attention``.

TEMPORARY: until that op lands, this module holds a plain-PyTorch reference path (gather each
sequence's context through its block table, then SDPA with the causal offset). It is correct on
any device but slow (a host sync and a Python loop over sequences). When merging the op, replace
the body of ``paged_prefill_attention`` below with the call to ``ops.paged_prefill_attention``
(the model calls only this function) and keep ``paged_prefill_attention_reference`` for tests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedkv import ops


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, context_lens: torch.Tensor,
                            query_start_loc: torch.Tensor, scale: float, max_query_len: int,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, Hq, D] new tokens of B sequences, row b's at [query_start_loc[b], [b + 1]);
    k_cache, v_cache: [num_blocks, block_size, Hkv, D]; block_tables: [B, max_blocks] int32;
    context_lens: [B] int32, new tokens included (their K/V are in the cache already);
    query_start_loc: [B + 1] int32. Query i of row b sits at position
    context_lens[b] - q_len_b + i and attends causally to the cache up to it. Returns out [T, Hq, D].
    Rows past the real batch (context length 0) are skipped (their output is left as is)."""
    # TODO(paged_prefill_attention op): return ops.paged_prefill_attention(...same arguments...)
    return paged_prefill_attention_reference(q, k_cache, v_cache, block_tables, context_lens,
                                             query_start_loc, scale, max_query_len, out)


def paged_prefill_attention_reference(q, k_cache, v_cache, block_tables, context_lens,
                                      query_start_loc, scale, max_query_len, out=None):
    """The plain-PyTorch reference of paged_prefill_attention (same arguments). Rows of query
    length 1 (decode rows of a mixed step) go, all at once, through ops.paged_decode_attention;
    longer rows one by one through a gather of their context and SDPA."""
    if out is None:
        out = torch.empty_like(q)
    block_size = k_cache.shape[1]
    starts = query_start_loc.tolist()
    lens = context_lens.tolist()
    single = [b for b, ctx in enumerate(lens) if ctx > 0 and starts[b + 1] - starts[b] == 1]
    if single:
        rows = torch.tensor(single, dtype=torch.int64, device=q.device)
        tokens = torch.tensor([starts[b] for b in single], dtype=torch.int64, device=q.device)
        out[tokens] = ops.paged_decode_attention(q[tokens], k_cache, v_cache, block_tables[rows],
                                                 context_lens[rows], scale)
    for b, ctx in enumerate(lens):
        q_len = starts[b + 1] - starts[b]
        if ctx == 0 or q_len <= 1:
            continue
        blocks = block_tables[b, :(ctx + block_size - 1) // block_size].long()
        k = k_cache[blocks].flatten(0, 1)[:ctx]  # [ctx, Hkv, D]
        v = v_cache[blocks].flatten(0, 1)[:ctx]
        qs = q[starts[b]:starts[b + 1]]  # [q_len, Hq, D]
        # Query i (position ctx - q_len + i) sees keys j <= ctx - q_len + i.
        rows = torch.arange(q_len, device=q.device).unsqueeze(1) + (ctx - q_len)
        mask = torch.arange(ctx, device=q.device).unsqueeze(0) <= rows  # [q_len, ctx]
        o = F.scaled_dot_product_attention(qs.transpose(0, 1).unsqueeze(0),
                                           k.transpose(0, 1).unsqueeze(0),
                                           v.transpose(0, 1).unsqueeze(0),
                                           attn_mask=mask, scale=scale, enable_gqa=True)
        out[starts[b]:starts[b + 1]] = o[0].transpose(0, 1)
    return out
