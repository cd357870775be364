"""Shared by the Limits-and-errors tests (test_limits.py, test_limits_faults.py): a tiny fp32
Llama, HF's greedy tokens as the reference, both generate() entry points, and the checks that
follow every error: no cache block held, and the next valid call equals HF."""

from __future__ import annotations

import functools

import pytest
import torch

import pagedkv
from pagedkv import LLM, SamplingParams
from models import tiny_model

MAX_NEW = 6
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
SMALL = dict(vocab_size=64, hidden_size=128, intermediate_size=64, num_hidden_layers=1,
             num_attention_heads=2, num_key_value_heads=1)  # head_dim 64


@functools.lru_cache(maxsize=None)
def model():
    return tiny_model("llama")


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_greedy(ids: list[int], max_new: int = MAX_NEW) -> list[int]:
    """HF's own generate (also on a patched model), greedy, EOS ignored."""
    return list(_hf_greedy(tuple(ids), max_new))


@functools.lru_cache(maxsize=None)
def _hf_greedy(ids: tuple[int, ...], max_new: int) -> tuple[int, ...]:
    out = type(model()).generate(model(), torch.tensor([ids]), max_new_tokens=max_new,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
    return tuple(out[0, len(ids):].tolist())


@pytest.fixture(params=["pagedkv.generate", "patched model.generate"])
def gen(request):
    """generate(input_ids, **kwargs) through pagedkv.generate or a patched model.generate."""
    m = model()
    if request.param == "pagedkv.generate":
        yield functools.partial(pagedkv.generate, m)
    else:
        pagedkv.patch(m)
        yield m.generate
        pagedkv.unpatch(m)


def assert_cache_clean(cache: pagedkv.KVCache | None) -> None:
    if cache is not None:
        assert len(cache.manager) == 0, "sequences left in the cache"
        assert cache.num_free_blocks == cache.num_blocks, "blocks leaked"


def assert_generate_works(gen) -> None:
    """No block held, and a valid call (two rows, left-padded) equals HF."""
    assert_cache_clean(pagedkv.kv_cache_of(model()))
    a, b = prompt(9, seed=1), prompt(4, seed=2)
    ids = torch.tensor([a, [0] * 5 + b])
    mask = torch.tensor([[1] * 9, [0] * 5 + [1] * 4])
    out = gen(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None)
    assert out[0, 9:].tolist() == hf_greedy(a) and out[1, 9:].tolist() == hf_greedy(b)
    assert_cache_clean(pagedkv.kv_cache_of(model()))


def new_llm(**kwargs) -> LLM:
    return LLM(model(), **{"num_kv_blocks": 16, "max_num_seqs": 4, **kwargs})


def assert_llm_works(llm: LLM) -> None:
    """Nothing queued or held, and a valid batch equals HF."""
    assert not llm.has_unfinished_requests() and not llm._requests
    assert_cache_clean(llm.cache)
    prompts = [prompt(11, seed=3), prompt(2, seed=4)]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == [hf_greedy(p) for p in prompts]
    assert_cache_clean(llm.cache)
