"""The overlapped step loop (step N+1 launched before step N is read back) against the serial one,
on the CPU where both run (tiny random models): the same tokens, a stopped sequence's extra row
dropped, aborts and interrupts while a step is launched, and tokens that were pending when their
cache slot was reserved reaching the prefix cache."""

from __future__ import annotations

import pytest

from pagedkv import LLM, SamplingParams
from pagedkv.engine.launched_step import LaunchedStep
from test_engine import assert_no_leaks, hf_greedy, model, random_prompts, sampled

GREEDY12 = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def test_same_tokens_as_serial_with_stops_forks_and_preemption():
    prompts = random_prompts([11, 30, 5, 17, 40, 23, 9], seed=31)
    stop = hf_greedy("llama", tuple(prompts[0]), 12)[3]
    params = [SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop])]
    params += [SamplingParams(max_tokens=4 + 2 * i, temperature=0.9, top_k=30, seed=i, n=1 + i % 2,
                              ignore_eos=True) for i in range(1, len(prompts))]
    # 9 blocks of 8 tokens for 7 requests: preemptions happen while steps are launched ahead.
    runs = {}
    for overlap in (False, True):
        llm = LLM(model(), max_num_seqs=4, num_kv_blocks=9, block_size=8, overlap_steps=overlap)
        runs[overlap] = (sampled(llm, prompts, params), llm.stats.num_generated_tokens)
        assert llm.stats.num_preemptions > 0
    assert runs[True] == runs[False]
    tokens, generated = runs[True]
    assert len(tokens[0][0]) == 4  # the stop token ends it; its row in the step ahead is dropped
    assert generated == sum(len(t) for request in tokens for t in request)


def test_a_step_launched_ahead_is_dropped_when_all_its_samples_stopped():
    prompt = random_prompts([11], seed=32)[0]
    free = hf_greedy("llama", tuple(prompt), 12)
    llm = LLM(model(), max_num_seqs=2, overlap_steps=True)
    out = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[free[2]]),
                       use_tqdm=False)[0]
    assert out.token_ids == free[:free.index(free[2]) + 1]
    assert not llm._launched  # the step launched ahead sampled for a finished sequence only
    assert_no_leaks(llm)
    # The next request starts on an idle engine: its first step() reports its first token.
    llm.add_request(prompt, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in llm.step()] == [free[:1]]


def test_abort_while_a_step_is_launched():
    prompts = random_prompts([13, 21], seed=33)
    llm = LLM(model(), max_num_seqs=4, overlap_steps=True)
    for p in prompts:
        llm.add_request(p, GREEDY12)
    outs = llm.step()
    assert len(llm._launched) == 1  # the second step already runs
    llm.abort_request("0")
    while llm.has_unfinished_requests():
        outs += llm.step()
    assert not [o for o in outs[2:] if o.request_id == "0"]
    assert [o.token_ids for o in outs if o.request_id == "1"][-1] == hf_greedy("llama", tuple(prompts[1]), 12)
    assert_no_leaks(llm)


def test_interrupted_read_back_leaves_the_step_to_the_next_call(monkeypatch):
    prompts = random_prompts([13, 21], seed=34)
    llm = LLM(model(), max_num_seqs=4, overlap_steps=True)
    for p in prompts:
        llm.add_request(p, GREEDY12)
    outs = llm.step()
    read = LaunchedStep.read
    calls = []

    def interrupted(self, *args):
        calls.append(self)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return read(self, *args)

    monkeypatch.setattr(LaunchedStep, "read", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.step()
    assert len(llm._launched) == 2  # nothing was lost: both steps wait to be read back
    monkeypatch.setattr(LaunchedStep, "read", read)
    while llm.has_unfinished_requests():
        outs += llm.step()
    for request_id, prompt in zip("01", prompts):
        mine = [o for o in outs if o.request_id == request_id]
        assert [len(o.token_ids) for o in mine] == list(range(1, 13))  # no step skipped or repeated
        assert mine[-1].token_ids == hf_greedy("llama", tuple(prompt), 12)
    assert_no_leaks(llm)


def test_tokens_pending_at_reservation_reach_the_prefix_cache():
    # A second turn repeats the first turn's prompt and output: the blocks its output filled
    # (each reserved before its token was read back) must be found, as the serial engine finds them.
    prompt = random_prompts([21], seed=35)[0]
    hits = {}
    for overlap in (False, True):
        llm = LLM(model(), max_num_seqs=2, block_size=8, overlap_steps=overlap)
        first = llm.generate(prompt, GREEDY12, use_tqdm=False)[0].token_ids
        turn = prompt + first + [7]
        cached_before = llm.stats.num_cached_prompt_tokens
        second = llm.generate(turn, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
                              use_tqdm=False)[0].token_ids
        hits[overlap] = llm.stats.num_cached_prompt_tokens - cached_before
        assert second == hf_greedy("llama", tuple(turn), 5)
        assert_no_leaks(llm)
    assert hits[True] == hits[False] == (len(prompt) + 12) // 8 * 8
