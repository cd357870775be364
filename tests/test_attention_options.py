"""What the paged attention ops take beyond head_dim 64/128/256 and whole-context causal
attention: every multiple of 16 up to 256 (Phi-2's 80, Phi-3-mini's 96), a sliding window (HF's
mask: a query at position p sees keys j with p - j < window) and Gemma-2's logit softcap
(scaled scores -> cap * tanh(score / cap) before the softmax), in both ops, against a
plain-PyTorch reference over random data (outputs poisoned with NaN first). The CPU op has all
three; the CUDA kernels have both options and head_dim 80 and 96 (and refuse other new head
dims)."""

from __future__ import annotations

import itertools
import re

import pytest
import torch

from conftest import DEVICES
from pagedkv import ops
from test_paged_decode_attention import _device_params
from pagedkv.layers.attention import ForwardMetadata, paged_attention
from test_paged_decode_attention import counter_floats, make_paged_cache
from test_paged_prefill_attention import make_batch, reference_paged_prefill as reference
from tolerance import assert_close_to_baseline

HEAD_DIMS = [80, 96, 16, 48, 112, 160, 240]
# (window, softcap): none, window only, softcap only, both; windows shorter than a block, a few
# blocks and longer than any context (= no window).
OPTIONS = [(0, 0.0), (5, 0.0), (100, 0.0), (0, 1.5), (37, 30.0), (10_000, 50.0)]
# On CUDA also a window of exactly one block (16) and one equal to a context (517).
CUDA_OPTIONS = OPTIONS + [(16, 0.0), (517, 5.0)]
HEADS = (8, 2)
CUDA_HEAD_DIMS = [64, 80, 96, 128, 256]  # what the CUDA kernels are compiled for
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def check_decode(q, k_cache, v_cache, table, lens, window, softcap, num_splits=0):
    scale = q.shape[-1] ** -0.5
    out = torch.full_like(q, float("nan"))
    workspace = ops.paged_decode_workspace(q, k_cache, table, num_splits)
    counters = workspace[:counter_floats(q)].view(torch.int32)
    workspace[counters.numel():].fill_(float("nan"))
    ops.paged_decode_attention(q, k_cache, v_cache, table, lens, scale, out=out,
                               workspace=workspace, num_splits=num_splits,
                               sliding_window=window, logit_softcap=softcap)
    if workspace.numel():
        assert (counters == 0).all(), "the split merge must leave its counters at zero"
    qsl = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    args = (q, k_cache, v_cache, table, lens, qsl, scale)
    assert_close_to_baseline(
        out,
        baseline=reference(*args, q.dtype, window, softcap),
        reference=reference(*args, torch.float64, window, softcap),
    )


def check_prefill(batch, window, softcap):
    q, qsl = batch["q"], batch["query_start_loc"]
    scale = q.shape[-1] ** -0.5
    max_query_len = int((qsl[1:] - qsl[:-1]).max())
    out = torch.full_like(q, float("nan"))
    args = [batch[k] for k in ("q", "k_cache", "v_cache", "block_tables", "context_lens", "query_start_loc")]
    ops.paged_prefill_attention(*args, scale, max_query_len, out=out, sliding_window=window,
                                logit_softcap=softcap)
    assert_close_to_baseline(
        out,
        baseline=reference(*args, scale, q.dtype, window, softcap),
        reference=reference(*args, scale, torch.float64, window, softcap),
    )


DIM_CPU = [(torch.bfloat16, d, 16) for d in HEAD_DIMS] + [(torch.float32, 80, 8), (torch.float16, 96, 8)]
DIM_CUDA = [(t, d, b) for t in DTYPES for d in (80, 96) for b in (8, 16, 128)]


@pytest.mark.parametrize("device, dtype, head_dim, block_size", _device_params(DIM_CUDA, DIM_CPU))
def test_head_dims_beyond_64_128_256(device, dtype, head_dim, block_size):
    torch.manual_seed(0)
    lens = [1, block_size + 1, 3 * block_size - 1, 517, 0]
    k_cache, v_cache, table, lens = make_paged_cache(lens, HEADS[1], head_dim, block_size, dtype, device)
    q = torch.randn(len(lens), HEADS[0], head_dim, dtype=dtype, device=device)
    check_decode(q, k_cache, v_cache, table, lens, 0, 0.0)
    seqs = [(70, 70), (25, 3 * block_size + 25), (1, 300), (1, 0)]
    check_prefill(make_batch(seqs, *HEADS, head_dim, block_size, dtype, device), 0, 0.0)


OPTION_CPU = [(torch.bfloat16, 128, o, HEADS) for o in OPTIONS] + [(torch.float32, 80, o, HEADS) for o in OPTIONS[1:]]
# Every dtype, CUDA head dim and option at GQA 4; GQA 1, 2, 8 (and 16: two decode CTAs per kv
# head) at one tensor-core and one padded CUDA-core head dim.
OPTION_CUDA = [(t, d, o, HEADS) for t in DTYPES for d in CUDA_HEAD_DIMS for o in CUDA_OPTIONS] + [
    (torch.bfloat16, d, o, h) for h in ((4, 4), (4, 2), (16, 2), (32, 2)) for d in (80, 128)
    for o in CUDA_OPTIONS[1:]]


@pytest.mark.parametrize("device, dtype, head_dim, options, heads", _device_params(OPTION_CUDA, OPTION_CPU))
def test_sliding_window_and_softcap(device, dtype, head_dim, options, heads):
    """Windows within a block, across blocks and splits, equal to and past a context; decode with
    automatic, one, 3 and 40 splits (a window's first key inside a split and on its edge)."""
    torch.manual_seed(1)
    window, softcap = options
    block_size = 16
    lens = [1, 4, block_size + 1, 3 * block_size - 1, 517, 0, 2000]
    k_cache, v_cache, table, lens = make_paged_cache(lens, heads[1], head_dim, block_size, dtype, device)
    q = 3 * torch.randn(len(lens), heads[0], head_dim, dtype=dtype, device=device)  # peaked scores
    for num_splits in (0, 1, 3, 40):
        check_decode(q, k_cache, v_cache, table, lens, window, softcap, num_splits)
    seqs = [(70, 70), (0, 32), (25, 3 * block_size + 25), (1, 300), (19, 2 * block_size + 24),
            (1, 0), (130, 700)]
    check_prefill(make_batch(seqs, *heads, head_dim, block_size, dtype, device), window, softcap)


PREFILL_SPLIT_CUDA = [(t, d, o) for t in (torch.bfloat16, torch.float16) for d in (64, 80, 96, 128)
                      for o in ((100, 0.0), (700, 0.0), (1500, 30.0), (0, 20.0))]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype, head_dim, options", PREFILL_SPLIT_CUDA)
def test_split_prefill_with_window_and_softcap(dtype, head_dim, options):
    """Few new tokens over long contexts, so the prefill launch splits each tile's keys (asserted):
    the splits before a window read nothing and the merge skips them."""
    torch.manual_seed(2)
    seqs = [(16, 3000), (1, 2500), (40, 1540), (1, 37), (0, 100), (3, 700), (1, 0)]
    batch = make_batch(seqs, *HEADS, head_dim, 16, dtype, "cuda")
    rest = (batch["q"], batch["k_cache"], batch["block_tables"], max(n for n, _ in seqs))
    assert ops.paged_prefill_num_splits(*rest) > 1
    check_prefill(batch, *options)


@pytest.mark.parametrize("device, dtype, head_dim", _device_params(
    [(torch.bfloat16, 128), (torch.float16, 80), (torch.float32, 96)], [(torch.float32, 80)]))
def test_blocks_before_the_window_are_never_read(device, dtype, head_dim):
    """A window layer's blocks before every row's window may be freed and reused: their table
    entries point at a block of NaN here, which any read (even a masked one: 0 x NaN) would
    carry into the output."""
    torch.manual_seed(4)
    window, block_size = 40, 16
    lens = [1, 30, 41, 517, 2000]
    k_cache, v_cache, table, lens_t = make_paged_cache(lens, HEADS[1], head_dim, block_size, dtype, device)
    nan_block = torch.full_like(k_cache[:1], float("nan"))
    k_nan, v_nan = torch.cat([k_cache, nan_block]), torch.cat([v_cache, nan_block])

    def poison(first_keys):  # the blocks wholly before each sequence's first key -> the NaN block
        poisoned = table.clone()
        for b, first in enumerate(first_keys):
            poisoned[b, : max(0, first) // block_size] = k_cache.shape[0]
        assert (poisoned != table).any()
        return poisoned

    poisoned = poison([n - window for n in lens])
    q = torch.randn(len(lens), HEADS[0], head_dim, dtype=dtype, device=device)
    scale = head_dim**-0.5
    qsl = torch.arange(len(lens) + 1, dtype=torch.int32, device=device)
    want = reference(q, k_cache, v_cache, table, lens_t, qsl, scale, torch.float64, window, 0.0)
    for num_splits in (0, 1, 7, 40):
        ws = ops.paged_decode_workspace(q, k_nan, poisoned, num_splits)
        out = ops.paged_decode_attention(q, k_nan, v_nan, poisoned, lens_t, scale, workspace=ws,
                                         num_splits=num_splits, sliding_window=window)
        assert not out.isnan().any(), f"num_splits {num_splits}: a block before the window was read"
        torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
    # Prefill: each sequence's last 20 tokens (split on CUDA 16-bit); the first row's window.
    q_lens = [min(20, n) for n in lens]
    poisoned = poison([n - q - window + 1 for n, q in zip(lens, q_lens)])
    qsl = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=device)
    q = torch.randn(sum(q_lens), HEADS[0], head_dim, dtype=dtype, device=device)
    want = reference(q, k_cache, v_cache, table, lens_t, qsl, scale, torch.float64, window, 0.0)
    out = ops.paged_prefill_attention(q, k_nan, v_nan, poisoned, lens_t, qsl, scale, max(q_lens),
                                      sliding_window=window)
    assert not out.isnan().any(), "prefill read a block before the first row's window"
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.cuda
def test_cuda_refuses_head_dims_it_lacks():
    """The CPU op takes every multiple of 16 up to 256; the CUDA kernels are compiled for 64, 80,
    96, 128 and 256: the others are refused, never run wrong."""
    _, _, table, lens = make_paged_cache([5], 2, 64, 8, torch.float16, "cuda")
    qsl = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
    for head_dim in (48, 112, 160):
        q, kc = torch.randn(1, 4, head_dim, device="cuda"), torch.randn(2, 8, 2, head_dim, device="cuda")
        message = f"head_dim {head_dim}; allowed on CUDA: 64, 80, 96, 128, 256"
        with pytest.raises(RuntimeError, match=message):
            ops.paged_decode_attention(q, kc, kc, table, lens, 0.1)
        with pytest.raises(RuntimeError, match=message):
            ops.paged_prefill_attention(q, kc, kc, table, lens, qsl, 0.1, 1)


@pytest.mark.parametrize("device", DEVICES)
def test_layer_passes_window_and_softcap(device):
    """layers.attention.paged_attention forwards both options to either kernel."""
    torch.manual_seed(3)
    k_cache, v_cache, table, lens = make_paged_cache([40, 9], 2, 80, 8, torch.float32, device)
    q = torch.randn(2, 4, 80, device=device)
    meta = ForwardMetadata(positions=lens - 1, slot_mapping=lens, block_tables=table, context_lens=lens)
    scale = 80**-0.5
    qsl = torch.arange(3, dtype=torch.int32, device=device)
    ws = ops.paged_decode_workspace(q, k_cache, table)
    got = paged_attention(q, k_cache, v_cache, meta, scale, ws, sliding_window=6, logit_softcap=2.0)
    want = reference(q, k_cache, v_cache, table, lens, qsl, scale, torch.float64, 6, 2.0)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    meta.query_start_loc, meta.max_query_len = qsl, 1
    got = paged_attention(q, k_cache, v_cache, meta, scale, None, sliding_window=6, logit_softcap=2.0)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_options_name_the_argument(device):
    k_cache, v_cache, table, lens = make_paged_cache([5], 2, 64, 8, torch.float32, device)
    q = torch.randn(1, 4, 64, device=device)
    qsl = torch.tensor([0, 1], dtype=torch.int32, device=device)
    bad = [(dict(sliding_window=-1), "sliding_window is -1; allowed: 0 (none) or a positive"),
           (dict(logit_softcap=-1.0), "logit_softcap is -1; allowed: 0 (none) or a positive"),
           (dict(logit_softcap=float("nan")), "logit_softcap is nan; allowed: 0 (none) or a positive")]
    for kwargs, message in bad:
        with pytest.raises(RuntimeError, match=re.escape(message)):
            ops.paged_decode_attention(q, k_cache, v_cache, table, lens, 0.1, **kwargs)
        with pytest.raises(RuntimeError, match=re.escape(message)):
            ops.paged_prefill_attention(q, k_cache, v_cache, table, lens, qsl, 0.1, 1, **kwargs)
    for head_dim in (72, 8, 272):
        q = torch.randn(1, 4, head_dim, device=device)
        kc = torch.randn(2, 8, 2, head_dim, device=device)
        with pytest.raises(RuntimeError, match=f"head_dim {head_dim}; allowed: a multiple of 16"):
            ops.paged_decode_attention(q, kc, kc, table, lens, 0.1)
