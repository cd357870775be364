"""generate(prompt_lookup_num_tokens=k, do_sample=True): speculative sampling keeps the target
distribution (runtime/speculative_sampling.py), fp32 on the CPU.

The maths alone: ops.sample's distribution computed (warped_probs, against ops.sample's draws),
the residual against an exact enumeration, and the acceptance rule (verify) over many identical
rows against the targets, with a chi-square that flags two wrong rules. Then generate(): the first
tokens' distribution over many rows equals non-speculative sampling's; a point-mass target
(top_k=1) gives the greedy tokens through accepted runs, EOS and max_new_tokens; a seed reproduces
a call; every block is freed."""

from __future__ import annotations

import collections

import pytest
import torch

import pagedkv
from conftest import DEVICES
from models import tiny_model
from pagedkv import ops
from pagedkv.hf.generation_config import UnsupportedGenerationArgument
from pagedkv.runtime.speculative_sampling import residual, verify, warped_probs
from test_prompt_lookup import assert_cache_empty, batch, stats, walk, walker

SAMPLE = dict(do_sample=True, eos_token_id=None)
P_MIN = 1e-3  # a chi-square p-value below this fails a test


def chi_square_p(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's goodness of fit: p-value of counts `observed` [K] against probabilities
    `expected` [K]; categories expected below 5 counts are pooled into one."""
    n = observed.sum().double()
    expected = expected.double() * n
    small = expected < 5
    observed = torch.cat([observed[~small].double(), observed[small].double().sum().unsqueeze(0)])
    expected = torch.cat([expected[~small], expected[small].sum().unsqueeze(0)])
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
    if observed.numel() < 2:
        return 1.0
    stat = ((observed - expected) ** 2 / expected.clamp(min=1e-12)).sum()
    return float(torch.special.gammaincc(torch.tensor((observed.numel() - 1) / 2.0, dtype=torch.float64),
                                         stat / 2))


def two_sample_p(a: list, b: list) -> float:
    """Chi-square test that samples a and b (hashable outcomes) come from one distribution;
    outcomes seen fewer than 10 times in all are pooled."""
    ca, cb = collections.Counter(a), collections.Counter(b)
    keys = sorted(set(ca) | set(cb), key=lambda x: -(ca[x] + cb[x]))
    big = [x for x in keys if ca[x] + cb[x] >= 10]
    rest = [x for x in keys if ca[x] + cb[x] < 10]
    table = torch.tensor([[ca[x] for x in big] + [sum(ca[x] for x in rest)],
                          [cb[x] for x in big] + [sum(cb[x] for x in rest)]], dtype=torch.float64)
    table = table[:, table.sum(0) > 0]
    if table.shape[1] < 2:
        return 1.0
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = ((table - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor((table.shape[1] - 1) / 2.0, dtype=torch.float64),
                                         stat / 2))


# -- the maths -------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 3, 1.0), (1.3, 0, 0.6),
                                                       (0.5, 4, 0.8), (1.0, 0, 0.0)])
def test_warped_probs_is_ops_sample_distribution(device, temperature, top_k, top_p):
    torch.manual_seed(0)
    logits = (torch.randn(3, 12) * 1.5).to(device)
    logits[1, 4] = logits[1, 7] = logits[1].max()  # a tie at the top
    logits[2, 3] = logits[2, 5] = logits[2, 9]  # a tie that top-k/top-p may cut through
    logits[2, 0] = float("-inf")
    probs, drawable = warped_probs(logits, temperature, top_k, top_p)
    assert drawable.all() and torch.allclose(probs.sum(-1), torch.ones(3, device=device))
    n = 20000
    probs = probs.cpu()
    for r in range(3):
        rows = logits[r].expand(n, -1).contiguous()
        full = lambda v, dtype: torch.full((n,), v, dtype=dtype, device=device)  # noqa: E731
        drawn = ops.sample(rows, full(temperature, torch.float32), full(top_k, torch.int32),
                           full(top_p, torch.float32), full(77 + r, torch.int64),
                           torch.arange(n, device=device))
        counts = torch.bincount(drawn.cpu(), minlength=12)
        assert not (counts > 0)[probs[r] == 0].any()  # the same support
        assert chi_square_p(counts, probs[r]) > P_MIN


def test_warped_probs_marks_rows_without_a_distribution():
    logits = torch.randn(4, 6)
    logits[0, 2] = float("nan")
    logits[1, 3] = float("inf")
    logits[2] = float("-inf")
    _, drawable = warped_probs(logits, 1.0, 0, 1.0)
    assert drawable.tolist() == [False, False, False, True]


@pytest.mark.parametrize("seed", range(4))
def test_residual_keeps_the_target_exactly(seed):
    """Enumerated: the first token is d with probability p(d) (accepted), else drawn from the
    residual: p(d) onehot(d) + (1 - p(d)) residual(p, d) == p, for every draft token d, including
    a p that is the draft token alone and one where d has probability 0."""
    torch.manual_seed(seed)
    p = torch.softmax(torch.randn(5, 6, dtype=torch.float64) * 2, -1)
    p[3] = torch.nn.functional.one_hot(torch.tensor(2), 6).double()
    p[4, 1] = 0
    p[4] /= p[4].sum()
    for d in range(6):
        draft = torch.full((5,), d)
        res = residual(p, draft)
        assert torch.allclose(res.sum(-1), torch.ones(5, dtype=torch.float64))
        emitted = p[:, d:d + 1] * torch.nn.functional.one_hot(draft, 6) + (1 - p[:, d:d + 1]) * res
        assert torch.allclose(emitted, p, atol=1e-12)
        assert (res[:, d][p[:, d] < 1] == 0).all()


def _always_accept(probs, draft, lengths, generator):
    """A wrong rule: every proposed token accepted, the bonus token drawn from p_m."""
    count = torch.tensor(lengths)
    at = count.cumsum(0) - 1
    return count - 1, torch.multinomial(probs[at], 1, generator=generator).squeeze(-1)


def _redraw_from_p(probs, draft, lengths, generator):
    """A wrong rule: at a rejection, draw from p_j itself instead of the residual."""
    accepted, _ = verify(probs, draft, lengths, generator)
    at = torch.tensor(lengths).cumsum(0) - torch.tensor(lengths) + accepted
    return accepted, torch.multinomial(probs[at], 1, generator=generator).squeeze(-1)


def _verify_fits(rule, n: int = 20000, device: str = "cpu") -> float:
    """n identical rows fed 3 positions (a 2-token proposal) against targets p_0, p_1, p_2: the
    first emitted token must follow p_0, the second (in rows that accepted d_1) p_1; the
    smaller chi-square p-value of the two."""
    torch.manual_seed(5)
    p = torch.softmax(torch.randn(3, 8) * 1.2, -1)  # [3, V]
    d = [int(p[0].argsort()[-2]), int(p[1].argmax())]  # a likely but not sure proposal
    probs = p.repeat(n, 1).to(device)  # [3n, V]
    draft = torch.tensor(d + [-1]).repeat(n).to(device)
    generator = torch.Generator(device=device).manual_seed(11)
    accepted, tokens = (t.cpu() for t in rule(probs, draft, [3] * n, generator))
    first = torch.where(accepted > 0, d[0], tokens)
    second = torch.where(accepted > 1, d[1], tokens)[accepted > 0]
    return min(chi_square_p(torch.bincount(first, minlength=8), p[0]),
               chi_square_p(torch.bincount(second, minlength=8), p[1]))


@pytest.mark.parametrize("device", DEVICES)
def test_verify_keeps_the_target_distribution(device):
    assert _verify_fits(verify, device=device) > P_MIN


@pytest.mark.parametrize("wrong", [_always_accept, _redraw_from_p])
def test_the_chi_square_flags_a_wrong_rule(wrong):
    assert _verify_fits(wrong) < P_MIN


def test_verify_rows_of_different_lengths():
    """Rows fed 1, 3 and 2 positions; point-mass targets decide every outcome."""
    hot = lambda t: torch.nn.functional.one_hot(torch.tensor(t), 5).float()  # noqa: E731
    probs = torch.stack([hot(4),  # row 0: no proposal, draws 4
                         hot(1), hot(2), hot(3),  # row 1: 1, 2 accepted, bonus 3
                         hot(0), hot(3)])  # row 2: proposal 2 rejected at once, residual of p_0: 0
    draft = torch.tensor([-1, 1, 2, -1, 2, -1])
    accepted, tokens = verify(probs, draft, [1, 3, 2], torch.Generator().manual_seed(0))
    assert accepted.tolist() == [0, 2, 0] and tokens.tolist() == [4, 3, 0]


# -- generate() -------------------------------------------------------------------------------

def _walk_rows(model, n: int):
    path = walk(model, 11, 8)
    torch.manual_seed(1)
    noise = torch.randint(3, 256, (9,)).tolist()
    return path, [path[:6] + noise + path[:1]] * n  # the walk in the prompt: proposals accepted


def test_first_tokens_follow_non_speculative_sampling():
    """2000 identical rows, sampled with and without prompt lookup: the joint distribution of new
    tokens 1-2 and the distribution of token 3 (the verified ones) agree (two-sample chi-square)."""
    model = walker()
    _, rows = _walk_rows(model, 2000)
    ids = torch.tensor(rows)
    settings = dict(max_new_tokens=3, temperature=0.8, top_k=6, top_p=0.95, **SAMPLE)
    torch.manual_seed(2)
    plain = pagedkv.generate(model, ids, **settings)[:, -3:].tolist()
    torch.manual_seed(3)
    spec = pagedkv.generate(model, ids, prompt_lookup_num_tokens=2, **settings)[:, -3:].tolist()
    s = stats(model)
    assert 0 < s.accepted < s.proposed
    assert two_sample_p([tuple(r[:2]) for r in plain], [tuple(r[:2]) for r in spec]) > P_MIN
    assert two_sample_p([r[2] for r in plain], [r[2] for r in spec]) > P_MIN
    assert_cache_empty(model)


def test_a_seed_reproduces_a_call():
    model = walker()
    _, rows = _walk_rows(model, 4)
    ids = torch.tensor(rows)
    runs = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed)
        runs.append(pagedkv.generate(model, ids, max_new_tokens=12, prompt_lookup_num_tokens=3,
                                     temperature=1.5, **SAMPLE))
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
    assert_cache_empty(model)


@pytest.mark.cuda
def test_cuda_seed_and_point_mass():
    """On CUDA (the generator and the maths on the device): a seed reproduces a call, and top_k=1
    gives the greedy tokens through accepted runs."""
    model = walker()
    _, rows = _walk_rows(model, 3)  # the walk found on the CPU
    model = model.cuda()
    ids = torch.tensor(rows, device="cuda")
    runs = []
    for seed in (7, 7):
        torch.manual_seed(seed)
        runs.append(pagedkv.generate(model, ids, max_new_tokens=10, prompt_lookup_num_tokens=3, **SAMPLE))
    assert torch.equal(runs[0], runs[1])
    greedy = pagedkv.generate(model, ids, max_new_tokens=10, do_sample=False, eos_token_id=None)
    point = pagedkv.generate(model, ids, max_new_tokens=10, prompt_lookup_num_tokens=3, top_k=1, **SAMPLE)
    assert torch.equal(point, greedy) and stats(model).accepted > 0
    assert_cache_empty(model)


def check_point_mass(model, rows, **kwargs):
    """top_k=1: every target is a point mass on the greedy token, so sampling with prompt lookup
    gives the greedy tokens (a draft is accepted exactly when it is the greedy token)."""
    ids, mask = batch(rows)
    expected = pagedkv.generate(model, ids, attention_mask=mask, do_sample=False, **kwargs)
    got = pagedkv.generate(model, ids, attention_mask=mask, do_sample=True, top_k=1,
                           prompt_lookup_num_tokens=4, **kwargs)
    assert torch.equal(got, expected)
    assert_cache_empty(model)
    return got


def test_point_mass_rows_of_mixed_acceptance():
    model = walker()
    path = walk(model, 11, 12)
    torch.manual_seed(1)
    noise = torch.randint(3, 256, (20,)).tolist()
    rows = [path + noise + path[:1], noise, noise[:5] + path[3:5] + noise[5:9]]
    check_point_mass(model, rows, max_new_tokens=30, eos_token_id=None)
    s = stats(model)
    assert 0 < s.accepted < s.proposed and s.rounds < 30


def test_point_mass_eos_and_max_new_tokens_inside_an_accepted_run():
    model = walker()
    path = walk(model, 11, 6)
    got = check_point_mass(model, [path[:4] + [40, 41, 42] + path[:1]], max_new_tokens=12,
                           eos_token_id=path[2], pad_token_id=0)
    assert got[0, 8:].tolist() == path[1:3] and stats(model).rounds == 1
    got = check_point_mass(model, [path + [40, 41] + path[:1]], max_new_tokens=4, eos_token_id=None)
    assert got[0, -4:].tolist() == path[1:5]
    assert stats(model).accepted == 2 and stats(model).rounds == 1
    for min_new in (2, 3):  # EOS suppressed position by position
        check_point_mass(model, [path[:5] + [40, 41] + path[:1]], max_new_tokens=8,
                         eos_token_id=path[2], pad_token_id=0, min_new_tokens=min_new)


def test_nan_logits_raise_and_free_every_block():
    model = walker()
    with torch.no_grad():
        model.lm_head.weight[9] = float("nan")
    with pytest.raises(RuntimeError, match="NaN or infinite logits"):
        pagedkv.generate(model, torch.tensor([[5, 6, 7, 5, 6]]), max_new_tokens=6,
                         prompt_lookup_num_tokens=3, **SAMPLE)
    assert_cache_empty(model)


@pytest.mark.parametrize("kwargs, match", [
    (dict(repetition_penalty=1.2), "repetition_penalty"),
    (dict(num_return_sequences=2), "num_return_sequences"),
    (dict(min_p=0.1), "min_p"),
])
def test_what_sampling_does_not_run_with_is_refused(kwargs, match):
    model = tiny_model("llama")
    with pytest.raises(UnsupportedGenerationArgument, match=match):
        pagedkv.generate(model, torch.tensor([[5, 6, 7]]), max_new_tokens=4, prompt_lookup_num_tokens=3,
                         **SAMPLE, **kwargs)
