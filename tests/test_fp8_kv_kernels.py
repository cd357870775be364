"""The fp8 (e4m3) KV cache in the three ops against plain PyTorch.

rope_and_write_kv into an fp8 cache must store exactly torch's
``(x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)`` of what it stores into a cache of
q's dtype (saturating past +-448). paged_decode_attention and paged_prefill_attention over an fp8
cache must match the 16-bit references of test_paged_prefill_attention run on the dequantized
cache (``float(x) * scale``), within the same-dtype baseline tolerance: head_dim 64/128/256,
block sizes, GQA ratios, long contexts (past the 16-bit path's split sizes), window and softcap,
q in fp32/fp16/bf16. Bad scale arguments are refused, naming what is allowed.
"""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICES
from pagedkv import ops
from test_paged_decode_attention import _device_params, make_paged_cache
from test_paged_prefill_attention import make_batch, reference_paged_prefill as reference
from tolerance import assert_close_to_baseline

FP8 = torch.float8_e4m3fn
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """The cache's stored values: torch's saturating round to e4m3 of x / scale."""
    return (x.float() / scale).clamp(-448, 448).to(FP8)


def scales(k: float, v: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor([k], dtype=torch.float32, device=device),
            torch.tensor([v], dtype=torch.float32, device=device))


def fp8_caches(k_cache, v_cache, k_scale: float, v_scale: float):
    """(fp8 K, fp8 V, dequantized K, dequantized V in float64) of random 16-bit caches."""
    k8, v8 = quantize(k_cache, k_scale), quantize(v_cache, v_scale)
    return k8, v8, k8.double() * k_scale, v8.double() * v_scale


def check(q, k8, v8, k_deq, v_deq, table, lens, qsl, scale_pair, window=0, softcap=0.0, decode=False):
    device = q.device
    ks, vs = scales(*scale_pair, device)
    scale = q.shape[-1] ** -0.5
    out = torch.full_like(q, float("nan"))
    if decode:
        ops.paged_decode_attention(q, k8, v8, table, lens, scale, out=out, sliding_window=window,
                                   logit_softcap=softcap, k_scale=ks, v_scale=vs)
    else:
        max_query_len = int((qsl[1:] - qsl[:-1]).max())
        ops.paged_prefill_attention(q, k8, v8, table, lens, qsl, scale, max_query_len, out=out,
                                    sliding_window=window, logit_softcap=softcap, k_scale=ks, v_scale=vs)
    args = (q, k_deq, v_deq, table, lens, qsl, scale)
    assert_close_to_baseline(out, baseline=reference(*args, q.dtype, window, softcap),
                             reference=reference(*args, torch.float64, window, softcap))


# (q dtype, head_dim, (Hq, Hkv), block_size, (window, softcap))
BASE = (torch.bfloat16, 128, (8, 2), 16, (0, 0.0))
AXES = [DTYPES, [64, 128, 256], [(8, 2), (4, 4), (8, 1), (14, 2)], [8, 16, 128],
        [(0, 0.0), (37, 0.0), (0, 30.0), (100, 5.0)]]
CPU_CASES = [BASE] + [tuple(v if i == a else b for i, b in enumerate(BASE)) for a, values in
                      enumerate(AXES) for v in values if v != BASE[a]]
CUDA_CASES = CPU_CASES + [(t, d, h, bs, o) for t in DTYPES for d in (64, 128, 256) for h in ((8, 2), (32, 8))
                          for bs in (16,) for o in ((0, 0.0), (37, 30.0))]


@pytest.mark.parametrize("device, dtype, head_dim, heads, block_size, options",
                         _device_params(CUDA_CASES, CPU_CASES))
def test_decode_and_prefill_read_fp8_as_dequantized(device, dtype, head_dim, heads, block_size, options):
    torch.manual_seed(0)
    window, softcap = options
    k_scale, v_scale = 0.02, 0.0075  # values up to ~4 sigma land near e4m3's top (448)
    lens = [1, block_size, block_size + 1, 3 * block_size - 1, 517, 0, 2000]
    k_cache, v_cache, table, lens_t = make_paged_cache(lens, heads[1], head_dim, block_size, dtype, device)
    k8, v8, k_deq, v_deq = fp8_caches(k_cache * 2, v_cache, k_scale, v_scale)
    q = 3 * torch.randn(len(lens), heads[0], head_dim, dtype=dtype, device=device)
    qsl = torch.arange(len(lens) + 1, dtype=torch.int32, device=device)
    check(q, k8, v8, k_deq, v_deq, table, lens_t, qsl, (k_scale, v_scale), window, softcap, decode=True)
    seqs = [(70, 70), (0, 32), (25, 3 * block_size + 25), (1, 300), (19, 2 * block_size + 24),
            (1, 0), (130, 700)]
    batch = make_batch(seqs, *heads, head_dim, block_size, dtype, device)
    k8, v8, k_deq, v_deq = fp8_caches(batch["k_cache"], batch["v_cache"], k_scale, v_scale)
    check(batch["q"], k8, v8, k_deq, v_deq, batch["block_tables"], batch["context_lens"],
          batch["query_start_loc"], (k_scale, v_scale), window, softcap)


LONG_CPU = [[8200, 3000]]
LONG_CUDA = [[8200, 32768 + 5, 1], [65536, 100]]


@pytest.mark.parametrize("device, context_lens", _device_params(
    [(c,) for c in LONG_CUDA], [(c,) for c in LONG_CPU]))
def test_long_contexts(device, context_lens):
    """Contexts of thousands of keys (several splits on the 16-bit CUDA path): fp32 accumulation
    block by block keeps the error at the 16-bit baseline's."""
    torch.manual_seed(2)
    k_cache, v_cache, table, lens = make_paged_cache(context_lens, 2, 128, 16, torch.bfloat16, device)
    k8, v8, k_deq, v_deq = fp8_caches(k_cache, v_cache, 1.0, 1.0)
    q = torch.randn(len(context_lens), 8, 128, dtype=torch.bfloat16, device=device)
    qsl = torch.arange(len(context_lens) + 1, dtype=torch.int32, device=device)
    check(q, k8, v8, k_deq, v_deq, table, lens, qsl, (1.0, 1.0), decode=True)


@pytest.mark.parametrize("head_dim, rot_dim, norm", [(64, 64, False), (128, 128, True), (128, 64, False),
                                                     (256, 256, False)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_rope_writes_saturating_e4m3_of_x_over_scale(device, dtype, head_dim, rot_dim, norm):
    """Bit for bit: the fp8 cache holds quantize(what the 16-bit cache holds), padding slots
    write nothing, values past 448 * scale saturate to +-448."""
    torch.manual_seed(3)
    T, Hq, Hkv, block_size, num_blocks = 37, 8, 2, 16, 6
    q = torch.randn(T, Hq, head_dim, dtype=dtype, device=device)
    k = 4 * torch.randn(T, Hkv, head_dim, dtype=dtype, device=device)
    v = 2 * torch.randn(T, Hkv, head_dim, dtype=dtype, device=device)
    v[3, 0, :4] = torch.tensor([1e4, -1e4, 9.0, -9.0])  # past 448 * v_scale: saturate
    positions = torch.randint(0, 500, (T,), dtype=torch.int32, device=device)
    slots = torch.randperm(num_blocks * block_size, dtype=torch.int32)[:T].to(device)
    slots[5] = -1  # padding
    inv_freq = 1.0 / 10000 ** (torch.arange(0, rot_dim, 2).float() / rot_dim)
    freqs = torch.arange(512).float()[:, None] * inv_freq  # [512, rot_dim / 2]
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=1).to(device)
    w = (torch.rand(head_dim, dtype=dtype, device=device) + 0.5) if norm else None
    shape = (num_blocks, block_size, Hkv, head_dim)
    k16, v16 = torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)
    k8, v8 = torch.zeros(shape, dtype=FP8, device=device), torch.zeros(shape, dtype=FP8, device=device)
    q1, k1 = q.clone(), k.clone()
    ops.rope_and_write_kv(q1, k1, v, positions, cos_sin, k16, v16, slots, w, w)
    ks, vs = scales(0.03, 0.02, device)
    q2, k2 = q.clone(), k.clone()
    ops.rope_and_write_kv(q2, k2, v, positions, cos_sin, k8, v8, slots, w, w, k_scale=ks, v_scale=vs)
    assert torch.equal(q1, q2) and torch.equal(k1, k2)  # q and k rotated alike
    assert torch.equal(k8.view(torch.uint8), quantize(k16, 0.03).view(torch.uint8))
    assert torch.equal(v8.view(torch.uint8), quantize(v16, 0.02).view(torch.uint8))
    slot = int(slots[3])
    got = v8.view(-1, Hkv, head_dim)[slot, 0, :4].float().tolist()
    assert got == [448.0, -448.0, 448.0, -448.0]


@pytest.mark.parametrize("device", DEVICES)
def test_bad_scale_arguments_are_refused(device):
    k_cache, v_cache, table, lens = make_paged_cache([5], 2, 64, 16, torch.bfloat16, device)
    q = torch.randn(1, 4, 64, dtype=torch.bfloat16, device=device)
    k8, v8 = quantize(k_cache, 1.0), quantize(v_cache, 1.0)
    ks, vs = scales(1.0, 1.0, device)
    with pytest.raises(RuntimeError, match="pass k_scale and v_scale"):
        ops.paged_decode_attention(q, k8, v8, table, lens, 0.1)
    with pytest.raises(RuntimeError, match="float8_e4m3fn cache only"):
        ops.paged_decode_attention(q, k_cache, v_cache, table, lens, 0.1, k_scale=ks, v_scale=vs)
    with pytest.raises(RuntimeError, match="allowed: one torch.float32 element"):
        ops.paged_decode_attention(q, k8, v8, table, lens, 0.1, k_scale=ks.double(), v_scale=vs)
    with pytest.raises(RuntimeError, match="allowed: one torch.float32 element"):
        ops.paged_prefill_attention(q, k8, v8, table, lens, torch.tensor([0, 1], dtype=torch.int32, device=device),
                                    0.1, 1, k_scale=torch.ones(2, device=device), v_scale=vs)
    with pytest.raises(RuntimeError, match="v_cache has dtype"):
        ops.paged_decode_attention(q, k8, v_cache, table, lens, 0.1, k_scale=ks, v_scale=vs)
    e5m2 = k_cache.to(torch.float8_e5m2)
    with pytest.raises(RuntimeError, match="k_cache has dtype"):
        ops.paged_decode_attention(q, e5m2, e5m2, table, lens, 0.1)


@pytest.mark.parametrize("device", DEVICES)
def test_cache_views_carry_their_scales(device):
    """The ops read an fp8 KVCache's scales from its per-layer views when none are passed: a
    model's code passes caches only (models/llama.py)."""
    from pagedkv import KVCache

    cache = KVCache(2, 2, 64, dtype=FP8, num_blocks=4, device=device, kv_scales=[(0.5, 0.25), (2.0, 4.0)])
    assert cache.kv_scales.tolist() == [[0.5, 0.25], [2.0, 4.0]]
    assert float(cache.k_caches[1].kv_scale) == 2.0 and float(cache.v_caches[0].kv_scale) == 0.25
    cache.k_caches[1].copy_(torch.randn(cache.k_caches[1].shape).to(FP8))
    cache.v_caches[1].copy_(torch.randn(cache.v_caches[1].shape).to(FP8))
    table = torch.tensor([[2, 0]], dtype=torch.int32, device=device)
    lens = torch.tensor([20], dtype=torch.int32, device=device)
    q = torch.randn(1, 4, 64, device=device)
    got = ops.paged_decode_attention(q, cache.k_caches[1], cache.v_caches[1], table, lens, 0.125)
    ks, vs = scales(2.0, 4.0, device)
    want = ops.paged_decode_attention(q, cache.k_caches[1], cache.v_caches[1], table, lens, 0.125,
                                      k_scale=ks, v_scale=vs)
    assert torch.equal(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_long_context_retrieval_like_bf16(device):
    """A key planted early (position 7) in an 8k context, written through rope_and_write_kv (at
    the identity rotation), with the query's score on it just above the crowd's (about half the
    attention weight over 8k distractors): the fp8 cache retrieves its value like the bf16 one,
    by decode and by a prefill chunk at the end (the issue's long-context acceptance)."""
    torch.manual_seed(5)
    D, Hq, Hkv, n, planted, block_size = 128, 8, 2, 8192, 7, 16
    answers = torch.nn.functional.normalize(torch.randn(16, D), dim=-1) * D**0.5  # candidate values
    u = torch.nn.functional.normalize(torch.randn(Hkv, D), dim=-1)
    k = torch.randn(n, Hkv, D)
    v = torch.randn(n, Hkv, D)
    k[planted] = u * 3 * D**0.5
    v[planted] = answers[11]
    kw = dict(dtype=torch.bfloat16, device=device)
    k, v = k.to(**kw), v.to(**kw)
    q = (u.repeat_interleave(Hq // Hkv, 0) * 3.1).to(**kw)  # planted score 3 * 3.1 ~ ln(8192)
    cos_sin = torch.cat([torch.ones(1, D // 2), torch.zeros(1, D // 2)], dim=1).to(device)
    zeros = torch.zeros(n, dtype=torch.int32, device=device)
    slots = torch.arange(n, dtype=torch.int32, device=device)
    shape = (n // block_size, block_size, Hkv, D)
    table = torch.arange(n // block_size, dtype=torch.int32, device=device)[None]
    lens = torch.tensor([n], dtype=torch.int32, device=device)
    outs = {}
    for name, dtype, scale_args in [("bf16", torch.bfloat16, {}), ("fp8", FP8, dict(zip(("k_scale", "v_scale"), scales(0.02, 0.02, device))))]:
        k_cache, v_cache = torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)
        qs = torch.zeros(n, Hq, D, **kw)
        ops.rope_and_write_kv(qs, k.clone(), v, zeros, cos_sin, k_cache, v_cache, slots, None, None, **scale_args)
        decode = ops.paged_decode_attention(q[None], k_cache, v_cache, table, lens, D**-0.5, **scale_args)[0]
        chunk = q[None].repeat(4, 1, 1)  # the last 4 positions, causally
        qsl = torch.tensor([0, 4], dtype=torch.int32, device=device)
        prefill = ops.paged_prefill_attention(chunk, k_cache, v_cache, table, lens, qsl, D**-0.5, 4, **scale_args)
        outs[name] = torch.cat([decode[None], prefill]).float().cpu()  # [5, Hq, D]
    for name, out in outs.items():
        weight = (out @ answers[11]) / D  # the planted value's share of each output
        assert bool((weight > 0.3).all()), f"{name}: planted value's weight {weight.min():.3f}"
        assert bool(((out @ answers.T).argmax(-1) == 11).all()), f"{name} retrieves another value"
    # the planted value's weight moves with K's rounding (a score near the crowd's), by little
    share = {name: (out @ answers[11]) / D for name, out in outs.items()}
    assert (share["fp8"] - share["bf16"]).abs().max() < 0.1


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_one_key_reads_every_e4m3_value_exactly(device, dtype, head_dim):
    """A sequence of one key attends to it with weight 1, so the output is V as read: each of the
    254 finite e4m3 values (subnormals, +-0 and +-448 among them) must come out exactly, in q's
    dtype (all of them are exact there). The 16-bit CUDA path converts them with integer ops and a
    multiply by a power of two (kernels/fp8_convert.cuh); K goes through the same conversion."""
    torch.manual_seed(3)
    finite = [b for b in range(256) if b not in (0x7F, 0xFF)] + [0, 0x80]  # 256 bytes, no NaN
    values = torch.tensor(finite, dtype=torch.uint8).view(FP8).view(256 // head_dim, head_dim)
    num_kv_heads = values.shape[0]
    v8 = torch.zeros(2, 16, num_kv_heads, head_dim, dtype=FP8)
    v8[1, 0] = values
    k8 = (torch.randn(2, 16, num_kv_heads, head_dim) * 100).clamp(-448, 448).to(FP8)
    v8, k8 = v8.to(device), k8.to(device)
    table = torch.tensor([[1, 0]], dtype=torch.int32, device=device)
    lens = torch.tensor([1], dtype=torch.int32, device=device)
    q = torch.randn(1, 2 * num_kv_heads, head_dim, dtype=dtype, device=device)
    ks, vs = scales(0.02, 1.0, device)
    out = ops.paged_decode_attention(q, k8, v8, table, lens, head_dim ** -0.5, k_scale=ks, v_scale=vs)
    expected = values.float().repeat_interleave(2, dim=0).to(device=device, dtype=dtype)
    torch.testing.assert_close(out[0], expected, rtol=0, atol=0)
