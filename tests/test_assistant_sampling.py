"""generate(assistant_model=draft, do_sample=True): speculative sampling with a draft model keeps the
target's distribution (the greedy draft's proposal is a point mass, verified by prompt lookup's rule,
runtime/speculative_sampling.py), a seed reproduces a call, and a point-mass target (top_k=1) gives the
greedy tokens through accepted runs; both caches empty after."""

from __future__ import annotations

import pytest
import torch

import pagedkv
from conftest import DEVICES
from test_assistant_model import assert_draft_empty, random_rows, stats, target, truncated
from test_prompt_lookup import assert_cache_empty, batch
from test_prompt_lookup_sampling import P_MIN, SAMPLE, two_sample_p


def test_first_tokens_follow_non_speculative_sampling():
    """1500 identical rows sampled with and without the draft: new tokens 1-2 jointly and token 3
    agree in distribution (two-sample chi-square); proposals were accepted and rejected."""
    model = target()
    draft = truncated(model)
    ids = torch.tensor(random_rows([6], seed=3) * 1500)
    settings = dict(max_new_tokens=3, temperature=0.7, top_k=8, top_p=0.95, **SAMPLE)
    torch.manual_seed(2)
    plain = pagedkv.generate(model, ids, **settings)[:, -3:].tolist()
    torch.manual_seed(3)
    spec = pagedkv.generate(model, ids, assistant_model=draft, num_assistant_tokens=2, **settings)[:, -3:].tolist()
    s = stats(model)
    assert 0 < s.accepted < s.proposed
    assert two_sample_p([tuple(r[:2]) for r in plain], [tuple(r[:2]) for r in spec]) > P_MIN
    assert two_sample_p([r[2] for r in plain], [r[2] for r in spec]) > P_MIN
    assert_cache_empty(model)
    assert_draft_empty(draft)


def test_the_check_flags_a_different_distribution():
    """The same comparison tells a hotter temperature apart: the test above can fail."""
    model = target()
    ids = torch.tensor(random_rows([6], seed=3) * 1500)
    torch.manual_seed(2)
    cold = pagedkv.generate(model, ids, max_new_tokens=2, temperature=0.7, top_k=8, **SAMPLE)[:, -2:].tolist()
    torch.manual_seed(3)
    hot = pagedkv.generate(model, ids, max_new_tokens=2, temperature=2.0, top_k=8, **SAMPLE)[:, -2:].tolist()
    assert two_sample_p([tuple(r) for r in cold], [tuple(r) for r in hot]) < P_MIN


@pytest.mark.parametrize("device", DEVICES)
def test_seed_and_point_mass(device):
    """A seed reproduces a call (another seed changes it); top_k=1 makes every target a point mass,
    so sampling gives the greedy tokens, rows of different lengths and acceptance."""
    model = target(device)
    draft = truncated(model)
    rows = random_rows([5, 9, 3], seed=1)
    ids, mask = batch(rows)
    ids, mask = ids.to(device), mask.to(device)
    runs = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed)
        runs.append(pagedkv.generate(model, ids, attention_mask=mask, max_new_tokens=10, temperature=1.5,
                                     assistant_model=draft, num_assistant_tokens=3, **SAMPLE))
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
    greedy = pagedkv.generate(model, ids, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=None)
    point_mass = pagedkv.generate(model, ids, attention_mask=mask, max_new_tokens=10, top_k=1,
                                  assistant_model=draft, num_assistant_tokens=3, **SAMPLE)
    assert torch.equal(point_mass, greedy)
    assert stats(model).accepted > 0
    assert_cache_empty(model)
    assert_draft_empty(draft)
