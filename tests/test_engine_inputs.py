"""What pagedkv.LLM's batch calls take as prompts (issue 29): a 1-D integer tensor or numpy array
is one prompt, a 2-D one [B, n] is B prompts; and a batch is queued all or nothing, its automatic
request ids skipping ids a caller gave (tiny random model, CPU, tokens checked against HF)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedkv import LLM, SamplingParams
from test_engine import assert_no_leaks, hf_greedy, model, random_prompts

pytestmark = pytest.mark.usefixtures("engine_overlap")

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def greedy(prompt: list[int]) -> list[int]:
    return hf_greedy("llama", tuple(prompt), 6)


def run(llm: LLM, prompts, api: str):
    """(prompt ids, tokens) of each finished output, in the order of the prompts."""
    if api == "generate":
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    else:
        outs = sorted((o for o in llm.stream(prompts, GREEDY) if o.finished), key=lambda o: int(o.request_id))
    return [(o.prompt_token_ids, o.token_ids) for o in outs]


@pytest.mark.parametrize("api", ["generate", "stream"])
@pytest.mark.parametrize("kind", ["tensor", "int32 tensor", "numpy", "numpy ints"])
def test_a_1d_array_is_one_prompt(kind, api):
    prompt = random_prompts([9], seed=70)[0]
    given = {"tensor": torch.tensor(prompt), "int32 tensor": torch.tensor(prompt, dtype=torch.int32),
             "numpy": np.array(prompt), "numpy ints": [np.int64(t) for t in prompt]}[kind]
    llm = LLM(model(), max_num_seqs=4)
    assert run(llm, given, api) == [(prompt, greedy(prompt))]
    assert_no_leaks(llm)


@pytest.mark.parametrize("api", ["generate", "stream"])
@pytest.mark.parametrize("kind", ["tensor", "numpy"])
def test_a_2d_array_is_a_batch_of_its_rows(kind, api):
    prompts = random_prompts([8, 8, 8], seed=71)
    given = torch.tensor(prompts) if kind == "tensor" else np.array(prompts)
    llm = LLM(model(), max_num_seqs=4)
    assert run(llm, given, api) == [(p, greedy(p)) for p in prompts]
    assert_no_leaks(llm)


@pytest.mark.parametrize("given, error, match", [
    (torch.zeros(2, 2, 3, dtype=torch.int64), ValueError, r"\[n\] \(one prompt\) or \[B, n\]"),
    (np.zeros((1, 2, 3), dtype=np.int64), ValueError, r"\[n\] \(one prompt\) or \[B, n\]"),
    (torch.tensor([3.0, 4.0]), TypeError, "integer token ids"),
    (np.array([3.5, 4.0]), TypeError, "token ids must be ints"),
])
def test_other_arrays_are_refused_and_queue_nothing(given, error, match):
    llm = LLM(model(), max_num_seqs=4)
    with pytest.raises(error, match=match):
        llm.generate(given, GREEDY, use_tqdm=False)
    assert_no_leaks(llm)
    assert not llm._requests


def test_auto_ids_skip_an_id_a_caller_gave():
    llm = LLM(model(), max_num_seqs=4)
    mine = random_prompts([5], seed=72)[0]
    prompts = random_prompts([7, 4, 11, 6, 9], seed=73)
    assert llm.add_request(mine, GREEDY, request_id="3") == "3"
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)  # its ids would reach "3"
    assert [o.token_ids for o in outs] == [greedy(p) for p in prompts]
    assert "3" not in [o.request_id for o in outs] and len({o.request_id for o in outs}) == 5
    assert llm.add_request(mine, GREEDY) not in ("3", *[o.request_id for o in outs])
    finished = {}
    while llm.has_unfinished_requests():
        finished.update({o.request_id: o.token_ids for o in llm.step() if o.finished})
    # "3" ran (and maybe finished) inside generate's steps: its output waited for step().
    assert len(finished) == 2 and "3" in finished
    assert list(finished.values()) == [greedy(mine)] * 2
    assert_no_leaks(llm)


def test_a_batch_is_queued_all_or_nothing():
    llm = LLM(model(), max_num_seqs=4)
    good = random_prompts([5, 6], seed=74)
    with pytest.raises(ValueError, match=r"prompt 2 of 3"):
        llm.generate(good + [[]], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompt 1 of 2"):
        list(llm.stream([good[0], [10**6]], GREEDY))
    assert not llm.has_unfinished_requests() and not llm._requests
    assert run(llm, good, "generate") == [(p, greedy(p)) for p in good]
    assert_no_leaks(llm)
