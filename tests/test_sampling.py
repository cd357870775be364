"""sample: greedy rows are exactly torch.argmax; sampled rows stay in HF's top-k/top-p support,
follow softmax(logits / T) renormalized over it, and depend only on (seed, offset)."""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICES
from pagedkv import ops

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
VOCAB_SIZES = [1, 7, 1000, 151936]  # 151936: Qwen2/Qwen3's vocabulary
OUT_DTYPES = [torch.int64, torch.int32]


def row_params(batch, device, temperature=1.0, top_k=0, top_p=1.0, seed=1234, offsets=None):
    """Per-row parameter tensors as the runner keeps them: [batch] each, on the logits' device."""
    full = lambda value, dtype: torch.full((batch,), value, dtype=dtype, device=device)  # noqa: E731
    return dict(
        temperatures=full(temperature, torch.float32),
        top_k=full(top_k, torch.int32),
        top_p=full(top_p, torch.float32),
        seeds=full(seed, torch.int64),
        offsets=torch.arange(batch, device=device) if offsets is None else offsets,
    )


def support(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """HF's TopK then TopP warpers on softmax(logits / T), with the tokens tied at a boundary
    kept: top-k keeps logits >= the k-th largest; top-p keeps a token when the probability of
    the tokens strictly above it is < top_p (1e-6 of slack for rounding at the boundary)."""
    logits = logits.double()
    keep = torch.ones_like(logits, dtype=torch.bool)
    if 0 < top_k < logits.numel():
        keep &= logits >= logits.topk(top_k).values[-1]
    if top_p < 1.0:
        probs = torch.softmax(torch.where(keep, logits / temperature, float("-inf")), -1)
        values, order = logits.sort(descending=True)
        before = probs[order].cumsum(0) - probs[order]  # mass ahead in sorted order
        first = torch.ones_like(values, dtype=torch.bool)
        first[1:] = values[1:] != values[:-1]
        above = torch.empty_like(before)
        above[order] = before[first][first.cumsum(0) - 1]  # ties: the mass above the whole group
        keep &= above < top_p + 1e-6
    return keep


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", VOCAB_SIZES)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_greedy_is_argmax(device, dtype, vocab, out_dtype):
    prefill = torch.randn(5, 2, vocab, dtype=dtype, device=device) * 4
    prefill[3:, -1] = torch.randint(-3, 3, (2, vocab), device=device).to(dtype)  # ties: lowest index wins
    logits = prefill[:, -1, :]  # a strided view: the last position of each prefill's logits
    logits[0, vocab // 2] = float("-inf")
    out = torch.full((logits.shape[0],), -1, dtype=out_dtype, device=device)
    ops.sample(logits, out=out)
    assert torch.equal(out, logits.argmax(-1).to(out_dtype))


def reference_unsampled(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """What a row gets without a draw: greedy rows (T <= 0) torch.argmax (NaN is the largest);
    sampled rows whose max is not finite (a NaN, +inf, or all -inf) -1, since softmax has no
    distribution there (HF's multinomial raises); other sampled rows draw (-2 here: not checked)."""
    top = logits.float().max(-1).values
    finite = ~logits.float().isnan().any(-1) & top.isfinite()
    return torch.where(temperatures > 0, torch.where(finite, -2, -1), logits.argmax(-1))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab", [300, 151936])  # 151936: CUDA splits the row across blocks
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_and_inf_rows_greedy_and_sampled(device, vocab, dtype):
    logits = torch.randn(12, vocab, device=device).to(dtype)
    for base in (0, 6):  # rows base..base+5 greedy, then sampled
        logits[base + 1, 17] = float("nan")  # one NaN
        logits[base + 2] = float("nan")  # all NaN: argmax 0
        logits[base + 3] = float("-inf")  # all -inf
        logits[base + 4, vocab - 5] = float("inf")
        logits[base + 5, vocab // 3] = float("-inf")  # finite max: an ordinary row
    params = row_params(12, device, temperature=0.7, top_k=20, top_p=0.9)
    params["temperatures"][:6] = 0.0
    params["top_k"][9:] = 0  # CUDA's chunked draw for long rows: no top-k/top-p
    params["top_p"][9:] = 1.0
    out = ops.sample(logits, **params)
    expected = reference_unsampled(logits, params["temperatures"])
    checked = expected != -2
    assert torch.equal(out[checked], expected[checked])
    assert (out[~checked] >= 0).all() and checked.sum() == 10
    out32 = ops.sample(logits, **params, out=torch.empty(12, dtype=torch.int32, device=device))
    assert torch.equal(out32.long(), out)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [10, 1000])
def test_sampled_tokens_stay_in_support(device, dtype, vocab):
    batch = 96
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(batch, vocab, generator=gen) * 3).to(dtype)
    logits[::7] = logits[::7].round()  # rows full of ties
    temperatures = torch.rand(batch, generator=gen) * 1.7 + 0.3
    top_k = torch.tensor([0, 1, 5, 50, vocab, 2 * vocab], dtype=torch.int32)[torch.arange(batch) % 6]
    top_p = torch.tensor([1.0, 0.9, 0.5, 0.0, 0.99])[torch.arange(batch) % 5]
    seeds = torch.randint(0, 2**62, (batch,), generator=gen)
    offsets = torch.randint(0, 1000, (batch,), generator=gen)
    out = ops.sample(logits.to(device), temperatures.to(device), top_k.to(device), top_p.to(device),
                     seeds.to(device), offsets.to(device)).cpu()
    for r in range(batch):
        keep = support(logits[r], temperatures[r].item(), top_k[r].item(), top_p[r].item())
        assert keep[out[r]], (f"row {r}: token {out[r].item()} outside the support (T={temperatures[r]:.3f}, "
                              f"top_k={top_k[r].item()}, top_p={top_p[r].item()})")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_vocab_support(device, dtype):
    """A decode step's real shape: 151936 logits, Qwen3's recommended T=0.6, top-k 20, top-p 0.95."""
    batch, vocab = 3, 151936
    logits = (torch.randn(batch, vocab) * 2.5).to(dtype)
    for top_k, top_p in [(20, 0.95), (0, 0.9), (1000, 1.0)]:
        params = row_params(batch, device, temperature=0.6, top_k=top_k, top_p=top_p)
        out = ops.sample(logits.to(device), **params).cpu()
        for r in range(batch):
            keep = support(logits[r], 0.6, top_k, top_p) if top_k or top_p < 1 else None
            assert keep is None or keep[out[r]]


# (temperature, top_k, top_p) over a 12-token vocabulary
DISTRIBUTION_CASES = [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (1.0, 6, 0.9), (0.5, 3, 0.6)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", DISTRIBUTION_CASES)
def test_frequencies_follow_the_restricted_softmax(device, case):
    temperature, top_k, top_p = case
    draws = 20000
    logits = torch.tensor([2.0, 1.5, 1.4, 1.0, 0.7, 0.5, 0.0, -0.3, -1.0, -1.2, -2.0, -4.0])
    keep = support(logits, temperature, top_k, top_p)
    expected = torch.softmax(torch.where(keep, logits.double() / temperature, float("-inf")), -1)
    params = row_params(draws, device, temperature, top_k, top_p, seed=7)  # offsets 0..draws-1
    tokens = ops.sample(logits.expand(draws, -1).to(device), **params).cpu()
    counts = torch.bincount(tokens, minlength=logits.numel()).double()
    assert counts[~keep].sum() == 0, "a token outside the top-k/top-p support was drawn"
    # Binomial counts within 5 standard deviations (fixed seeds: deterministic, never flaky).
    sigma = (draws * expected * (1 - expected)).sqrt()
    assert ((counts - draws * expected).abs() <= 5 * sigma + 2).all(), (counts / draws, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_same_seed_and_offset_reproduce(device):
    logits = torch.randn(8, 1000, device=device)
    params = row_params(8, device, temperature=1.0, top_p=0.95)
    params["seeds"] = torch.arange(8, device=device) * 1000003
    first = ops.sample(logits, **params)
    assert torch.equal(first, ops.sample(logits, **params))
    # A row's draw does not depend on its batch slot.
    perm = torch.randperm(8, device=device)
    permuted = {name: t[perm] for name, t in params.items()}
    assert torch.equal(ops.sample(logits[perm], **permuted), first[perm])


@pytest.mark.parametrize("device", DEVICES)
def test_different_offsets_or_seeds_differ(device):
    logits = torch.randn(1000, device=device).expand(64, -1)
    by_offset = ops.sample(logits, **row_params(64, device, temperature=1.0))
    same_offset = {"offsets": torch.zeros(64, dtype=torch.int64, device=device),
                   "seeds": torch.arange(64, device=device)}
    by_seed = ops.sample(logits, **{**row_params(64, device), **same_offset})
    assert by_offset.unique().numel() > 20 and by_seed.unique().numel() > 20


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_logits_draw_as_their_float32_values(device, dtype):
    """generate() and the engine pass bf16/fp16 logits without HF's fp32 conversion: the tokens
    must be those of the converted logits, greedy and sampled."""
    batch = 64
    logits = (torch.randn(batch, 5000, device=device) * 3).to(dtype)
    params = row_params(batch, device, temperature=0.8, top_k=40, top_p=0.9)
    params["temperatures"][::4] = 0.0  # some greedy rows
    params["seeds"] = torch.arange(batch, device=device) * 7919
    assert torch.equal(ops.sample(logits, **params), ops.sample(logits.float(), **params))
    assert torch.equal(ops.sample(logits), logits.float().argmax(-1))


@pytest.mark.cuda
@pytest.mark.parametrize("vocab, top_k, top_p", [(5000, 40, 0.9), (5000, 0, 1.0), (151936, 0, 1.0),
                                                 (151936, 20, 0.95)])
def test_cpu_and_cuda_draw_the_same_tokens(vocab, top_k, top_p):
    # 151936 with no top-k/top-p: rows split across blocks on CUDA (chunk totals, then one chunk).
    batch = 256
    logits = torch.randn(batch, vocab) * 3
    params = row_params(batch, "cpu", temperature=0.8, top_k=top_k, top_p=top_p)
    params["seeds"] = torch.randint(0, 2**62, (batch,))
    cpu = ops.sample(logits, **params)
    cuda = ops.sample(logits.cuda(), **{name: t.cuda() for name, t in params.items()}).cpu()
    # Equal but where a weight (std::exp vs __expf) sits on a boundary: practically never.
    assert (cpu == cuda).float().mean() >= 0.98


@pytest.mark.cuda
@pytest.mark.parametrize("vocab", [8193, 16389, 151936])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("strided", [False, True])
def test_rows_split_across_blocks_draw_exactly_the_cpu_token(vocab, dtype, strided):
    # CUDA reads rows longer than 8192 logits in chunks, one block each, and draws within the
    # chunk that holds the target. Tokens tied at the max, in several chunks, with -inf elsewhere,
    # weigh exactly 2^40 on both devices (exp(0)), so the CPU's whole-row draw is the reference,
    # exactly. strided: rows vocab + 1 apart (unaligned: the scalar-load kernels).
    batch = 96
    gen = torch.Generator().manual_seed(vocab)
    full = torch.full((batch, vocab + 1), float("-inf"))
    for r in range(batch):
        full[r, torch.randint(0, vocab, (1 + r % 7,), generator=gen)] = 3.0
    full[::5] = torch.randn(full[::5].shape, generator=gen) * 3  # a few ordinary rows too
    full = full.to(dtype)
    params = row_params(batch, "cpu", temperature=0.7)
    params["seeds"] = torch.randint(0, 2**62, (batch,), generator=gen)
    params["temperatures"][::4] = 0.0  # greedy rows: the max from the chunk keys
    cols = slice(0, vocab) if strided else slice(1, vocab + 1)
    cpu = ops.sample(full[:, cols].contiguous() if not strided else full[:, cols], **params)
    on_cuda = full.cuda()[:, cols]
    on_cuda = on_cuda if strided else on_cuda.contiguous()
    cuda = ops.sample(on_cuda, **{name: t.cuda() for name, t in params.items()}).cpu()
    tied = [r for r in range(batch) if r % 5]
    assert torch.equal(cpu[tied], cuda[tied])
    assert (cpu == cuda).float().mean() >= 0.98


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    logits = torch.randn(4, 100, device=device)
    out = torch.empty(4, dtype=torch.int64, device=device)
    torch.library.opcheck(torch.ops.pagedkv.sample.default, (out, logits, None, None, None, None, None))
    p = row_params(4, device, temperature=0.9, top_k=10, top_p=0.9)
    torch.library.opcheck(torch.ops.pagedkv.sample.default,
                          (out, logits, p["temperatures"], p["top_k"], p["top_p"], p["seeds"], p["offsets"]))


@pytest.mark.parametrize("device", DEVICES)
def test_bad_calls_name_the_argument(device):
    logits = torch.randn(4, 100, device=device)
    with pytest.raises(RuntimeError, match=r"sampling with temperatures needs seeds and offsets"):
        ops.sample(logits, temperatures=torch.ones(4, device=device))
    with pytest.raises(RuntimeError, match=r"top_k has dtype Long; it must be Int"):
        ops.sample(logits, top_k=torch.ones(4, dtype=torch.int64, device=device))
    with pytest.raises(RuntimeError, match=r"out must have shape \[batch\] = \[4\]"):
        ops.sample(logits, out=torch.empty(3, dtype=torch.int64, device=device))
    with pytest.raises(RuntimeError, match=r"out has dtype Float; allowed: torch.int32 or torch.int64"):
        ops.sample(logits, out=torch.empty(4, device=device))
    with pytest.raises(RuntimeError, match=r"logits must have shape \[batch, vocab\] with a contiguous last"):
        ops.sample(logits.t())
