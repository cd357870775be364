"""paged_decode_attention against a plain-PyTorch reference that walks the block table.

Random data everywhere, outputs (and the split workspace) poisoned with NaN before the op runs,
physical blocks shuffled, table entries past each sequence's blocks set to an index that would
fault if read. The CPU runs a representative subset of the grid (one axis varied at a time); the
`cuda` variants run all of it.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from conftest import DEVICES
from pagedkv import ops
from tolerance import assert_close_to_baseline

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HEAD_DIMS = [64, 128, 256]
# (q heads, kv heads): MHA, GQA 4, GQA 7 (Qwen2.5), MQA 8, GQA 16 (two CTAs per kv head).
HEADS = [(4, 4), (8, 2), (14, 2), (8, 1), (32, 2)]
BLOCK_SIZES = [8, 16, 32, 128]
BASE = (torch.bfloat16, 128, (8, 2), 16)  # the CPU subset varies one axis of this at a time
NEVER_READ = 2**30  # table entries past a sequence's blocks: out of range, so a read would fault


def _case_id(value) -> str:
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, tuple):
        return f"q{value[0]}kv{value[1]}"
    if isinstance(value, list):
        return "ctx" + "_".join(map(str, value))
    return str(value)


def _device_params(cases, cpu_cases):
    """pytest params over DEVICES: cpu_cases on the CPU, cases (marked cuda) on the GPU."""
    params = []
    for device in DEVICES:
        name = device if isinstance(device, str) else device.values[0]
        marks = () if isinstance(device, str) else device.marks
        for case in cpu_cases if name == "cpu" else cases:
            case_id = "-".join(_case_id(v) for v in (name, *case))
            params.append(pytest.param(name, *case, marks=marks, id=case_id))
    return params


CASES = list(itertools.product(DTYPES, HEAD_DIMS, HEADS, BLOCK_SIZES))
CPU_CASES = [c for c in CASES if sum(x != b for x, b in zip(c, BASE)) <= 1]


def context_lens_for(block_size: int) -> list[int]:
    """Ragged: 1 token, exactly a block, a block + 1, a few blocks less one, a few hundred."""
    return [1, block_size, block_size + 1, 3 * block_size - 1, 517]


def shuffled_table(context_lens, block_size, num_blocks, max_blocks):
    """[B, max_blocks] int32: each sequence's blocks drawn at random from the pool, the entries
    past them set to NEVER_READ."""
    blocks = [math.ceil(n / block_size) for n in context_lens]
    physical = torch.randperm(num_blocks, dtype=torch.int32)[: sum(blocks)]
    table = torch.full((len(context_lens), max_blocks), NEVER_READ, dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks):
        table[b, :n] = physical[used : used + n]
        used += n
    return table


def make_paged_cache(context_lens, num_kv_heads, head_dim, block_size, dtype, device, extra_cols=2):
    """Random K/V caches [num_blocks, block_size, Hkv, D] (spare blocks included), a shuffled
    block table with extra_cols unused columns, and the context lengths."""
    blocks = [math.ceil(n / block_size) for n in context_lens]
    num_blocks = sum(blocks) + 3
    table = shuffled_table(context_lens, block_size, num_blocks, max(blocks, default=0) + extra_cols)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    return k_cache, v_cache, table.to(device), lens


def head_major(cache: torch.Tensor) -> torch.Tensor:
    """The same values [num_blocks, block_size, Hkv, D], stored head-major: a view of a
    [num_blocks, Hkv, block_size, D] tensor (each kv head's block rows contiguous)."""
    return cache.transpose(1, 2).contiguous().transpose(1, 2)


def reference_paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale, dtype):
    """Walks each sequence's block table, gathers its K/V rows and runs softmax attention in
    `dtype` (softmax in fp32 at least, as HF's eager attention). Padding rows give zeros."""
    batch, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    softmax_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    out = torch.zeros(batch, num_q_heads, head_dim, dtype=dtype, device=q.device)
    for b in range(batch):
        n = int(context_lens[b])
        if n == 0:
            continue
        blocks = block_tables[b, : math.ceil(n / block_size)].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:n].to(dtype)  # [n, Hkv, D]
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:n].to(dtype)
        qb = q[b].to(dtype).view(num_kv_heads, group, head_dim)
        scores = torch.einsum("kgd,nkd->kgn", qb, k) * scale
        p = torch.softmax(scores.to(softmax_dtype), dim=-1).to(dtype)
        out[b] = torch.einsum("kgn,nkd->kgd", p, v).reshape(num_q_heads, head_dim)
    return out


def counter_floats(q: torch.Tensor) -> int:
    """The split workspace opens with B * Hq int32 merge counters, padded to 4."""
    return -(-q.shape[0] * q.shape[1] // 4) * 4


def run_and_check(q, k_cache, v_cache, table, lens, num_splits=0, out=None):
    scale = q.shape[-1] ** -0.5
    out = torch.full_like(q, float("nan")) if out is None else out.fill_(float("nan"))
    workspace = ops.paged_decode_workspace(q, k_cache, table, num_splits)
    counters = workspace[:counter_floats(q)].view(torch.int32)  # must start (and end) at zero
    workspace[counters.numel():].fill_(float("nan"))
    ops.paged_decode_attention(q, k_cache, v_cache, table, lens, scale, out=out,
                               workspace=workspace, num_splits=num_splits)
    if workspace.numel():
        assert (counters == 0).all(), "the split merge must leave its counters at zero"
    args = (q, k_cache, v_cache, table, lens, scale)
    assert_close_to_baseline(
        out,
        baseline=reference_paged_decode(*args, dtype=q.dtype),
        reference=reference_paged_decode(*args, dtype=torch.float64),
    )
    return out


@pytest.mark.parametrize("device, dtype, head_dim, heads, block_size", _device_params(CASES, CPU_CASES))
def test_paged_decode_attention(device, dtype, head_dim, heads, block_size):
    num_q_heads, num_kv_heads = heads
    lens = context_lens_for(block_size)
    k_cache, v_cache, table, lens = make_paged_cache(lens, num_kv_heads, head_dim, block_size, dtype, device)
    q = torch.randn(len(lens), num_q_heads, head_dim, dtype=dtype, device=device)
    run_and_check(q, k_cache, v_cache, table, lens)


LONG_CPU = [(torch.bfloat16, [8200, 3000])]
LONG_CUDA = [(dtype, [8200, 32768 + 5, 1]) for dtype in DTYPES] + [(torch.bfloat16, [131072, 100])]


@pytest.mark.parametrize("device, dtype, context_lens", _device_params(LONG_CUDA, LONG_CPU))
def test_long_context(device, dtype, context_lens):
    k_cache, v_cache, table, lens = make_paged_cache(context_lens, 2, 128, 16, dtype, device)
    q = torch.randn(len(context_lens), 8, 128, dtype=dtype, device=device)
    run_and_check(q, k_cache, v_cache, table, lens)


@pytest.mark.parametrize("device", DEVICES)
def test_padding_rows_write_zeros(device):
    """context_len 0 marks a padding row of a CUDA-graph bucket: zeros out, nothing read (its
    whole table row holds the never-read index)."""
    k_cache, v_cache, table, lens = make_paged_cache([0, 40, 0, 1], 2, 64, 16, torch.float16, device)
    q = torch.randn(4, 8, 64, dtype=torch.float16, device=device)
    out = run_and_check(q, k_cache, v_cache, table, lens)
    assert (out[0] == 0).all() and (out[2] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_strided_q_and_out(device):
    """q as a view into a fused QKV projection output, out as a view into a wider buffer."""
    num_q_heads, num_kv_heads, head_dim = 8, 2, 128
    k_cache, v_cache, table, lens = make_paged_cache([33, 100], num_kv_heads, head_dim, 16, torch.bfloat16, device)
    qkv = torch.randn(2, (num_q_heads + 2 * num_kv_heads) * head_dim, dtype=torch.bfloat16, device=device)
    q = qkv[:, : num_q_heads * head_dim].view(2, num_q_heads, head_dim)
    out = torch.empty(2, num_q_heads + 3, head_dim, dtype=torch.bfloat16, device=device)[:, 1 : 1 + num_q_heads]
    assert not q.is_contiguous() and not out.is_contiguous()
    run_and_check(q, k_cache, v_cache, table, lens, out=out)


@pytest.mark.parametrize("num_splits", [0, 1])
@pytest.mark.parametrize("heads", [(32, 8), (28, 4), (8, 2)])
@pytest.mark.parametrize("device", DEVICES)
def test_rising_and_peaked_scores(device, heads, num_splits):
    """Scores spread wide (q scaled by 4) and rising along each context (every K row scaled by
    1 + 3 * position / context): the running softmax max moves in most iterations, far past any
    slack a kernel may allow it before rescaling, and the attention is peaked on a few tokens."""
    num_q_heads, num_kv_heads = heads
    block_size, context_lens = 16, [1000, 37, 4100]
    k_cache, v_cache, table, lens = make_paged_cache(context_lens, num_kv_heads, 128, block_size,
                                                     torch.bfloat16, device)
    for b, n in enumerate(context_lens):
        ramp = 1 + 3 * torch.arange(n, device=device) / n  # [n]
        ramp = torch.nn.functional.pad(ramp, (0, -n % block_size)).view(-1, block_size, 1, 1)
        blocks = table[b, : ramp.shape[0]].long()  # each sequence's blocks are its own
        k_cache[blocks] = (k_cache[blocks].float() * ramp).to(k_cache.dtype)
    q = 4 * torch.randn(len(context_lens), num_q_heads, 128, dtype=torch.bfloat16, device=device)
    run_and_check(q, k_cache, v_cache, table, lens, num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [0, 1, 5])
@pytest.mark.parametrize("device", DEVICES)
def test_head_major_cache_storage(device, num_splits):
    """Caches stored [num_blocks, Hkv, block_size, D] and passed as their transpose(1, 2) view:
    the op reads through the strides, split or not."""
    k_cache, v_cache, table, lens = make_paged_cache([1, 16, 17, 700], 2, 128, 16, torch.bfloat16, device)
    k_cache, v_cache = head_major(k_cache), head_major(v_cache)
    assert not k_cache.is_contiguous()
    q = torch.randn(4, 8, 128, dtype=torch.bfloat16, device=device)
    run_and_check(q, k_cache, v_cache, table, lens, num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [0, 1, 5])
@pytest.mark.parametrize("device", DEVICES)
def test_dense_tensors_read_as_a_cache(device, num_splits):
    """Dense [B, Hkv, S, D] K/V (SDPA's layout) viewed, without a copy, as a cache of 16-row
    blocks (block stride 16 * D, token stride D, head stride S * D; sequence b's blocks
    b * Hkv * max_blocks + i), as bench_attention.py times it: the op reads through those strides."""
    batch, kv_heads, max_blocks, block = 3, 2, 6, 16
    context = max_blocks * block
    k, v = (torch.randn(batch, kv_heads, context, 128, dtype=torch.bfloat16, device=device) for _ in range(2))
    num_blocks = (batch - 1) * kv_heads * max_blocks + max_blocks  # the last block ends the storage
    k_cache, v_cache = (t.as_strided((num_blocks, block, kv_heads, 128), (block * 128, 128, context * 128, 1))
                        for t in (k, v))
    table = (torch.arange(batch)[:, None] * (kv_heads * max_blocks) + torch.arange(max_blocks)).to(torch.int32)
    lens = torch.tensor([1, 17, context], dtype=torch.int32, device=device)
    q = torch.randn(batch, 8, 128, dtype=torch.bfloat16, device=device)
    run_and_check(q, k_cache, v_cache, table.to(device), lens, num_splits=num_splits)


@pytest.mark.cuda
@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 16, 64, 1000])
def test_split_and_no_split_paths_agree(num_splits):
    """Forced split counts (beyond the blocks of the longest sequence included) match the
    reference and the single-pass result."""
    k_cache, v_cache, table, lens = make_paged_cache([1, 16, 17, 700, 2500], 2, 128, 16, torch.bfloat16, "cuda")
    q = torch.randn(5, 8, 128, dtype=torch.bfloat16, device="cuda")
    single = run_and_check(q, k_cache, v_cache, table, lens, num_splits=1)
    split = run_and_check(q, k_cache, v_cache, table, lens, num_splits=num_splits)
    torch.testing.assert_close(split, single, atol=2e-2, rtol=2e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cta_width_on_either_side_of_one_cta_per_sm(dtype, head_dim):
    """A grid of at most one CTA per SM runs 8-warp CTAs on the tensor-core loop (64 KB of rings
    at head_dim 128, 128 KB at 256: past the 48 KB default) unsplit or in splits of >= 512 tokens (merged across CTAs), one CTA
    more runs 4-warp CTAs: all match the reference, eagerly and replayed from a CUDA graph."""
    num_kv_heads = 4
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    per_split = sms // (4 * num_kv_heads)  # batch that fills one CTA per SM at 4 splits
    for batch, num_splits in ((sms // num_kv_heads, 1), (sms // num_kv_heads + 1, 1),
                              (per_split, 4), (per_split + 1, 4)):
        gen = torch.Generator().manual_seed(batch)
        longest = 600 if num_splits == 1 else 2600  # 4 splits of 672 tokens (>= 512: 8 warps)
        lens = torch.randint(1, longest, (batch,), generator=gen).tolist()
        lens[:4] = [1, 16, 17, longest][:batch]  # one token, a block, a block + 1, the longest
        k_cache, v_cache, table, lens = make_paged_cache(
            lens, num_kv_heads, head_dim, 16, dtype, "cuda")
        q = torch.randn(batch, 4 * num_kv_heads, head_dim, dtype=dtype, device="cuda")
        eager = run_and_check(q, k_cache, v_cache, table, lens, num_splits=num_splits)
        workspace = ops.paged_decode_workspace(q, k_cache, table, num_splits)
        out = torch.full_like(q, float("nan"))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            ops.paged_decode_attention(q, k_cache, v_cache, table, lens, head_dim**-0.5, out=out,
                                       workspace=workspace, num_splits=num_splits)
        graph.replay()
        torch.testing.assert_close(out, eager, atol=0, rtol=0)


@pytest.mark.cuda
def test_cuda_graph_capture_and_replay():
    """Captured once with static buffers; new queries, tables and lengths (a padding row
    included) are copied in and the graph replayed, as a decode step would."""
    device, dtype, block_size, max_blocks = "cuda", torch.bfloat16, 16, 256
    shape = (4 * max_blocks, block_size, 8, 128)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    q = torch.randn(4, 32, 128, dtype=dtype, device=device)
    table = torch.zeros(4, max_blocks, dtype=torch.int32, device=device)
    lens = torch.zeros(4, dtype=torch.int32, device=device)
    out = torch.empty_like(q)
    workspace = ops.paged_decode_workspace(q, k_cache, table)
    assert workspace.numel() > 0, "expected the split path for 4 sequences x 8 kv heads"
    scale = 128**-0.5

    def step():
        ops.paged_decode_attention(q, k_cache, v_cache, table, lens, scale, out=out, workspace=workspace)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up outside the graph (all rows padding)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    for new_lens in ([300, 4000, 20, 9], [3000, 1, 0, 4096], [16, 17, 4095, 0]):
        q.copy_(torch.randn_like(q))
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        table.copy_(shuffled_table(new_lens, block_size, shape[0], max_blocks))
        out.fill_(float("nan"))
        graph.replay()
        args = (q, k_cache, v_cache, table, lens, scale)
        assert_close_to_baseline(
            out,
            baseline=reference_paged_decode(*args, dtype=dtype),
            reference=reference_paged_decode(*args, dtype=torch.float64),
        )


# (batch, q heads, kv heads, max_blocks) -> splits on a 132-SM H100, block 16, bf16 and head_dim
# 128 (the tensor-core loop): W3's points and W1's decode (28 q / 4 kv heads, 16-block tables).
# Each is what a sweep of num_splits on the H100 measured fastest or within 1% of it
# (lab/measurements.md, sessions 9-11; a grid of at most 132 CTAs runs 8-warp CTAs, unsplit or
# in splits of >= 512 tokens: 16x4096 at 1 split, 1x8192 and 1x32768 at 16).
SWEPT_SPLITS = {
    (1, 32, 8, 64): 16, (1, 32, 8, 512): 16, (1, 32, 8, 2048): 16, (4, 32, 8, 512): 4,
    (16, 32, 8, 256): 1, (64, 32, 8, 128): 1, (256, 32, 8, 64): 1,
    (1, 28, 4, 16): 16, (8, 28, 4, 16): 4, (32, 28, 4, 16): 1,
}
# The same for the CUDA-core loop (fp32, head_dim 256), from its sweep at W3's points (bf16,
# head_dim 128, before the tensor-core loop; lab/measurements.md, 2026-11-24 session 7).
SWEPT_SPLITS_CUDA_CORES = {
    (1, 32, 8, 64): 16, (1, 32, 8, 512): 32, (1, 32, 8, 2048): 48, (4, 32, 8, 512): 12,
    (16, 32, 8, 256): 3, (64, 32, 8, 128): 3, (256, 32, 8, 64): 1,
}


def test_split_heuristic_from_shapes_only():
    """Whole blocks per split, every split holding some of the longest context; the swept
    shapes get their measured best on each main loop; the unsplit grid of many waves stays
    unsplit."""
    num_sms, block_size = 132, 16
    num_splits = torch.ops.pagedkv.paged_decode_num_splits
    for swept, head_dim, dtype in ((SWEPT_SPLITS, 128, torch.bfloat16),
                                   (SWEPT_SPLITS_CUDA_CORES, 128, torch.float32)):
        for (batch, q_heads, kv_heads, max_blocks), expected in swept.items():
            splits = num_splits(batch, q_heads, kv_heads, block_size, max_blocks, num_sms,
                                head_dim, dtype)
            assert splits == expected, (batch, q_heads, kv_heads, max_blocks, dtype, splits)
            assert math.ceil(max_blocks / math.ceil(max_blocks / splits)) == splits
    # fp32 at head_dim 256 runs the CUDA-core loop; 16-bit dtypes at 64 and 256 the tensor-core
    # one, fp16 planned as bf16 (16x4096's 128 CTAs fill one per SM: unsplit, as 8-warp CTAs).
    assert num_splits(16, 32, 8, 16, 256, num_sms, 256, torch.float32) == 3
    assert num_splits(16, 32, 8, 16, 256, num_sms, 256, torch.float16) == 1
    assert num_splits(16, 32, 8, 16, 256, num_sms, 64, torch.float16) == 1
    # head_dim 256 on tensor cores: 2 CTAs per SM, and splits counted in bytes (Gemma-2-9B at
    # batch 1, 16 q / 8 kv heads, 4130 tokens: 16 splits of 272 tokens, one 8-warp CTA per SM).
    assert num_splits(1, 16, 8, 16, 259, num_sms, 256, torch.bfloat16) == 16
    for batch in (1, 3, 16, 100, 1000):
        for max_blocks in (2, 7, 64, 1000):
            for dtype in (torch.bfloat16, torch.float32):
                splits = num_splits(batch, 32, 8, block_size, max_blocks, num_sms, 128, dtype)
                assert 1 <= splits <= max_blocks
                assert math.ceil(max_blocks / math.ceil(max_blocks / splits)) == splits
    assert num_splits(1, 32, 8, 16, 1, num_sms, 128, torch.bfloat16) == 1
    assert num_splits(2000, 32, 8, 16, 4096, num_sms, 128, torch.bfloat16) == 1


def test_workspace_is_empty_on_cpu_and_sized_for_forced_splits():
    q = torch.randn(3, 8, 64)
    k_cache, _, table, _ = make_paged_cache([10, 20, 30], 2, 64, 8, torch.float32, "cpu")
    assert ops.paged_decode_workspace(q, k_cache, table).numel() == 0
    workspace = ops.paged_decode_workspace(q, k_cache, table, num_splits=4)
    assert workspace.numel() == 24 + 3 * 8 * 4 * (64 + 2)  # counters, then partials and stats
    assert (workspace == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    k_cache, v_cache, table, lens = make_paged_cache([5, 40], 2, 64, 8, torch.float32, device)
    q = torch.randn(2, 4, 64, device=device)
    for num_splits in (0, 3) if device == "cuda" else (0,):  # the CPU ignores num_splits
        workspace = ops.paged_decode_workspace(q, k_cache, table, num_splits)
        torch.library.opcheck(
            torch.ops.pagedkv.paged_decode_attention.default,
            (torch.empty_like(q), q, k_cache, v_cache, table, lens, 0.125, workspace, num_splits),
        )


def test_traces_under_torch_compile():
    k_cache, v_cache, table, lens = make_paged_cache([5, 40], 2, 64, 8, torch.float32, "cpu")
    q = torch.randn(2, 4, 64)
    workspace = ops.paged_decode_workspace(q, k_cache, table)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def attend(q):
        return ops.paged_decode_attention(q, k_cache, v_cache, table, lens, 0.125, workspace=workspace)

    torch.testing.assert_close(attend(q), ops.paged_decode_attention(q, k_cache, v_cache, table, lens, 0.125))


@pytest.mark.parametrize("device", DEVICES)
def test_bad_calls_name_the_argument(device):
    k_cache, v_cache, table, lens = make_paged_cache([5, 40], 2, 64, 8, torch.float16, device)
    q = torch.randn(2, 4, 64, dtype=torch.float16, device=device)

    def call(q=q, k=k_cache, v=v_cache, table=table, lens=lens, **kw):
        return ops.paged_decode_attention(q, k, v, table, lens, 0.125, **kw)

    with pytest.raises(RuntimeError, match=r"k_cache has dtype Float but q has Half"):
        call(k=k_cache.float())
    with pytest.raises(RuntimeError, match=r"q has head_dim 40; allowed: a multiple of 16 from 16 to 256"):
        call(q=q[..., :40].contiguous(), k=k_cache[..., :40].contiguous(), v=v_cache[..., :40].contiguous())
    with pytest.raises(RuntimeError, match=r"k_cache has head_dim 128 but q has 64"):
        call(k=torch.cat([k_cache, k_cache], -1), v=torch.cat([v_cache, v_cache], -1))
    with pytest.raises(RuntimeError, match=r"block_size 12 \(dim 1\); allowed: a power of two from 8 to 128"):
        call(k=k_cache[:, :6].repeat(1, 2, 1, 1), v=v_cache[:, :6].repeat(1, 2, 1, 1))
    with pytest.raises(RuntimeError, match=r"q has 3 heads and k_cache 2 kv heads"):
        call(q=q[:, :3].contiguous())
    with pytest.raises(RuntimeError, match=r"v_cache has shape .* but k_cache has shape"):
        call(v=v_cache[:-1].contiguous())
    with pytest.raises(RuntimeError, match=r"block_tables has dtype Long; allowed: torch.int32"):
        call(table=table.long())
    with pytest.raises(RuntimeError, match=r"context_lens must have shape \[batch\] = \[2\]"):
        call(lens=lens[:1])
    with pytest.raises(RuntimeError, match=r"k_cache must have a contiguous last \(head_dim\) dimension"):
        call(k=k_cache.transpose(2, 3).contiguous().transpose(2, 3))
    with pytest.raises(RuntimeError, match=r"v_cache has strides .* but k_cache has .*; they must match"):
        call(v=head_major(v_cache))
    with pytest.raises(RuntimeError, match=r"workspace has dtype Half; allowed: torch.float32"):
        call(workspace=torch.empty(4, dtype=torch.float16, device=device))


def test_cpu_rejects_out_of_range_tables_and_lengths():
    """On the CPU the table is checked for free (no device sync), so a bad one raises."""
    k_cache, v_cache, table, lens = make_paged_cache([5, 40], 2, 64, 8, torch.float32, "cpu")
    q = torch.randn(2, 4, 64)
    with pytest.raises(RuntimeError, match=r"context_lens\[1\] is 1000; allowed: 0 to"):
        ops.paged_decode_attention(q, k_cache, v_cache, table, torch.tensor([5, 1000], dtype=torch.int32), 0.1)
    num_blocks = k_cache.shape[0]
    table[1, 2] = num_blocks
    message = rf"block_tables\[1, 2\] is {num_blocks}; allowed: 0 to num_blocks - 1 = {num_blocks - 1}"
    with pytest.raises(RuntimeError, match=message):
        ops.paged_decode_attention(q, k_cache, v_cache, table, lens, 0.1)


@pytest.mark.cuda
def test_cuda_rejects_small_workspace_and_device_mix():
    k_cache, v_cache, table, lens = make_paged_cache([5, 400], 2, 64, 8, torch.float16, "cuda")
    q = torch.randn(2, 4, 64, dtype=torch.float16, device="cuda")
    with pytest.raises(RuntimeError, match=r"workspace has 0 floats but 4 splits need"):
        ops.paged_decode_attention(q, k_cache, v_cache, table, lens, 0.1,
                                   workspace=torch.empty(0, device="cuda"), num_splits=4)
    with pytest.raises(RuntimeError, match=r"block_tables is on cpu but q is on cuda:0"):
        ops.paged_decode_attention(q, k_cache, v_cache, table.cpu(), lens, 0.1)
