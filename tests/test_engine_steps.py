"""The engine's per-step shortcuts against what they stand for (tiny random models, CPU): a batch
that samples again reuses its sampling tensors (offsets one higher), forks and first-token times
are skipped only for such a batch, partial outputs copy their tokens on first access."""

from __future__ import annotations

import pytest

from pagedkv import LLM, SamplingParams
from test_engine import assert_no_leaks, hf_greedy, model, random_prompts, sampled

# Every test runs with the engine stepping serially and overlapped (conftest.engine_overlap).
pytestmark = pytest.mark.usefixtures("engine_overlap")


def test_n_samples_fork_when_the_last_prompt_chunk_is_one_token():
    # 17 tokens in a budget of 16: the prompt's last token runs alone, as a decode row (one new
    # token), and that row's sample is the first: the prompt must fork there.
    prompt = random_prompts([17], seed=20)[0]
    llm = LLM(model(), max_num_seqs=4, max_num_batched_tokens=16)
    llm.add_request(prompt, SamplingParams(n=3, max_tokens=6, temperature=0, ignore_eos=True))
    outs = []
    for _ in range(20):  # stepped by hand: a lost fork would leave generate() waiting forever
        outs += llm.step(partial=False)
    assert len(outs) == 1
    out = outs[0]
    assert [c.token_ids for c in out.outputs] == [hf_greedy("llama", tuple(prompt), 6)] * 3
    assert out.metrics.first_token_time is not None
    assert_no_leaks(llm)


def test_seeded_tokens_do_not_depend_on_finishes_around_them():
    # Different output lengths: the batch changes whenever one finishes and stays the same in
    # between, so sampling tensors are rebuilt and reused in turn; every token must still be the
    # one its sample draws alone (counter-based: offset = tokens generated so far).
    prompts = random_prompts([12, 30, 5, 19, 40, 8], seed=21)
    params = [SamplingParams(max_tokens=3 + 4 * i, temperature=0.0 if i % 3 == 2 else 0.9, top_k=20,
                             seed=200 + i, n=1 + i % 2, ignore_eos=True) for i in range(len(prompts))]
    alone = [sampled(LLM(model(), max_num_seqs=2), [p], [sp])[0] for p, sp in zip(prompts, params)]
    together = sampled(LLM(model(), max_num_seqs=16), prompts, params)
    assert together == alone
    assert [len(s[0]) for s in alone] == [sp.max_tokens for sp in params]


@pytest.mark.parametrize("finish_first", [False, True])
def test_partial_outputs_keep_the_tokens_of_their_step(finish_first):
    llm = LLM(model(), max_num_seqs=4)
    prompts = random_prompts([7, 22], seed=22)
    lengths = [4, 9] if finish_first else [9, 4]
    for p, n in zip(prompts, lengths):
        llm.add_request(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    outputs = []
    while llm.has_unfinished_requests():
        outputs += llm.step()  # token_ids not read until the run is over
    for request_id, prompt, n in zip(("0", "1"), prompts, lengths):
        mine = [o for o in outputs if o.request_id == request_id]
        expected = hf_greedy("llama", tuple(prompt), n)
        assert [o.token_ids for o in mine] == [expected[:k] for k in range(1, n + 1)]
        assert [o.finished for o in mine] == [False] * (n - 1) + [True]
        assert mine[-1].outputs[0].finish_reason == "length"
    assert_no_leaks(llm)


def test_partial_outputs_of_n_samples_are_prefixes_of_the_final_ones():
    # A request of several samples takes the general output path, one of one sample the inline
    # one; both snapshot the tokens of their step.
    llm = LLM(model(), max_num_seqs=8)
    prompts = random_prompts([9, 14], seed=23)
    llm.add_request(prompts[0], SamplingParams(n=2, max_tokens=6, temperature=0.9, seed=5, ignore_eos=True))
    llm.add_request(prompts[1], SamplingParams(max_tokens=6, temperature=0.9, seed=6, ignore_eos=True))
    outputs = []
    while llm.has_unfinished_requests():
        outputs += llm.step()
    for request_id, n in (("0", 2), ("1", 1)):
        mine = [o for o in outputs if o.request_id == request_id]
        assert [o.finished for o in mine] == [False] * 5 + [True]
        final = [c.token_ids for c in mine[-1].outputs]
        assert len(final) == n and all(len(t) == 6 for t in final)
        for step, out in enumerate(mine, start=1):
            assert [c.token_ids for c in out.outputs] == [t[:step] for t in final]
            assert [c.finish_reason for c in out.outputs] == [None if step < 6 else "length"] * n
    assert_no_leaks(llm)
