"""What the paged attention ops take beyond head_dim 64/128/256 and whole-context causal
attention: every multiple of 16 up to 256 (Phi-2's 80, Phi-3-mini's 96), a sliding window (HF's
mask: a query at position p sees keys j with p - j < window) and Gemma-2's logit softcap
(scaled scores -> cap * tanh(score / cap) before the softmax), in both ops, against a
plain-PyTorch reference over random data (outputs poisoned with NaN first). The CPU op has all
three; the CUDA kernels not yet, and refuse them."""

from __future__ import annotations

import re

import pytest
import torch

from conftest import DEVICES
from pagedkv import ops
from pagedkv.layers.attention import ForwardMetadata, paged_attention
from test_paged_decode_attention import counter_floats, make_paged_cache
from test_paged_prefill_attention import make_batch, reference_paged_prefill as reference
from tolerance import assert_close_to_baseline

HEAD_DIMS = [80, 96, 16, 48, 112, 160, 240]
# (window, softcap): none, window only, softcap only, both; windows shorter than a block, a few
# blocks and longer than any context (= no window).
OPTIONS = [(0, 0.0), (5, 0.0), (100, 0.0), (0, 1.5), (37, 30.0), (10_000, 50.0)]
HEADS = (8, 2)


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


@pytest.mark.parametrize("device, dtype, head_dim, block_size", [("cpu", *c) for c in DIM_CPU])
def test_head_dims_beyond_64_128_256(device, dtype, head_dim, block_size):
    torch.manual_seed(0)
    lens = [1, block_size + 1, 3 * block_size - 1, 517, 0]
    k_cache, v_cache, table, lens = make_paged_cache(lens, HEADS[1], head_dim, block_size, dtype, device)
    q = torch.randn(len(lens), HEADS[0], head_dim, dtype=dtype, device=device)
    check_decode(q, k_cache, v_cache, table, lens, 0, 0.0)
    seqs = [(70, 70), (25, 3 * block_size + 25), (1, 300), (1, 0)]
    check_prefill(make_batch(seqs, *HEADS, head_dim, block_size, dtype, device), 0, 0.0)


OPTION_CPU = [(torch.bfloat16, 128, o) for o in OPTIONS] + [(torch.float32, 80, o) for o in OPTIONS[1:]]


@pytest.mark.parametrize("device, dtype, head_dim, options", [("cpu", *c) for c in OPTION_CPU])
def test_sliding_window_and_softcap(device, dtype, head_dim, options):
    torch.manual_seed(1)
    window, softcap = options
    block_size = 16
    lens = [1, 4, block_size + 1, 3 * block_size - 1, 517, 0, 2000]
    k_cache, v_cache, table, lens = make_paged_cache(lens, HEADS[1], head_dim, block_size, dtype, device)
    q = 3 * torch.randn(len(lens), HEADS[0], head_dim, dtype=dtype, device=device)  # peaked scores
    for num_splits in (0, 1, 3, 40):
        check_decode(q, k_cache, v_cache, table, lens, window, softcap, num_splits)
    seqs = [(70, 70), (0, 32), (25, 3 * block_size + 25), (1, 300), (19, 2 * block_size + 24),
            (1, 0), (130, 700)]
    check_prefill(make_batch(seqs, *HEADS, head_dim, block_size, dtype, device), window, softcap)


@pytest.mark.cuda
def test_cuda_refuses_what_its_kernels_lack():
    """The CUDA kernels do not have these yet (only the CPU op does): refused, never ignored."""
    k_cache, v_cache, table, lens = make_paged_cache([5], 2, 64, 8, torch.float16, "cuda")
    q = torch.randn(1, 4, 64, dtype=torch.float16, device="cuda")
    qsl = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
    for kwargs in (dict(sliding_window=4), dict(logit_softcap=30.0)):
        with pytest.raises(RuntimeError, match="allowed on CUDA: 0 and 0"):
            ops.paged_decode_attention(q, k_cache, v_cache, table, lens, 0.1, **kwargs)
        with pytest.raises(RuntimeError, match="allowed on CUDA: 0 and 0"):
            ops.paged_prefill_attention(q, k_cache, v_cache, table, lens, qsl, 0.1, 1, **kwargs)
    q, kc = torch.randn(1, 4, 80, device="cuda"), torch.randn(2, 8, 2, 80, device="cuda")
    with pytest.raises(RuntimeError, match="head_dim 80; allowed on CUDA: 64, 128, 256"):
        ops.paged_decode_attention(q, kc, kc, table, lens, 0.1)
    with pytest.raises(RuntimeError, match="head_dim 80; allowed on CUDA: 64, 128, 256"):
        ops.paged_prefill_attention(q, kc, kc, table, lens, qsl, 0.1, 1)


@pytest.mark.parametrize("device", ["cpu"])
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
