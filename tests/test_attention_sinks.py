"""Attention sinks (GPT-OSS) in both paged attention ops: each query head's sink logit joins its
row's softmax as one more column with a zero value row (HF's eager_attention_forward for
gpt_oss), against a plain-PyTorch reference over random data (outputs poisoned with NaN first):
sinks from far below to far above the scores, with and without a sliding window, decode with
automatic, one and several splits, prefill with and without key splits, an fp8 cache. Bad sinks
are refused naming the argument."""

from __future__ import annotations

import pytest
import torch

from pagedkv import ops
from test_fp8_kv_kernels import fp8_caches, scales
from test_paged_decode_attention import _device_params, counter_floats, make_paged_cache
from test_paged_prefill_attention import make_batch, reference_paged_prefill as reference
from tolerance import assert_close_to_baseline

HEADS = (8, 2)
# Sink logits around the scores' range (scaled scores of these random q are within ~+-10) and far
# past it on both sides (a sink of 40 takes nearly all the weight; one of -40 none).
SINK_SETS = {"moderate": lambda n: torch.linspace(-3.0, 5.0, n), "large": lambda n: torch.full((n,), 40.0),
             "negligible": lambda n: torch.full((n,), -40.0), "mixed": lambda n: torch.tensor([-40.0, 0.5, 9.0, 40.0]).repeat(n // 4)}


def sinks_for(name, num_q_heads, device):
    return SINK_SETS[name](num_q_heads).float().to(device)


def check_decode(q, k_cache, v_cache, table, lens, sinks, window=0, num_splits=0, fp8=None):
    scale = q.shape[-1] ** -0.5
    out = torch.full_like(q, float("nan"))
    workspace = ops.paged_decode_workspace(q, k_cache, table, num_splits)
    workspace[counter_floats(q):].fill_(float("nan"))
    extra = {} if fp8 is None else dict(k_scale=fp8[0], v_scale=fp8[1])
    ops.paged_decode_attention(q, k_cache, v_cache, table, lens, scale, out=out, workspace=workspace,
                               num_splits=num_splits, sliding_window=window, sinks=sinks, **extra)
    return out


def expected(q, k, v, table, lens, qsl, scale, window, sinks):
    baseline = reference(q, k, v, table, lens, qsl, scale, q.dtype, window, 0.0, sinks)
    return baseline, reference(q, k, v, table, lens, qsl, scale, torch.float64, window, 0.0, sinks)


# (dtype, head_dim, sink set) of both ops; each adds a head size of its own below.
CPU_GRID = [(torch.float32, 64, s) for s in SINK_SETS]
CUDA_GRID = [(t, d, s) for t in (torch.bfloat16, torch.float16) for d in (64, 128) for s in SINK_SETS] + [
    (torch.float32, 64, "mixed"), (torch.bfloat16, 256, "mixed")]
DECODE_PARAMS = _device_params(CUDA_GRID + [(torch.bfloat16, 80, "moderate")], CPU_GRID + [(torch.bfloat16, 128, "mixed")])
PREFILL_PARAMS = _device_params(CUDA_GRID + [(torch.bfloat16, 96, "moderate")], CPU_GRID + [(torch.bfloat16, 96, "mixed")])


@pytest.mark.parametrize("device, dtype, head_dim, sink_set", DECODE_PARAMS)
@pytest.mark.parametrize("window", [0, 37])
def test_decode_with_sinks(device, dtype, head_dim, sink_set, window):
    torch.manual_seed(0)
    lens = [1, 17, 47, 517, 0, 2000]
    k_cache, v_cache, table, lens = make_paged_cache(lens, HEADS[1], head_dim, 16, dtype, device)
    q = 3 * torch.randn(len(lens), HEADS[0], head_dim, dtype=dtype, device=device)
    sinks = sinks_for(sink_set, HEADS[0], device)
    qsl = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=device)
    baseline, exact = expected(q, k_cache, v_cache, table, lens, qsl, q.shape[-1] ** -0.5, window, sinks)
    for num_splits in (0, 1, 3, 40):  # one CTA with the whole softmax, and split merges
        out = check_decode(q, k_cache, v_cache, table, lens, sinks, window, num_splits)
        assert_close_to_baseline(out, baseline=baseline, reference=exact)
    assert out[4].eq(0).all()  # a padding row (context 0) stays zeros


@pytest.mark.parametrize("device, dtype, head_dim, sink_set", PREFILL_PARAMS)
@pytest.mark.parametrize("window", [0, 100])
def test_prefill_with_sinks(device, dtype, head_dim, sink_set, window):
    """Chunks of many rows (one CTA's whole keys) and, on CUDA, few rows over long contexts
    (the launch splits the keys: asserted), a padding row of context 0."""
    torch.manual_seed(1)
    sinks = sinks_for(sink_set, HEADS[0], device)
    for seqs, split in (([(70, 70), (25, 73), (1, 300), (1, 0), (130, 700)], False),
                        ([(16, 3000), (1, 2500), (40, 1540), (1, 37), (0, 100)], True)):
        batch = make_batch(seqs, *HEADS, head_dim, 16, dtype, device)
        args = [batch[k] for k in ("q", "k_cache", "v_cache", "block_tables", "context_lens", "query_start_loc")]
        q = args[0]
        max_query_len = max(n for n, _ in seqs)
        if split and device == "cuda" and dtype != torch.float32 and head_dim <= 128:
            # The launch splits keys of 16-bit caches up to head_dim 128 (prefill_can_split).
            assert ops.paged_prefill_num_splits(q, args[1], args[3], max_query_len) > 1
        scale = q.shape[-1] ** -0.5
        out = torch.full_like(q, float("nan"))
        ops.paged_prefill_attention(*args, scale, max_query_len, out=out, sliding_window=window, sinks=sinks)
        baseline, exact = expected(*args, scale, window, sinks)
        assert_close_to_baseline(out, baseline=baseline, reference=exact)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_fp8_cache_with_sinks(device):
    """The fp8 cache's kernel (decode and prefill rows) folds the sink in as the 16-bit ones."""
    torch.manual_seed(2)
    dtype, head_dim = torch.bfloat16, 64
    k_cache, v_cache, table, lens = make_paged_cache([5, 33, 300, 0], HEADS[1], head_dim, 16, dtype, device)
    k8, v8, k_deq, v_deq = fp8_caches(k_cache, v_cache, 0.05, 0.04)
    ks, vs = scales(0.05, 0.04, device)
    q = 3 * torch.randn(len(lens), HEADS[0], head_dim, dtype=dtype, device=device)
    sinks = sinks_for("mixed", HEADS[0], device)
    qsl = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=device)
    scale = head_dim ** -0.5
    out = check_decode(q, k8, v8, table, lens, sinks, fp8=(ks, vs))
    exact = reference(q, k_deq, v_deq, table, lens, qsl, scale, torch.float64, 0, 0.0, sinks)
    baseline = reference(q, k_deq.to(dtype), v_deq.to(dtype), table, lens, qsl, scale, dtype, 0, 0.0, sinks)
    assert_close_to_baseline(out, baseline=baseline, reference=exact)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_bad_sinks_name_the_argument(device):
    k_cache, v_cache, table, lens = make_paged_cache([5], HEADS[1], 64, 16, torch.float32, device)
    q = torch.randn(1, HEADS[0], 64, device=device)
    for bad in (torch.zeros(HEADS[0], dtype=torch.float64, device=device), torch.zeros(HEADS[0] + 1, device=device),
                torch.zeros(HEADS[0], 2, device=device)[:, 0], torch.zeros(1, HEADS[0], device=device)):
        with pytest.raises(RuntimeError, match="sinks has dtype .* allowed: a contiguous torch.float32"):
            ops.paged_decode_attention(q, k_cache, v_cache, table, lens, 0.125, sinks=bad)
