"""Speculative decoding in pagedkv.LLM (engine/speculation.py): prompt lookup per request and a
shared draft model, against the same engine without speculation (tiny random fp32 models).

Greedy: every request's tokens equal the plain engine's, token for token, with rows of mixed
acceptance, requests arriving mid-run, stop ids and max_tokens inside accepted runs, speculating
and ordinary requests side by side; both caches give every block back. Sampling: the first
tokens' distribution over many seeds equals the plain engine's (chi-square); a seed reproduces a
request whatever runs beside it. What speculation cannot honour is refused, naming it."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import DEVICES
from pagedkv import LLM, SamplingParams
from test_assistant_model import target, truncated
from test_engine import CharTokenizer, assert_no_leaks
from test_prompt_lookup import walk, walker
from test_prompt_lookup_sampling import P_MIN, two_sample_p
from models import tiny_model


def repeating_prompts(count: int, seed: int = 0, model=None) -> list[list[int]]:
    """Prompts holding a walk of `model` (its greedy tokens from a random one; random tokens
    without a model) twice among random tokens, the second time cut short: lookup finds n-grams,
    and a walker (test_prompt_lookup.walker) accepts them until the walk's copy runs out."""
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(count):
        start = torch.randint(3, 256, (1,), generator=g).tolist()
        phrase = walk(model, start[0], 10)[:-1] if model is not None else start + torch.randint(
            3, 256, (9,), generator=g).tolist()
        noise = torch.randint(3, 256, (3 + i % 7,), generator=g).tolist()
        prompts.append(noise + phrase + noise[:2] + phrase[:2 + i % 4])
    return prompts


def run(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def assert_draft_free(llm: LLM) -> None:
    draft = llm.speculation.draft
    assert draft is None or (len(draft.cache.manager) == 0 and draft.cache.num_free_blocks == draft.cache.num_blocks)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", ["lookup", "truncated_draft", "unrelated_draft"])
def test_greedy_equals_the_engine_without_speculation(device, method):
    model = walker().to(device) if method == "lookup" else target(device)
    options = {"lookup": lambda: dict(prompt_lookup_num_tokens=3, max_matching_ngram_size=3),
               "truncated_draft": lambda: dict(assistant_model=truncated(model), num_assistant_tokens=4),
               "unrelated_draft": lambda: dict(assistant_model=tiny_model("llama", device=device, seed=5),
                                               num_assistant_tokens=2)}[method]()
    prompts = repeating_prompts(9, model=model)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (24, 1, 2, 17, 30, 5, 24, 9, 13)]
    llm = LLM(model, max_num_seqs=4, max_num_batched_tokens=64, **options)
    expected = run(LLM(model, max_num_seqs=4, max_num_batched_tokens=64), prompts, params)
    assert run(llm, prompts, params) == expected
    stats = llm.speculation.stats
    assert 0 < stats.accepted < stats.proposed, stats  # mixed acceptance
    assert_no_leaks(llm)
    assert_draft_free(llm)


@pytest.mark.parametrize("draft", [False, True])
def test_requests_arriving_mid_run_and_ordinary_requests_beside(draft):
    """Requests added while others run; every third opts out (k = 0): the same tokens as the
    plain engine, a small budget and cache forcing shrunk proposals and preemptions."""
    model = target()
    option = "num_assistant_tokens" if draft else "prompt_lookup_num_tokens"
    spec = dict(assistant_model=truncated(model), num_assistant_tokens=3) if draft else dict(prompt_lookup_num_tokens=4)
    prompts = repeating_prompts(8, seed=3)
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, **({option: 0} if i % 3 == 2 else {}))
              for i in range(8)]

    def online(llm: LLM, params: list[SamplingParams]) -> dict[str, list[int]]:
        done = {}
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            llm.add_request(prompt, p, request_id=str(i))
            for _ in range(i % 3 + 1):
                done.update({o.request_id: o.outputs[0].token_ids for o in llm.step(partial=False)})
        while llm.has_unfinished_requests():
            done.update({o.request_id: o.outputs[0].token_ids for o in llm.step(partial=False)})
        return done

    llm = LLM(model, max_num_seqs=3, max_num_batched_tokens=12, num_kv_blocks=12, block_size=8, **spec)
    plain = LLM(model, max_num_seqs=3, max_num_batched_tokens=12, num_kv_blocks=12, block_size=8)
    expected = online(plain, [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)] * 8)
    assert online(llm, params) == expected
    assert llm.speculation.stats.accepted > 0
    assert plain.stats.num_preemptions > 0
    assert_no_leaks(llm)
    assert_draft_free(llm)


def test_stop_ids_and_max_tokens_inside_an_accepted_run():
    """A draft equal to the target accepts everything: stop ids, max_tokens and stop strings end
    a request in the middle of an accepted run, exactly where the plain engine ends it."""
    model = target()
    prompts = repeating_prompts(6, seed=4)
    tok = CharTokenizer()
    llm = LLM(model, tok, assistant_model=copy.deepcopy(model), num_assistant_tokens=4)  # the same tokens
    plain = LLM(model, tok)
    free = run(plain, prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    params = [SamplingParams(max_tokens=16, temperature=0, stop_token_ids=[out[5 + i]]) for i, out in enumerate(free)]
    params += [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (3, 6, 7, 10, 11, 12)]
    params += [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=tok.decode(out[6 + i:8 + i]),
                              include_stop_str_in_output=i % 2 == 0) for i, out in enumerate(free)]
    expected = [o.outputs[0] for o in plain.generate(prompts * 3, params, use_tqdm=False)]
    got = [o.outputs[0] for o in llm.generate(prompts * 3, params, use_tqdm=False)]
    assert [(o.token_ids, o.text, o.finish_reason) for o in got] == [
        (o.token_ids, o.text, o.finish_reason) for o in expected]
    assert sum(o.finish_reason == "stop" for o in got[12:]) >= 4
    assert any(o.finish_reason == "stop" for o in got)
    stats = llm.speculation.stats
    assert stats.accepted == stats.proposed > 0
    assert_no_leaks(llm)
    assert_draft_free(llm)


@pytest.mark.parametrize("method", ["lookup", "draft"])
@pytest.mark.parametrize("temperature, top_k, top_p", [(0.6, 0, 1.0), (1.0, 4, 0.9)])
def test_sampling_keeps_the_distribution_of_the_first_tokens(method, temperature, top_k, top_p):
    model = walker() if method == "lookup" else target()
    spec = dict(prompt_lookup_num_tokens=3) if method == "lookup" else dict(assistant_model=truncated(model),
                                                                          num_assistant_tokens=3)
    # 64 rows a step: every step proposes (past the default speculative_max_batch)
    llm = LLM(model, max_num_seqs=64, max_num_batched_tokens=512, speculative_max_batch=None, **spec)
    prompt = repeating_prompts(1, seed=7, model=model)[0]
    n = 1000
    params = [SamplingParams(max_tokens=4, temperature=temperature, top_k=top_k, top_p=top_p, seed=s,
                             ignore_eos=True) for s in range(n)]
    plain = run(LLM(model, max_num_seqs=64, max_num_batched_tokens=512), [prompt] * n, params)
    got = run(llm, [prompt] * n, params)
    assert llm.speculation.stats.accepted > 0 and llm.speculation.stats.proposed > llm.speculation.stats.accepted
    for position in (1, 2, 3):
        assert two_sample_p([t[position] for t in plain], [t[position] for t in got]) > P_MIN, position
    assert two_sample_p([tuple(t[1:3]) for t in plain], [tuple(t[1:3]) for t in got]) > P_MIN
    assert_no_leaks(llm)
    assert_draft_free(llm)


def test_a_seed_reproduces_a_request_whatever_runs_beside_it():
    model = target()
    prompts = repeating_prompts(5, seed=9)
    seeded = SamplingParams(max_tokens=12, temperature=0.8, seed=1234, ignore_eos=True)
    other = SamplingParams(max_tokens=12, temperature=0.8, ignore_eos=True)
    llm = LLM(model, prompt_lookup_num_tokens=3)
    alone = run(llm, prompts[:1], seeded)[0]
    beside = run(llm, prompts, [seeded] + [other] * 4)[0]
    assert beside == alone
    assert_no_leaks(llm)


def test_refused_options_name_themselves():
    model = target()
    draft = truncated(model)
    llm = LLM(model, prompt_lookup_num_tokens=3)
    for bad, name in ((dict(n=2), "n > 1"), (dict(logprobs=1), "logprobs"),
                      (dict(repetition_penalty=1.2), "repetition_penalty"),
                      (dict(presence_penalty=0.5), "presence_penalty"), (dict(min_p=0.1), "min_p"),
                      (dict(num_assistant_tokens=2), "num_assistant_tokens")):
        with pytest.raises(ValueError, match=name):
            llm.add_request([5, 6, 7], SamplingParams(**bad))
    assert not llm.has_unfinished_requests()
    # opted out, the same request runs
    assert run(llm, [[5, 6, 7]], SamplingParams(n=2, prompt_lookup_num_tokens=0, max_tokens=3, seed=0))
    plain = LLM(model)
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens"):
        plain.add_request([5, 6], SamplingParams(prompt_lookup_num_tokens=2))
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens must be"):
        SamplingParams(prompt_lookup_num_tokens=-1)
    for kwargs, name in ((dict(prompt_lookup_num_tokens=2, overlap_steps=True), "overlap_steps"),
                         (dict(prompt_lookup_num_tokens=2, assistant_model=draft), "pass one"),
                         (dict(max_matching_ngram_size=2), "max_matching_ngram_size"),
                         (dict(num_assistant_tokens=2), "num_assistant_tokens"),
                         (dict(prompt_lookup_num_tokens=True), "prompt_lookup_num_tokens"),
                         (dict(assistant_model=model), "assistant_model"),
                         (dict(assistant_model=draft, num_assistant_tokens=0), "num_assistant_tokens")):
        with pytest.raises(ValueError, match=name):
            LLM(model, **kwargs)
    assert_no_leaks(llm)


def test_a_draft_cache_shares_the_memory_budget():
    """kv_cache_memory holds the target's cache and the draft's (a block for each of the
    target's); a block count given sizes the target's alone."""
    model = target("cpu")
    budget = 4 << 20
    llm = LLM(model, kv_cache_memory=budget, assistant_model=truncated(model), num_assistant_tokens=3)
    target_cache, draft_cache = llm.cache, llm.speculation.draft.cache
    assert draft_cache.num_blocks == target_cache.num_blocks > 0
    assert target_cache.kv.nbytes + draft_cache.kv.nbytes <= budget
    plain = LLM(model, kv_cache_memory=budget)
    assert plain.cache.num_blocks > target_cache.num_blocks
    assert LLM(model, num_kv_blocks=40, assistant_model=truncated(model)).cache.num_blocks == 40


def test_lookup_index_proposes_what_the_scan_does():
    """The engine's prompt lookup reads a per-sequence NgramIndex (no scan of every row's tokens
    each step): the proposals of prompt_lookup.propose as the sequence grows, after its tokens are
    cut (a stop string) too; the index goes when the sequence stops running."""
    import random
    import types

    from pagedkv.engine.speculation import Speculation
    from pagedkv.runtime.prompt_lookup import propose

    spec = Speculation(4, 2, None, None, 8, torch.device("cpu"))
    rng = random.Random(0)
    seqs = {n: types.SimpleNamespace(seq_id=n, token_ids=[rng.randrange(4) for _ in range(5)]) for n in (2, 3)}
    for step in range(40):
        for n, seq in seqs.items():  # sequence n looks up n-grams of up to n tokens
            assert spec._lookup(seq, 4, n) == propose(seq.token_ids, 4, n), (step, seq.token_ids, n)
            assert spec.indexes[n].tokens == seq.token_ids  # what it indexes is the sequence now
            if step in (20, 30):  # watched.py cuts a stop string's tokens; others may follow
                cut = seq.token_ids[-3:]
                del seq.token_ids[-3:]
                seq.token_ids += [(t + 1) % 4 for t in cut]  # as many, each another token
            seq.token_ids += [rng.randrange(4) for _ in range(rng.randint(1, 3))]
    assert set(spec.indexes) == {2, 3}
    spec.release([])
    assert spec.indexes == {}


@pytest.mark.parametrize("max_batch", [1, 3, None])
def test_steps_of_more_rows_than_speculative_max_batch_propose_nothing(monkeypatch, max_batch):
    """Past speculative_max_batch decode rows a step proposes nothing (its rows decode as without
    speculation); as requests finish and the batch shrinks, steps propose again; None: always."""
    from pagedkv.engine.speculation import Speculation

    steps = []  # (decode rows, whether the step proposed)
    real = Speculation.propose

    def watched(self, decodes, budget):
        out = real(self, decodes, budget)
        steps.append((len(decodes), bool(out)))
        return out

    monkeypatch.setattr(Speculation, "propose", watched)
    model = walker()
    prompts = repeating_prompts(6, model=model)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (30, 4, 8, 12, 16, 20)]
    llm = LLM(model, max_num_seqs=6, max_num_batched_tokens=64, prompt_lookup_num_tokens=3,
              speculative_max_batch=max_batch)
    assert run(llm, prompts, params) == run(LLM(model, max_num_seqs=6, max_num_batched_tokens=64), prompts, params)
    limit = 6 if max_batch is None else max_batch
    assert not any(proposed for rows, proposed in steps if rows > limit), steps
    assert any(proposed for rows, proposed in steps if rows <= limit), steps
    if max_batch is None:
        assert any(proposed for rows, proposed in steps if rows > 3), steps
    assert_no_leaks(llm)
    with pytest.raises(ValueError, match="speculative_max_batch must be an int >= 1, got 0"):
        LLM(model, prompt_lookup_num_tokens=3, speculative_max_batch=0)
