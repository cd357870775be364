"""Sliding-window layers past their window: the native decoder (Mistral, Qwen2 with some full
layers, CWM, Phi-3, OLMo-3) and the fallback path (Gemma-2 with its attention softcap) pass each
layer's window (and softcap) to the paged attention kernels, so sequences longer than the window
give HF's greedy tokens through generate (a left-padded batch) and LLM (prompts chunked by an
8-token budget), on the CPU and on CUDA (fp32), holding no block after."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import pagedkv
import tp_worker
from conftest import DEVICES
from models import widen
from pagedkv.models import registry
from pagedkv.models.checkpoint_shards import open_checkpoint, read_shard
from pagedkv.models.llama import extract_weights
from pagedkv.models.sharding import shard_weights
from test_engine import assert_no_leaks, assert_nothing_held, random_prompts

WINDOW = 8  # the prompts (5 and 19 tokens) and 40 new tokens run far past it
NEW = 40
SMALL = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
             num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=512,
             bos_token_id=1, eos_token_id=2, pad_token_id=0)
ALTERNATING = ["sliding_attention", "full_attention", "sliding_attention"]
# name -> (model_type, config fields beyond SMALL, path): which layers have a window in comments.
CASES = {
    "mistral": ("mistral", dict(sliding_window=WINDOW), "native"),  # every layer
    # layers >= max_window_layers slide (HF's Qwen2 config): layer 0 full, layers 1 and 2 windowed
    "qwen2": ("qwen2", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1), "native"),
    "cwm": ("cwm", dict(sliding_window=WINDOW, layer_types=ALTERNATING), "native"),  # as its layer_types say
    "phi3": ("phi3", dict(sliding_window=WINDOW), "native"),  # every layer (one mask for all)
    # the attention module passes its window and softcap to the attention function (HF's kwargs)
    "gemma2": ("gemma2", dict(sliding_window=WINDOW, layer_types=ALTERNATING, attn_logit_softcapping=5.0,
                              final_logit_softcapping=4.0, query_pre_attn_scalar=144, tie_word_embeddings=False),
               "fallback"),
    "olmo3": ("olmo3", dict(sliding_window=WINDOW, layer_types=ALTERNATING), "native"),  # models/olmo2.py
}
GREEDY = dict(max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)


@pytest.fixture(autouse=True)
def gemma2_on_the_fallback(monkeypatch):
    """Gemma-2 has a native decoder (models/gemma.py); put it on the fallback path here, the one
    fallback type whose attention is softcapped."""
    if "gemma2" not in registry.FALLBACK_MODEL_TYPES:
        monkeypatch.setattr(registry, "FALLBACK_MODEL_TYPES", registry.FALLBACK_MODEL_TYPES + ("gemma2",))


def tiny(name: str, device: str = "cpu", **fields):
    """Weights widened, norm weights jittered (Gemma's zero-initialised ones give one token);
    Gemma-2's embedding a quarter of that, so its normed layer outputs move the residual, and its
    HF attention eager (transformers 5.17's default sdpa drops the softcap)."""
    model_type, own, _ = CASES[name]
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**SMALL, **own, **fields})
    eager = dict(attn_implementation="eager") if model_type == "gemma2" else {}
    model = widen(AutoModelForCausalLM.from_config(config, **eager), norms=True)
    if model_type == "gemma2":
        with torch.no_grad():
            model.model.embed_tokens.weight.div_(4)
    return model.to(device).eval()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(CASES))
def test_generate_past_the_window_gives_hf_greedy_tokens(name, device):
    model = tiny(name, device)
    assert pagedkv.support_path(model) == CASES[name][2], pagedkv.unsupported_reason(model)
    ids, mask = tp_worker.left_padded([5, 19], 256, device, seed=1)
    expected = model.generate(ids, attention_mask=mask, **GREEDY)  # [2, 19 + 40]
    assert len(set(expected[:, ids.shape[1]:].flatten().tolist())) >= 4, expected
    whole = tiny(name, device, sliding_window=512).generate(ids, attention_mask=mask, **GREEDY)
    assert not torch.equal(whole, expected)  # the window changes HF's tokens here
    got = pagedkv.generate(model, ids, attention_mask=mask, **GREEDY)
    assert torch.equal(got, expected)
    assert_nothing_held(model)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(CASES))
def test_llm_past_the_window_gives_hf_greedy_tokens(name, device):
    """Prefill chunks of 8 tokens over cached context past the window, decode rows in the same
    steps."""
    model = tiny(name, device)
    prompts = random_prompts([5, 19])
    llm = pagedkv.LLM(model, max_num_seqs=2, max_num_batched_tokens=8)
    assert llm.max_model_len == 512  # not capped at the window
    params = pagedkv.SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    for prompt, tokens in zip(prompts, got):
        expected = model.generate(torch.tensor([prompt], device=device), **GREEDY)
        assert tokens == expected[0, len(prompt):].tolist()
    assert_no_leaks(llm)


@pytest.mark.parametrize("name, windows", [("mistral", [WINDOW] * 3), ("phi3", [WINDOW] * 3),
                                           ("qwen2", [0, WINDOW, WINDOW]), ("cwm", [WINDOW, 0, WINDOW])])
def test_each_layer_gets_hf_window_and_shards_keep_it(name, windows, tmp_path):
    """The layers HF's masks window (models/windows.py), also in tensor-parallel shards, taken from
    the model or read from its checkpoint."""
    model = tiny(name, num_key_value_heads=2)
    full = extract_weights(model)
    assert full.windows == windows
    model.save_pretrained(tmp_path)
    skeleton, reader = open_checkpoint(tmp_path, torch.float32)
    cpu = torch.device("cpu")
    for rank in range(2):
        assert shard_weights(full, rank, 2, cpu).windows == windows
        assert read_shard(skeleton, reader, rank, 2, cpu, torch.float32).windows == windows


@pytest.mark.parametrize("device", DEVICES)
def test_attention_softcap_runs(device):
    """The fallback used to refuse attn_logit_softcapping (on CUDA until its kernels had it)."""
    assert pagedkv.unsupported_reason(tiny("gemma2", device)) is None
