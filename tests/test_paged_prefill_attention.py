"""paged_prefill_attention against a plain-PyTorch reference that walks the block table.

Ragged batches mix fresh prompts (context == new tokens), prefix hits and later chunks of a
chunked prefill (context > new tokens, block-aligned or not), decode-like single tokens, rows
with no new tokens and a CUDA-graph padding row (context 0, one token: zeros). Random data,
outputs poisoned with NaN, physical blocks shuffled, table entries past each sequence's blocks
set to an index that would fault if read. The CPU runs a subset of the grid (one axis varied at
a time); the `cuda` variants run all of it.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICES
from pagedkv import ops
from test_paged_decode_attention import _device_params, head_major, shuffled_table
from tolerance import assert_close_to_baseline

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HEAD_DIMS = [64, 128, 256]
# (q heads, kv heads): MHA, GQA 4, GQA 7 (Qwen2.5), MQA 8, GQA 32 (two head chunks per kv head).
HEADS = [(4, 4), (8, 2), (14, 2), (8, 1), (64, 2)]
BLOCK_SIZES = [8, 16, 32, 128]
BASE = (torch.bfloat16, 128, (8, 2), 16)  # the CPU subset varies one axis of this at a time

CASES = list(itertools.product(DTYPES, HEAD_DIMS, HEADS, BLOCK_SIZES))
CPU_CASES = [c for c in CASES if sum(x != b for x, b in zip(c, BASE)) <= 1]


def sequences_for(block_size: int) -> list[tuple[int, int]]:
    """(new tokens, context) per sequence: a fresh prompt spanning several query tiles, no new
    tokens, a prefix hit ending on a block boundary, a decode-like token, a later chunk starting
    mid-block, an empty sequence, a decode token over a long context, a padding row."""
    bs = block_size
    return [(70, 70), (0, 2 * bs), (25, 3 * bs + 25), (1, bs + 1), (19, 2 * bs + 24), (0, 0),
            (1, 300), (1, 0)]


def make_batch(seqs, num_q_heads, num_kv_heads, head_dim, block_size, dtype, device):
    """Random q [T, Hq, D] and K/V caches, a shuffled block table, context_lens and
    query_start_loc for seqs = [(q_len, context_len), ...]."""
    q_lens = [n for n, _ in seqs]
    context_lens = [c for _, c in seqs]
    blocks = [math.ceil(n / block_size) for n in context_lens]
    num_blocks = sum(blocks) + 3
    table = shuffled_table(context_lens, block_size, num_blocks, max(blocks) + 2)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    qsl = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=device)
    return dict(
        q=torch.randn(sum(q_lens), num_q_heads, head_dim, dtype=dtype, device=device),
        k_cache=torch.randn(shape, dtype=dtype, device=device),
        v_cache=torch.randn(shape, dtype=dtype, device=device),
        block_tables=table.to(device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        query_start_loc=qsl,
    )


def reference_paged_prefill(q, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                            scale, dtype, window=0, softcap=0.0, sinks=None):
    """Walks each sequence's block table, gathers its K/V rows and runs causal softmax attention
    of its new rows (the last q_len of its context) in `dtype`, softmax in fp32 at least; a query
    at position p sees keys j <= p with p - j < window (0: all), scores capped when softcap > 0.
    sinks [Hq]: HF's GPT-OSS rule, each head's sink logit a last column of the softmax, dropped
    after it. Rows that see no key get zeros."""
    num_q_heads, head_dim = q.shape[1:]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    softmax_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    out = torch.zeros(q.shape, dtype=dtype, device=q.device)
    for b in range(len(context_lens)):
        start, end, n = int(query_start_loc[b]), int(query_start_loc[b + 1]), int(context_lens[b])
        q_len = end - start
        if q_len == 0 or n == 0:
            continue
        blocks = block_tables[b, : math.ceil(n / block_size)].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:n].to(dtype)  # [n, Hkv, D]
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:n].to(dtype)
        qb = q[start:end].to(dtype).view(q_len, num_kv_heads, group, head_dim)
        scores = torch.einsum("ikgd,nkd->kgin", qb, k) * scale  # [Hkv, group, q_len, n]
        if softcap > 0:  # Gemma-2's logit softcap
            scores = softcap * torch.tanh(scores / softcap)
        positions = n - q_len + torch.arange(q_len, device=q.device)
        keys = torch.arange(n, device=q.device)[None, :]
        visible = keys <= positions[:, None]  # [q_len, n]
        if window > 0:  # HF's sliding-window mask
            visible &= positions[:, None] - keys < window
        scores = scores.to(softmax_dtype).masked_fill(~visible, float("-inf"))
        if sinks is not None:
            sink = sinks.to(softmax_dtype).view(num_kv_heads, group, 1, 1).expand(-1, -1, q_len, 1)
            scores = torch.cat([scores, sink], dim=-1)
        p = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        if sinks is not None:
            p = p[..., :-1] * visible.any(-1)[:, None]  # a row that sees no key stays zeros
        p = p.to(dtype)  # no key visible: zeros
        out[start:end] = torch.einsum("kgin,nkd->ikgd", p, v).reshape(q_len, num_q_heads, head_dim)
    return out


def run_and_check(batch, max_query_len=None, out=None):
    q = batch["q"]
    scale = q.shape[-1] ** -0.5
    qsl = batch["query_start_loc"]
    if max_query_len is None:
        max_query_len = int((qsl[1:] - qsl[:-1]).max()) if len(qsl) > 1 else 0
    out = torch.full_like(q, float("nan")) if out is None else out.fill_(float("nan"))
    args = [batch[k] for k in ("q", "k_cache", "v_cache", "block_tables", "context_lens", "query_start_loc")]
    ops.paged_prefill_attention(*args, scale, max_query_len, out=out)
    assert_close_to_baseline(
        out,
        baseline=reference_paged_prefill(*args, scale, dtype=q.dtype),
        reference=reference_paged_prefill(*args, scale, dtype=torch.float64),
    )
    return out


@pytest.mark.parametrize("device, dtype, head_dim, heads, block_size", _device_params(CASES, CPU_CASES))
def test_paged_prefill_attention(device, dtype, head_dim, heads, block_size):
    batch = make_batch(sequences_for(block_size), *heads, head_dim, block_size, dtype, device)
    out = run_and_check(batch)
    padding_row = batch["query_start_loc"][-2]
    assert (out[padding_row] == 0).all()


LONG_CPU = [[(64, 1500), (40, 40)]]
LONG_CUDA = [[(1000, 1000), (300, 4000), (1, 8200)], [(2048, 2048 + 777)]]


@pytest.mark.parametrize("device, seqs", _device_params([(s,) for s in LONG_CUDA], [(s,) for s in LONG_CPU]))
def test_long_prompts_and_prefixes(device, seqs):
    run_and_check(make_batch(seqs, 8, 2, 128, 16, torch.bfloat16, device))


def tall_tile_tokens(num_q_heads: int, num_kv_heads: int, num_sms: int) -> tuple[int, int]:
    """(tokens of one 128-row query tile, tiles from which 128-row CTAs give every SM two) for
    the tensor-core kernel's rule (csrc/kernels/paged_prefill_attention.cu): a kv head's group is
    cut into chunks of <= 16 heads, a CTA's rows are (token, head) pairs of one chunk."""
    group = num_q_heads // num_kv_heads
    chunks = math.ceil(group / 16)
    tile_tokens = 128 // math.ceil(group / chunks)
    return tile_tokens, math.ceil(2 * num_sms / (num_kv_heads * chunks))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", [(32, 8), (64, 2)])
@pytest.mark.parametrize("grid", ["two CTAs per SM", "fewer"])
def test_both_cta_heights(dtype, head_dim, heads, grid):
    """16-bit inputs at head_dim <= 128 run 128-row CTAs where that grid gives every SM two of
    them, else 64-row ones. Batches sized from this GPU's SM count land on each side of the rule:
    a prefix hit ending mid-block (masked and unmasked key tiles) beside a fresh prompt."""
    tile_tokens, tiles = tall_tile_tokens(*heads, torch.cuda.get_device_properties(0).multi_processor_count)
    # Flat tiles of a batch: at most tokens / tile_tokens + batch (cta_work), so the short side
    # stays under `tiles` and the tall side passes it.
    tokens = (tiles + 2) * tile_tokens if grid == "two CTAs per SM" else (tiles - 3) * tile_tokens
    fresh = 3 * tile_tokens + 5
    seqs = [(tokens - fresh, tokens - fresh + 301), (fresh, fresh)]
    run_and_check(make_batch(seqs, *heads, head_dim, 16, dtype, "cuda"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fresh_prompts_equal_causal_sdpa(device, dtype):
    """context == new tokens: the op is SDPA with is_causal over each prompt (GQA expanded by
    SDPA itself), K/V written into shuffled cache blocks first."""
    num_q_heads, num_kv_heads, head_dim, block_size = 8, 2, 64, 16
    lens = [33, 1, 16, 50]
    batch = make_batch([(n, n) for n in lens], num_q_heads, num_kv_heads, head_dim, block_size, dtype, device)
    k_flat = batch["k_cache"].view(-1, num_kv_heads, head_dim)
    v_flat = batch["v_cache"].view(-1, num_kv_heads, head_dim)
    dense_k, dense_v = [], []
    for b, n in enumerate(lens):
        pos = torch.arange(n, device=device)
        slots = batch["block_tables"][b, pos // block_size].long() * block_size + pos % block_size
        k = torch.randn(n, num_kv_heads, head_dim, dtype=dtype, device=device)
        v = torch.randn(n, num_kv_heads, head_dim, dtype=dtype, device=device)
        k_flat[slots], v_flat[slots] = k, v
        dense_k.append(k)
        dense_v.append(v)

    out = torch.full_like(batch["q"], float("nan"))
    ops.paged_prefill_attention(*batch.values(), head_dim**-0.5, max(lens), out=out)

    def sdpa(dt):
        rows = []
        for b, n in enumerate(lens):
            start = int(batch["query_start_loc"][b])
            q, k, v = (x.to(dt).transpose(0, 1)[None] for x in (batch["q"][start : start + n], dense_k[b], dense_v[b]))
            rows.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)[0].transpose(0, 1))
        return torch.cat(rows)

    assert_close_to_baseline(out, baseline=sdpa(dtype), reference=sdpa(torch.float64))


@pytest.mark.parametrize("device", DEVICES)
def test_head_major_cache_storage(device):
    """Caches stored [num_blocks, Hkv, block_size, D], passed as their transpose(1, 2) view."""
    batch = make_batch([(30, 30), (5, 100), (1, 17)], 8, 2, 128, 16, torch.bfloat16, device)
    batch["k_cache"], batch["v_cache"] = head_major(batch["k_cache"]), head_major(batch["v_cache"])
    run_and_check(batch)


@pytest.mark.parametrize("device", DEVICES)
def test_strided_q_and_out_and_loose_max_query_len(device):
    """q as a view into a fused QKV projection output, out as a view into a wider buffer, and a
    max_query_len above the longest sequence (an upper bound is enough)."""
    num_q_heads, num_kv_heads, head_dim = 8, 2, 128
    seqs = [(30, 30), (5, 100), (1, 17)]
    batch = make_batch(seqs, num_q_heads, num_kv_heads, head_dim, 16, torch.bfloat16, device)
    tokens = batch["q"].shape[0]
    qkv = torch.randn(tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, dtype=torch.bfloat16, device=device)
    batch["q"] = qkv[:, : num_q_heads * head_dim].view(tokens, num_q_heads, head_dim)
    out = torch.empty(tokens, num_q_heads + 3, head_dim, dtype=torch.bfloat16, device=device)[:, 1 : 1 + num_q_heads]
    assert not batch["q"].is_contiguous() and not out.is_contiguous()
    run_and_check(batch, max_query_len=200, out=out)


@pytest.mark.cuda
def test_cuda_graph_capture_and_replay():
    """Captured once with static buffers and a fixed max_query_len; new queries, tables, lengths
    and query_start_loc (padding rows included) are copied in and the graph replayed."""
    device, dtype, block_size, max_blocks, batch_size, tokens = "cuda", torch.bfloat16, 16, 64, 4, 256
    shape = (batch_size * max_blocks, block_size, 2, 128)
    static = dict(
        q=torch.randn(tokens, 8, 128, dtype=dtype, device=device),
        k_cache=torch.randn(shape, dtype=dtype, device=device),
        v_cache=torch.randn(shape, dtype=dtype, device=device),
        block_tables=torch.zeros(batch_size, max_blocks, dtype=torch.int32, device=device),
        context_lens=torch.zeros(batch_size, dtype=torch.int32, device=device),
        query_start_loc=torch.zeros(batch_size + 1, dtype=torch.int32, device=device),
    )
    out = torch.empty_like(static["q"])
    scale, max_query_len = 128**-0.5, 200

    def step():
        ops.paged_prefill_attention(*static.values(), scale, max_query_len, out=out)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up outside the graph (every sequence empty)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    for seqs in ([(200, 200), (50, 600), (5, 5), (1, 1000)], [(1, 0), (1, 30), (120, 900), (0, 0)]):
        q_lens = [n for n, _ in seqs]
        context_lens = [c for _, c in seqs]
        static["q"].copy_(torch.randn_like(static["q"]))
        static["context_lens"].copy_(torch.tensor(context_lens, dtype=torch.int32))
        static["query_start_loc"].copy_(torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32))
        static["block_tables"].copy_(shuffled_table(context_lens, block_size, shape[0], max_blocks))
        out.fill_(float("nan"))
        graph.replay()
        used = sum(q_lens)
        args = list(static.values())
        assert_close_to_baseline(
            out[:used],
            baseline=reference_paged_prefill(*args, scale, dtype=dtype)[:used],
            reference=reference_paged_prefill(*args, scale, dtype=torch.float64)[:used],
        )


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    batch = make_batch([(9, 20), (0, 8), (4, 4)], 4, 2, 64, 8, torch.float32, device)
    out = torch.empty_like(batch["q"])
    torch.library.opcheck(
        torch.ops.pagedkv.paged_prefill_attention.default, (out, *batch.values(), 0.125, 9)
    )


def test_traces_under_torch_compile():
    batch = make_batch([(9, 20), (4, 4)], 4, 2, 64, 8, torch.float32, "cpu")
    rest = [batch[k] for k in ("k_cache", "v_cache", "block_tables", "context_lens", "query_start_loc")]

    @torch.compile(backend="aot_eager", fullgraph=True)
    def attend(q):
        return ops.paged_prefill_attention(q, *rest, 0.125, 9)

    torch.testing.assert_close(attend(batch["q"]), ops.paged_prefill_attention(batch["q"], *rest, 0.125, 9))


@pytest.mark.parametrize("device", DEVICES)
def test_bad_calls_name_the_argument(device):
    batch = make_batch([(5, 5), (3, 40)], 4, 2, 64, 8, torch.float16, device)
    q, k_cache, v_cache = batch["q"], batch["k_cache"], batch["v_cache"]
    table, lens, qsl = batch["block_tables"], batch["context_lens"], batch["query_start_loc"]

    def call(q=q, k=k_cache, v=v_cache, table=table, lens=lens, qsl=qsl, max_query_len=5):
        return ops.paged_prefill_attention(q, k, v, table, lens, qsl, 0.125, max_query_len)

    with pytest.raises(RuntimeError, match=r"k_cache has dtype Float but q has Half"):
        call(k=k_cache.float())
    with pytest.raises(RuntimeError, match=r"q has head_dim 40; allowed: a multiple of 16 from 16 to 256"):
        call(q=q[..., :40].contiguous(), k=k_cache[..., :40].contiguous(), v=v_cache[..., :40].contiguous())
    with pytest.raises(RuntimeError, match=r"q has 3 heads and k_cache 2 kv heads"):
        call(q=q[:, :3].contiguous())
    with pytest.raises(RuntimeError, match=r"block_size 12 \(dim 1\); allowed: a power of two from 8 to 128"):
        call(k=k_cache[:, :6].repeat(1, 2, 1, 1), v=v_cache[:, :6].repeat(1, 2, 1, 1))
    with pytest.raises(RuntimeError, match=r"query_start_loc has dtype Long; allowed: torch.int32"):
        call(qsl=qsl.long())
    with pytest.raises(RuntimeError, match=r"query_start_loc must have shape \[batch \+ 1\] = \[3\]"):
        call(qsl=qsl[:2])
    with pytest.raises(RuntimeError, match=r"context_lens must have shape \[batch\] = \[2\]"):
        call(lens=lens[:1])
    with pytest.raises(RuntimeError, match=r"max_query_len is -1; allowed: 0 to"):
        call(max_query_len=-1)
    with pytest.raises(RuntimeError, match=r"q and out must have a contiguous last"):
        call(q=q.transpose(1, 2).contiguous().transpose(1, 2))
    with pytest.raises(RuntimeError, match=r"v_cache has strides .* but k_cache has .*; they must match"):
        call(v=head_major(v_cache))


def test_cpu_rejects_bad_metadata():
    """On the CPU the metadata is checked for free (no device sync), so a bad one raises."""
    batch = make_batch([(5, 5), (3, 40)], 4, 2, 64, 8, torch.float32, "cpu")
    q, k_cache, v_cache = batch["q"], batch["k_cache"], batch["v_cache"]
    table, lens, qsl = batch["block_tables"], batch["context_lens"], batch["query_start_loc"]

    def call(table=table, lens=lens, qsl=qsl, max_query_len=5):
        return ops.paged_prefill_attention(q, k_cache, v_cache, table, lens, qsl, 0.1, max_query_len)

    with pytest.raises(RuntimeError, match=r"sequence 0 has 5 query tokens .*; allowed: 0 to max_query_len = 4"):
        call(max_query_len=4)
    with pytest.raises(RuntimeError, match=r"sequence 1 has -1 query tokens"):
        call(qsl=torch.tensor([0, 5, 4], dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"query_start_loc runs from 0 to 9; allowed: within q's 0 to 8 rows"):
        call(qsl=torch.tensor([0, 5, 9], dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"context_lens\[1\] is 1000; allowed: 0 to"):
        call(lens=torch.tensor([5, 1000], dtype=torch.int32))
    num_blocks = k_cache.shape[0]
    table[1, 2] = num_blocks
    message = rf"block_tables\[1, 2\] is {num_blocks}; allowed: 0 to num_blocks - 1 = {num_blocks - 1}"
    with pytest.raises(RuntimeError, match=message):
        call()


@pytest.mark.cuda
def test_cuda_rejects_device_mix():
    batch = make_batch([(5, 5), (3, 40)], 4, 2, 64, 8, torch.float16, "cuda")
    batch["query_start_loc"] = batch["query_start_loc"].cpu()
    with pytest.raises(RuntimeError, match=r"query_start_loc is on cpu but q is on cuda:0"):
        ops.paged_prefill_attention(*batch.values(), 0.1, 5)


@pytest.mark.parametrize("device", DEVICES)
def test_many_sequences_and_rows_outside_every_sequence(device):
    """Twenty sequences of random mixed lengths (the CUDA grid follows the batch's tokens, each
    CTA finds its sequence by binary search); q rows before query_start_loc[0] and after the last
    sequence are left as they were."""
    gen = torch.Generator().manual_seed(1)
    seqs = []
    for _ in range(20):
        q_len = [0, 1, 1, 3, 17, 40, 65][int(torch.randint(7, (1,), generator=gen))]
        seqs.append((q_len, q_len + int(torch.randint(0, 90, (1,), generator=gen))))
    dtype = torch.float16 if device == "cuda" else torch.float32  # CPU fp16 matmuls are slow
    batch = make_batch(seqs, 8, 2, 64, 16, dtype, device)
    lead, trail = 5, 7
    q = batch["q"]
    batch["q"] = torch.cat([q.new_zeros(lead, *q.shape[1:]), q, q.new_zeros(trail, *q.shape[1:])])
    batch["query_start_loc"] += lead
    out = torch.full_like(batch["q"], float("nan"))
    args = list(batch.values())
    ops.paged_prefill_attention(*args, 0.125, max(n for n, _ in seqs), out=out)
    assert out[:lead].isnan().all() and out[-trail:].isnan().all()
    assert_close_to_baseline(
        out[lead:-trail],
        baseline=reference_paged_prefill(*args, 0.125, dtype=dtype)[lead:-trail],
        reference=reference_paged_prefill(*args, 0.125, dtype=torch.float64)[lead:-trail],
    )


# --- key splits (CUDA, bf16/fp16, head_dim <= 128) --------------------------------------------

H100_SMS = 132


def test_split_rule():
    """Splits come from shapes only: two CTAs an SM in one wave, >= 512 keys a split; none when
    the 128-row grid already fills the GPU, for fp32 or head_dim 256. On an H100's 132 SMs."""
    splits = torch.ops.pagedkv.paged_prefill_num_splits
    bf16 = torch.bfloat16
    # (T, B, max_query_len, Hq, Hkv, D, dtype, max_tokens) -> splits
    assert splits(512, 1, 512, 32, 8, 128, bf16, 8192, H100_SMS) == 2  # 128 CTAs of 128 rows
    assert splits(128, 1, 128, 32, 8, 128, bf16, 8192, H100_SMS) == 7  # 40 CTAs counted, 32 work
    assert splits(128, 1, 128, 32, 8, 128, bf16, 2048, H100_SMS) == 4  # keys bound it
    assert splits(2048, 1, 2048, 32, 8, 128, bf16, 2048, H100_SMS) == 1  # 512 CTAs
    assert splits(128, 1, 128, 32, 8, 128, torch.float32, 8192, H100_SMS) == 1
    assert splits(128, 1, 128, 32, 8, 256, bf16, 8192, H100_SMS) == 1
    assert splits(128, 1, 128, 32, 8, 128, bf16, 1023, H100_SMS) == 1  # < 2 x 512 keys
    floats = torch.ops.pagedkv.paged_prefill_workspace_floats
    assert floats(512, 32, 128, 2) == 2 * 512 * 32 * 130 and floats(512, 32, 128, 1) == 0


SPLIT_CASES = list(itertools.product([torch.float16, torch.bfloat16], [64, 128],
                                     [(8, 2), (32, 8), (14, 2), (64, 2)], [16, 128]))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype, head_dim, heads, block_size", SPLIT_CASES)
def test_split_keys(dtype, head_dim, heads, block_size):
    """Few new tokens over long contexts, so the launch splits each tile's keys (asserted): a
    short turn after a long conversation, a chunk starting mid-block, decode-like tokens, a
    sequence shorter than one split, no new tokens, a padding row."""
    seqs = [(16, 3000), (1, 2500), (40, 1540), (1, 37), (0, 100), (3, 700), (1, 0)]
    batch = make_batch(seqs, *heads, head_dim, block_size, dtype, "cuda")
    rest = (batch["q"], batch["k_cache"], batch["block_tables"], max(n for n, _ in seqs))
    assert ops.paged_prefill_num_splits(*rest) > 1
    run_and_check(batch)


@pytest.mark.cuda
def test_split_workspace_is_checked_and_reused():
    """A missing or short workspace is refused with what to allocate; one workspace serves
    several calls (the layers of a forward) and a CUDA graph's replays."""
    seqs = [(16, 3000), (1, 1200)]
    batch = make_batch(seqs, 32, 8, 128, 16, torch.bfloat16, "cuda")
    args = [batch[k] for k in ("q", "k_cache", "v_cache", "block_tables", "context_lens", "query_start_loc")]
    workspace = ops.paged_prefill_workspace(batch["q"], batch["k_cache"], batch["block_tables"], 16)
    assert workspace is not None
    out = torch.empty_like(batch["q"])
    with pytest.raises(RuntimeError, match=r"needs a workspace of \d+ floats, got none; allocate it "
                                           r"with pagedkv.ops.paged_prefill_workspace"):
        torch.ops.pagedkv.paged_prefill_attention(out, *args, 0.125, 16)
    with pytest.raises(RuntimeError, match=r"needs a workspace of \d+ floats, got 7"):
        torch.ops.pagedkv.paged_prefill_attention(out, *args, 0.125, 16, workspace[:7])
    with pytest.raises(RuntimeError, match=r"workspace has dtype Half; allowed: torch.float32"):
        torch.ops.pagedkv.paged_prefill_attention(out, *args, 0.125, 16, workspace.half())

    scale = 128**-0.5
    want = reference_paged_prefill(*args, scale, dtype=torch.float64)
    baseline = reference_paged_prefill(*args, scale, dtype=torch.bfloat16)
    for _ in range(2):
        out.fill_(float("nan"))
        ops.paged_prefill_attention(*args, scale, 16, out=out, workspace=workspace)
        assert_close_to_baseline(out, baseline=baseline, reference=want)

    graph = torch.cuda.CUDAGraph()
    ops.paged_prefill_attention(*args, scale, 16, out=out, workspace=workspace)  # warm-up
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        ops.paged_prefill_attention(*args, scale, 16, out=out, workspace=workspace)
    batch["q"].copy_(torch.randn_like(batch["q"]))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert_close_to_baseline(out, baseline=reference_paged_prefill(*args, scale, dtype=torch.bfloat16),
                             reference=reference_paged_prefill(*args, scale, dtype=torch.float64))


@pytest.mark.parametrize("device", DEVICES)
def test_workspace_of_the_wrong_kind_is_refused(device):
    """The CPU needs no workspace, but a passed one is checked as on CUDA."""
    batch = make_batch([(5, 5), (3, 40)], 4, 2, 64, 8, torch.float16, device)
    args = list(batch.values())
    with pytest.raises(RuntimeError, match=r"workspace has dtype Half; allowed: torch.float32"):
        ops.paged_prefill_attention(*args, 0.125, 5, workspace=torch.zeros(8, dtype=torch.half, device=device))
