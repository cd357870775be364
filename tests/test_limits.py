"""docs/limits.md's table, one test (or group) per row, for pagedkv.generate,
model.generate after pagedkv.patch, and pagedkv.LLM where the row applies. Each checks the
exception's type and that its message names what was wrong and what is allowed, then that no
cache block is held and that the next valid call gives HF's greedy tokens (tiny fp32 model)."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import (BloomConfig, BloomForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig,
                          LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM)

import pagedkv
from pagedkv import LLM, SamplingParams
from limits import (GREEDY, SMALL, assert_cache_clean, assert_generate_works, assert_llm_works, gen,
                    hf_greedy, model, new_llm, prompt)
from models import tiny_model


# -- empty prompt ---------------------------------------------------------------------------------
def test_empty_prompt_generate(gen):
    with pytest.raises(ValueError, match=r"input_ids is empty; every prompt needs at least one token"):
        gen(torch.zeros(1, 0, dtype=torch.int64), max_new_tokens=2)
    ids = torch.tensor([prompt(3), [0, 0, 0]])
    with pytest.raises(ValueError, match=r"row\(s\) \[1\] of attention_mask are empty; every prompt needs"):
        gen(ids, attention_mask=torch.tensor([[1, 1, 1], [0, 0, 0]]), max_new_tokens=2)
    assert_generate_works(gen)


def test_empty_prompt_llm():
    llm = new_llm()
    with pytest.raises(ValueError, match=r"the prompt is empty; it needs at least one token"):
        llm.add_request([], GREEDY)
    with pytest.raises(ValueError, match=r"the prompt is empty"):
        llm.generate([prompt(5), []], GREEDY, use_tqdm=False)  # the good one is not queued either
    assert_llm_works(llm)


# -- prompt longer than the cache or the model's max length ---------------------------------------
@pytest.mark.parametrize("length, kwargs, match", [
    (8, dict(max_new_tokens=600), r"reach 608 tokens .* max_position_embeddings is 512; prompt \+ "
                                  r"max_new_tokens must be <= 512"),
    (510, dict(max_new_tokens=3), r"reach 513 tokens .* must be <= 512"),
    (8, dict(max_length=8), r"max_length=8 with prompts of length 8 leaves no token to generate; "
                            r"it must allow >= 1"),
])
def test_too_long_generate(gen, length, kwargs, match):
    with pytest.raises(ValueError, match=match):
        gen(torch.tensor([prompt(length)]), do_sample=False, **kwargs)
    assert_generate_works(gen)


def test_too_long_llm():
    llm = new_llm()  # 16 blocks of 16: max_model_len 256
    with pytest.raises(ValueError, match=r"the prompt has 256 tokens; at most 255 fit \(max_model_len 256"):
        llm.add_request(prompt(256), GREEDY)
    with pytest.raises(ValueError, match=r"the prompt has 300 tokens; at most 255 fit .* \(prompt 1 of 2\)"):
        llm.generate([prompt(4), prompt(300)], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=r"max_model_len 1000 is more than the model's limit \(512\) "
                                         r"or the KV cache's capacity \(256 tokens\)"):
        new_llm(max_model_len=1000)
    assert_llm_works(llm)


# -- models pagedkv does not run ------------------------------------------------------------------
UNSUPPORTED = {
    "gpt2": (lambda: GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)),
             r"model_type 'gpt2' is not supported; supported: llama, qwen2, qwen3, mistral"),
    "alibi (bloom)": (lambda: BloomForCausalLM(BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=2)),
                      r"model_type 'bloom' is not supported; supported: llama"),
    "sliding-window layers": (
        lambda: Qwen2ForCausalLM(Qwen2Config(**SMALL, layer_types=["sliding_attention"])),
        r"layer_types \['sliding_attention'\] are not supported; supported: full_attention"),
    # (rope "dynamic" and "longrope" run since: tests/test_rope_by_length.py)
    "proportional rope": (lambda: LlamaForCausalLM(LlamaConfig(**SMALL, rope_scaling={"rope_type": "proportional", "factor": 2.0})),
                          r"rope type 'proportional' is not supported; supported: default, linear, llama3, yarn, dynamic, longrope"),
    "head_dim 8": (lambda: LlamaForCausalLM(LlamaConfig(**{**SMALL, "hidden_size": 16})),
                   r"head_dim 8 is not supported; supported: 64, 80, 96, 128, 256"),
    "float64": (lambda: LlamaForCausalLM(LlamaConfig(**SMALL)).double(),
                r"parameter dtypes \['torch.float64'\] are not supported; supported: one of torch.float32"),
    "spread over devices": (lambda: _spread(LlamaForCausalLM(LlamaConfig(**SMALL))),
                            r"spread over \['cpu', 'meta'\]; pagedkv needs it on one device"),
}


def _spread(m):
    m.lm_head.to("meta")
    return m


@pytest.mark.parametrize("name", list(UNSUPPORTED))
def test_unsupported_model(name):
    make, match = UNSUPPORTED[name]
    bad = make()
    ids = torch.tensor([[3, 4, 5]])
    with pytest.raises(pagedkv.UnsupportedModel, match=match):
        pagedkv.generate(bad, ids, max_new_tokens=2)
    with pytest.raises(pagedkv.UnsupportedModel, match=match):
        pagedkv.patch(bad)
    with pytest.raises(pagedkv.UnsupportedModel, match=match):
        LLM(bad, num_kv_blocks=4)
    assert pagedkv.kv_cache_of(bad) is None and not hasattr(bad, "_pagedkv_original_generate")
    assert_generate_works(functools.partial(pagedkv.generate, model()))


@pytest.mark.cuda
def test_sliding_window_runs_past_it_on_cuda():
    """The CUDA kernels window (they used to, by refusing longer sequences): HF's tokens past it."""
    mistral = MistralForCausalLM(MistralConfig(**SMALL, sliding_window=16)).cuda().eval()
    llm = LLM(mistral, num_kv_blocks=8)
    assert llm.max_model_len > 16
    ids = torch.tensor([[3, 9, 4, 5] * 3], device="cuda")
    expected = mistral.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(pagedkv.generate(mistral, ids, max_new_tokens=12, do_sample=False, eos_token_id=None,
                                        pad_token_id=0), expected)
    out = llm.generate([ids[0].tolist()], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.token_ids == expected[0, 12:].tolist()
    assert_cache_clean(llm.cache)


# -- wrong dtype, device or shape of inputs -------------------------------------------------------
def test_wrong_inputs_generate(gen):
    ids = torch.tensor([prompt(5)])
    cases = [
        (ValueError, r"input_ids has dtype torch.float32; allowed: torch.int64, torch.int32", dict(input_ids=ids.float())),
        (ValueError, r"input_ids must be a 2-D tensor \[batch, prompt_length\] .* got Tensor \(5,\)", dict(input_ids=ids[0])),
        (ValueError, r"input_ids must be a 2-D tensor .* got list", dict(input_ids=ids.tolist())),
        (ValueError, r"input_ids hold ids in \[\d+, 300\]; allowed: \[0, 255\]", dict(input_ids=torch.cat([ids, ids.new_tensor([[300]])], 1))),
        (ValueError, r"input_ids is on meta but pagedkv runs the model on cpu; move them there", dict(input_ids=ids.to("meta"))),
        (ValueError, r"attention_mask has shape \(1, 4\) but input_ids has \(1, 5\); they must match",
         dict(input_ids=ids, attention_mask=torch.ones(1, 4, dtype=torch.int64))),
        (TypeError, r"attention_mask must be a tensor .* got list", dict(input_ids=ids, attention_mask=[[1] * 5])),
        (ValueError, r"attention_mask must be left-padded",
         dict(input_ids=ids, attention_mask=torch.tensor([[1, 1, 1, 1, 0]]))),
    ]
    for error, match, kwargs in cases:
        with pytest.raises(error, match=match):
            gen(kwargs.pop("input_ids"), max_new_tokens=2, **kwargs)
    assert_generate_works(gen)


def test_wrong_inputs_llm():
    llm = new_llm()
    cases = [
        (TypeError, r"a prompt tensor must hold integer token ids, got dtype torch.float32", torch.tensor([3.0, 4.0])),
        (TypeError, r"token ids must be ints, got 3.5 \(float\)", [3, 3.5]),
        (TypeError, r"a prompt is a string or a list of token ids, got NoneType", None),
        (ValueError, r"a prompt tensor must be \[n\] or \[1, n\], got shape \(2, 2\); pass a batch as a list",
         torch.tensor([[3, 4], [5, 6]])),
        (ValueError, r"prompt token ids \[300, -1\] are outside \[0, 255\]", [3, 300, -1]),
        (ValueError, r"a string prompt needs a tokenizer", "hello"),
    ]
    for error, match, bad in cases:
        with pytest.raises(error, match=match):
            llm.add_request(bad, GREEDY)
    with pytest.raises(TypeError, match=r"sampling_params must be a SamplingParams, got dict"):
        llm.add_request([3, 4], {"max_tokens": 2})
    # An integer tensor [1, n] is a prompt (as a tokenizer returns it).
    ids = prompt(7, seed=5)
    assert llm.generate(torch.tensor([ids]), GREEDY, use_tqdm=False)[0].token_ids == hf_greedy(ids)
    assert_llm_works(llm)


# -- a batch on mixed devices ---------------------------------------------------------------------
def test_mixed_devices_generate(gen):
    ids = torch.tensor([prompt(5)])
    with pytest.raises(ValueError, match=r"attention_mask is on meta but input_ids is on cpu; both must be "
                                         r"on the model's device"):
        gen(ids, attention_mask=torch.ones(1, 5, dtype=torch.int64, device="meta"), max_new_tokens=2)
    assert_generate_works(gen)


def test_mixed_devices_llm():
    """Prompt tensors may be on any device (their ids are read on the host), but not on one that
    holds no data; a bad one in a batch queues none of it."""
    llm = new_llm()
    with pytest.raises(ValueError, match=r"a prompt tensor is on the meta device \(it holds no token ids\)"):
        llm.generate([torch.tensor(prompt(4)), torch.tensor([3, 4], device="meta")], GREEDY, use_tqdm=False)
    assert_llm_works(llm)


# -- max_new_tokens <= 0 --------------------------------------------------------------------------
@pytest.mark.parametrize("n", [0, -3])
def test_no_new_tokens_generate(gen, n):
    # HF's own check of the generation config comes first; its message names the setting.
    with pytest.raises(ValueError, match=rf"max_new_tokens` must be greater than 0, but is {n}"):
        gen(torch.tensor([prompt(5)]), max_new_tokens=n)
    assert_generate_works(gen)


@pytest.mark.parametrize("n", [0, -3, 2.5])
def test_no_new_tokens_llm(n):
    llm = new_llm()
    with pytest.raises(ValueError, match=rf"max_tokens must be an int >= 1, got {n}"):
        llm.add_request(prompt(3), SamplingParams(max_tokens=n))
    assert_llm_works(llm)


# -- invalid sampling values ----------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, match", [
    (dict(do_sample=True, temperature=-1.0), r"temperature=-1.0; it must be > 0 with do_sample=True"),
    (dict(do_sample=False, temperature=-1.0), r"temperature=-1.0; it must be .* \(>= 0 when greedy"),
    (dict(do_sample=True, temperature=float("nan")), r"temperature=nan; it must be > 0"),
    (dict(do_sample=True, top_p=0.0), r"top_p=0.0; it must be in \(0, 1\]"),
    (dict(do_sample=True, top_p=1.5), r"top_p=1.5; it must be in \(0, 1\]"),
    (dict(do_sample=False, top_p=1.5), r"top_p=1.5; it must be in \(0, 1\]"),
    (dict(do_sample=True, top_k=-2), r"top_k=-2; it must be >= 0"),
    (dict(repetition_penalty=0.0), r"repetition_penalty=0.0; it must be > 0"),
    (dict(repetition_penalty=float("nan")), r"repetition_penalty=nan; it must be > 0"),
])
def test_invalid_sampling_generate(gen, kwargs, match):
    with pytest.raises(ValueError, match=match):
        gen(torch.tensor([prompt(5)]), max_new_tokens=2, **kwargs)
    assert_generate_works(gen)


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-0.5), r"temperature must be >= 0 \(0 = greedy\), got -0.5"),
    (dict(temperature=float("nan")), r"temperature must be >= 0 \(0 = greedy\), got nan"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\] \(1 = off\), got 0.0"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\] \(1 = off\), got 1.5"),
    (dict(top_k=-2), r"top_k must be an int >= -1 \(-1 or 0 = off\), got -2"),
    (dict(n=0), r"n must be an int >= 1, got 0"),
    (dict(seed=-3), r"seed must be None or an int in \[0, 2\*\*62\), got -3"),
])
def test_invalid_sampling_llm(kwargs, match):
    llm = new_llm()
    with pytest.raises(ValueError, match=match):
        llm.add_request(prompt(3), SamplingParams(**kwargs))
    assert_llm_works(llm)


def test_cuda_graphs_asked_off_cuda_are_refused():
    """use_cuda_graphs=True on a CPU model: a ValueError naming the argument and the device from
    generate() and LLM, and nothing left held."""
    model = tiny_model("llama")
    ids = torch.tensor([[5, 6, 7]])
    for call in (lambda: pagedkv.generate(model, ids, max_new_tokens=2, use_cuda_graphs=True),
                 lambda: pagedkv.LLM(model, use_cuda_graphs=True, num_kv_blocks=8)):
        with pytest.raises(ValueError, match=r"use_cuda_graphs=True needs a model on a CUDA device, got cpu"):
            call()
    cache = pagedkv.kv_cache_of(model)
    assert cache is None or cache.num_free_blocks == cache.num_blocks
    assert pagedkv.generate(model, ids, max_new_tokens=2, do_sample=False).shape == (1, 5)
