"""The plain-PyTorch paged_prefill_attention (pagedkv.attention, the engine's path until the op
lands) against causal SDPA over dense K/V: new tokens after cached context, GQA, shuffled blocks,
decode rows (query length 1) and padding rows in one batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedkv.attention import paged_prefill_attention

BLOCK_SIZES = [8, 16]


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_matches_dense_causal_attention(block_size):
    hq, hkv, d = 4, 2, 64
    contexts, queries = [37, 5, 16, 1, 0], [10, 1, 16, 1, 1]  # last row: padding
    num_blocks = sum(-(-c // block_size) for c in contexts) + 3
    k_cache = torch.randn(num_blocks, block_size, hkv, d)
    v_cache = torch.randn(num_blocks, block_size, hkv, d)
    perm = torch.randperm(num_blocks).tolist()
    max_blocks = 8
    tables = torch.zeros(len(contexts), max_blocks, dtype=torch.int32)
    for b, c in enumerate(contexts):
        n = -(-c // block_size)
        tables[b, :n] = torch.tensor([perm.pop() for _ in range(n)], dtype=torch.int32)
    qsl = torch.tensor([0] + queries, dtype=torch.int32).cumsum(0).to(torch.int32)
    q = torch.randn(int(qsl[-1]), hq, d)
    out = torch.full_like(q, float("nan"))
    scale = d ** -0.5
    paged_prefill_attention(q, k_cache, v_cache, tables, torch.tensor(contexts, dtype=torch.int32),
                            qsl, scale, max(queries), out=out)
    for b, (c, n) in enumerate(zip(contexts, queries)):
        if c == 0:
            continue
        blocks = tables[b, :-(-c // block_size)].long()
        k = k_cache[blocks].flatten(0, 1)[:c].transpose(0, 1)  # [Hkv, c, D]
        v = v_cache[blocks].flatten(0, 1)[:c].transpose(0, 1)
        k, v = (t.repeat_interleave(hq // hkv, 0) for t in (k, v))
        qs = q[qsl[b]:qsl[b + 1]].transpose(0, 1)  # [Hq, n, D]
        mask = torch.ones(n, c, dtype=torch.bool).tril(c - n)
        ref = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale)
        torch.testing.assert_close(out[qsl[b]:qsl[b + 1]].transpose(0, 1), ref)
