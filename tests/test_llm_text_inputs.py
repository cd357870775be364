"""pagedkv.LLM's vLLM-style text inputs (tiny random fp32 model, a real in-memory HF tokenizer):
stop strings (the text cut before them, stop_reason), prompt dicts, llm.chat with the chat
template, and the errors of bad values, after which the engine still gives HF's tokens."""

from __future__ import annotations

import pytest
import torch

from char_tokenizer import char_tokenizer
from pagedkv import LLM, SamplingParams
from test_engine import assert_no_leaks, hf_greedy, model, random_prompts

MAX_NEW = 24


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True, **kwargs)


def new_llm(tokenizer=None) -> LLM:
    return LLM(model(), tokenizer=char_tokenizer() if tokenizer is None else tokenizer, max_num_seqs=4)


def free_run(prompt: list[int]) -> tuple[list[int], str]:
    ids = hf_greedy("llama", tuple(prompt), MAX_NEW)
    return ids, char_tokenizer().decode(ids, skip_special_tokens=True)


def tokens_to_complete(ids: list[int], stop: str) -> int:
    """How many of ids it takes for their text to hold stop."""
    tok = char_tokenizer()
    return next(k for k in range(1, len(ids) + 1) if stop in tok.decode(ids[:k], skip_special_tokens=True))


@pytest.mark.usefixtures("engine_overlap")
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cuts_the_text_like_vllm(include):
    prompt = random_prompts([6], seed=21)[0]
    ids, text = free_run(prompt)
    stop = text[9:12]
    at = text.find(stop)
    llm = new_llm()
    out = llm.generate(prompt, greedy(stop=["zzzz", stop], include_stop_str_in_output=include), use_tqdm=False)[0]
    assert out.text == (text[:at + len(stop)] if include else text[:at])
    assert out.token_ids == ids[:tokens_to_complete(ids, stop)]  # the token that completed it is kept
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
    # beside a plain request, with n > 1 samples: each as alone
    outs = llm.generate([prompt, prompt], [greedy(), greedy(stop=stop, n=2)], use_tqdm=False)
    assert outs[0].token_ids == ids and outs[0].finish_reason == "length"
    assert [o.text for o in outs[1].outputs] == [text[:at]] * 2
    assert_no_leaks(llm)


def test_stop_reasons_of_stop_tokens_eos_and_length():
    prompt = random_prompts([6], seed=21)[0]
    ids, text = free_run(prompt)
    llm = new_llm()
    by_id, by_eos, by_length, absent = llm.generate([prompt] * 4, [
        greedy(stop_token_ids=[ids[3]]), greedy(stop=["\x00never"]),
        SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, stop="\x00never"), greedy(stop="\x00never")],
        use_tqdm=False)
    assert by_id.token_ids == ids[:ids.index(ids[3]) + 1] and by_id.outputs[0].stop_reason == ids[3]
    assert by_length.finish_reason == "length" and by_length.outputs[0].stop_reason is None
    assert absent.token_ids == ids and absent.text == text
    llm.eos_token_ids = frozenset([ids[2]])
    out = llm.generate(prompt, SamplingParams(max_tokens=MAX_NEW, temperature=0, stop="\x00never"), use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason is None  # EOS: vLLM's None
    assert_no_leaks(llm)


def test_stop_strings_in_a_stream():
    prompt = random_prompts([6], seed=21)[0]
    ids, text = free_run(prompt)
    stop = text[9:12]
    llm = new_llm()
    outs = list(llm.stream(prompt, greedy(stop=stop)))
    assert [len(o.token_ids) for o in outs] == list(range(1, tokens_to_complete(ids, stop) + 1))
    assert outs[-1].finished and outs[-1].text == text[:text.find(stop)]
    assert all(not o.finished for o in outs[:-1])
    assert_no_leaks(llm)


def test_prompt_dicts():
    tok = char_tokenizer()
    llm = new_llm()
    ids = random_prompts([7], seed=22)[0]
    by_text, by_ids, both = llm.generate([{"prompt": "hello"}, {"prompt_token_ids": ids},
                                          {"prompt": "shown", "prompt_token_ids": ids}], greedy(), use_tqdm=False)
    assert by_text.prompt == "hello" and by_text.prompt_token_ids == tok.encode("hello")
    assert by_text.token_ids == hf_greedy("llama", tuple(tok.encode("hello")), MAX_NEW)
    assert by_ids.prompt is None and by_ids.token_ids == hf_greedy("llama", tuple(ids), MAX_NEW)
    assert both.prompt == "shown" and both.prompt_token_ids == ids and both.token_ids == by_ids.token_ids
    one = llm.generate({"prompt_token_ids": ids}, greedy(), use_tqdm=False)  # one dict: one prompt
    assert len(one) == 1 and one[0].token_ids == by_ids.token_ids
    rid = llm.add_request({"prompt": "hello"}, greedy())
    while llm.has_unfinished_requests():
        done = [o for o in llm.step() if o.finished]
    assert done[0].request_id == rid and done[0].token_ids == by_text.token_ids
    assert_no_leaks(llm)


@pytest.mark.parametrize("prompt, error, match", [
    ({"text": "hi"}, ValueError, r"takes the keys 'prompt' \(a string\) and/or 'prompt_token_ids'.*got keys \[\"'text'\"\]"),
    ({}, ValueError, r"takes the keys 'prompt'"),
    ({"prompt": "hi", "extra": 1}, ValueError, r"got keys"),
    ({"prompt": 5}, TypeError, r"'prompt' must be a string, got int"),
    ({"prompt_token_ids": "3 4"}, TypeError, r"'prompt_token_ids' must be token ids, got a string"),
    ({"prompt_token_ids": [3, 999]}, ValueError, r"outside \[0, 255\]"),
    ({"prompt_token_ids": []}, ValueError, r"empty"),
])
def test_bad_prompt_dicts_are_refused(prompt, error, match):
    llm = new_llm()
    with pytest.raises(error, match=match):
        llm.generate([[5, 6], prompt], greedy(), use_tqdm=False)  # nothing of the batch is queued
    with pytest.raises(error, match=match):
        llm.add_request(prompt, greedy())
    ids = random_prompts([5], seed=23)[0]
    assert llm.generate(ids, greedy(), use_tqdm=False)[0].token_ids == hf_greedy("llama", tuple(ids), MAX_NEW)
    assert_no_leaks(llm)


def test_chat_renders_the_template_like_hf():
    tok = char_tokenizer()
    llm = new_llm()
    first = [{"role": "user", "content": "hello"}]
    second = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "why?"}]
    one = llm.chat(first, greedy(), use_tqdm=False)
    both = llm.chat([first, second], greedy(), use_tqdm=False)
    for conversation, out in zip([first, second], both):
        ids = tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert out.prompt == tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        assert out.prompt_token_ids == list(ids) and ids.count(tok.bos_token_id) == 1  # no BOS added twice
        assert out.token_ids == hf_greedy("llama", tuple(ids), MAX_NEW)
    assert one[0].token_ids == both[0].token_ids
    cont = llm.chat(first + [{"role": "assistant", "content": "hi"}], greedy(), use_tqdm=False,
                    add_generation_prompt=False, continue_final_message=True)[0]
    assert cont.prompt.endswith("hi")
    custom = llm.chat(first, greedy(), use_tqdm=False, chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert custom[0].prompt == "hello"
    assert_no_leaks(llm)


@pytest.mark.parametrize("case, error, match", [
    ("no tokenizer", ValueError, r"chat needs a tokenizer with a chat template: pass tokenizer="),
    ("no template", ValueError, r"the tokenizer has no chat template; pass chat_template="),
    ("not a list", TypeError, r"messages must be a non-empty list of \{'role', 'content'\} dicts"),
    ("no role", ValueError, r"message 0 of conversation 0 must be a dict with the keys 'role' and 'content'"),
    ("both prompts", ValueError, r"continue_final_message and add_generation_prompt are not compatible"),
])
def test_chat_errors(case, error, match):
    tokenizer = {"no tokenizer": False, "no template": char_tokenizer(chat_template=False)}.get(case)
    llm = LLM(model(), tokenizer=tokenizer or None, max_num_seqs=4) if case in ("no tokenizer", "no template") \
        else new_llm()
    messages = {"not a list": "hello", "no role": [{"content": "hi"}]}.get(case, [{"role": "user", "content": "hi"}])
    with pytest.raises(error, match=match):
        llm.chat(messages, greedy(), use_tqdm=False, continue_final_message=case == "both prompts")
    ids = random_prompts([5], seed=23)[0]
    assert llm.generate(ids, greedy(), use_tqdm=False)[0].token_ids == hf_greedy("llama", tuple(ids), MAX_NEW)
    assert_no_leaks(llm)


@pytest.mark.parametrize("kwargs, match", [
    (dict(stop=[""]), r"stop must be a string or a list of non-empty strings, got \[''\]"),
    (dict(stop=[3]), r"stop must be a string or a list of non-empty strings"),
    (dict(repetition_penalty=0.0), r"repetition_penalty must be a finite number > 0 \(1 = off\), got 0.0"),
    (dict(repetition_penalty=float("inf")), r"repetition_penalty must be a finite number > 0"),
    (dict(presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\] \(0 = off\), got 2.5"),
    (dict(frequency_penalty=float("nan")), r"frequency_penalty must be in \[-2, 2\]"),
    (dict(frequency_penalty="1"), r"frequency_penalty must be in \[-2, 2\]"),
    (dict(min_p=1.5), r"min_p must be in \[0, 1\] \(0 = off\), got 1.5"),
    (dict(logprobs=21), r"logprobs must be None or an int in \[0, 20\]"),
    (dict(logprobs=True), r"logprobs must be None or an int in \[0, 20\]"),
    (dict(top_k=-2), r"top_k must be an int >= -1 \(-1 or 0 = off\), got -2"),
])
def test_bad_sampling_values_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_stop_strings_need_a_tokenizer():
    llm = LLM(model(), max_num_seqs=4)
    with pytest.raises(ValueError, match=r"stop strings need a tokenizer \(pass tokenizer= to pagedkv.LLM\)"):
        llm.generate([3, 4, 5], greedy(stop="x"), use_tqdm=False)
    out = llm.generate([3, 4, 5], greedy(stop_token_ids=[7]), use_tqdm=False)[0]
    assert out.token_ids[:3] == hf_greedy("llama", (3, 4, 5), MAX_NEW)[:3]
    assert_no_leaks(llm)
    assert torch.is_tensor(torch.tensor(out.token_ids))
