"""OLMo-3 (models/olmo2.py: OLMo-2's layers, sliding-window layers by config.layer_types, a
rotary table per layer type) and OLMoE (models/llama.py's decoder with OLMo-2's q/k norms over all
heads and layers/moe.py's experts) natively: tiny random fp32 models with each real config's
structure (OLMo-3: window 8 on 2 of 3 layers under longer sequences, yarn on the full layers only,
untied; OLMoE: many experts, top-8, norm_topk_prob off as OLMoE-1B-7B and on, untied) give HF's
greedy tokens through generate, patched generate and LLM (chunked prefill, preemption), and hold
no block after; what the decoders do not run is refused by name."""

from __future__ import annotations

import pytest
import torch

import pagedkv
import tp_worker
from conftest import DEVICES
from models import random_model
from pagedkv.layers import moe
from pagedkv.models import olmo2, registry
from pagedkv.models.llama import DecoderWeights, PagedDecoder
from pagedkv.runtime.model import prepared
from test_engine import (assert_generate_gives_hf_tokens_up_to_near_tie, assert_llm_gives_hf_greedy_tokens,
                         assert_native_generate_gives_hf_tokens, assert_nothing_held, random_prompts)

COMMON = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)  # head_dim 64
WINDOW = 8  # the prompts (5, 19 tokens) and 16 new tokens run past it
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"]  # OLMo-3: 3 sliding, 1 full
# OLMo-3 7B's rope: yarn on the full layers only (HF's rope_scaling goes to full_attention)
ROPE = {"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
        "full_attention": dict(rope_type="yarn", rope_theta=500000.0, factor=8.0,
                               original_max_position_embeddings=64, attention_factor=1.2)}
OLMOE = dict(num_experts=64, num_experts_per_tok=8, intermediate_size=64)  # OLMoE-1B-7B's experts
# name -> (model_type, config fields beyond COMMON)
CASES = {
    "olmo3": ("olmo3", dict(sliding_window=WINDOW, layer_types=LAYER_TYPES, rope_parameters=ROPE)),
    "olmoe": ("olmoe", dict(OLMOE, norm_topk_prob=False)),
    "olmoe_norm": ("olmoe", dict(OLMOE, norm_topk_prob=True, num_experts=16)),
}
WEIGHTS = {"olmo3": olmo2.Olmo2Weights, "olmoe": DecoderWeights, "olmoe_norm": DecoderWeights}
DECODERS = {"olmo3": olmo2.Olmo2Decoder, "olmoe": PagedDecoder, "olmoe_norm": PagedDecoder}
GREEDY = dict(max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
# The two ways of running the experts: the kernels (decode, CUDA graphs) and grouped by expert.
PATHS = {"kernels": 10**9, "grouped": 0}


def tiny(name: str, device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0,
         flat_router: bool = True, **fields):
    model_type, own = CASES[name]
    model = random_model(model_type, {**COMMON, **own, **fields}, seed=seed, norms=True)  # CPU fp32
    if model_type == "olmoe" and flat_router:  # the top 8 hold part of the mass: norm_topk_prob shows
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.gate.weight.div_(8)
    return model.to(device=device, dtype=dtype).eval()


def hf_tokens(model):
    ids, mask = tp_worker.left_padded([5, 19], 256, model.device, seed=1)
    return model.generate(ids, attention_mask=mask, **GREEDY)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(CASES))
def test_generate_gives_hf_greedy_tokens(name, device, path, monkeypatch):
    if path == "grouped" and CASES[name][0] != "olmoe":
        pytest.skip("no experts")
    monkeypatch.setattr(moe, "GROUPED_MIN_PAIRS", PATHS[path])
    assert_native_generate_gives_hf_tokens(tiny(name, device), WEIGHTS[name], GREEDY)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(CASES))
def test_patched_generate_gives_hf_greedy_tokens(name, device):
    model = tiny(name, device)
    ids, mask = tp_worker.left_padded([5, 19], 256, device, seed=1)
    expected = model.generate(ids, attention_mask=mask, **GREEDY)
    pagedkv.patch(model)
    try:
        got = model.generate(ids, attention_mask=mask, **GREEDY)
        assert type(prepared(model).weights) is WEIGHTS[name]
    finally:
        pagedkv.unpatch(model)
    assert torch.equal(got, expected)
    assert_nothing_held(model)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(CASES))
def test_llm_gives_hf_greedy_tokens(name, device):
    """Prompts chunked by an 8-token step budget: prefill chunks over cached context (past the
    window), decode rows in the same steps; too few blocks for all three: preemption."""
    model = tiny(name, device)
    prompts = random_prompts([5, 19, 12])
    llm = pagedkv.LLM(model, max_num_seqs=3, max_num_batched_tokens=8, num_kv_blocks=4)
    assert type(llm.runner.decoder) is DECODERS[name]
    assert_llm_gives_hf_greedy_tokens(llm, model, prompts, GREEDY)
    assert llm.stats.num_preemptions > 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(CASES))
def test_bf16_gives_hf_tokens_up_to_a_near_tie(name, device):
    """The widened (peaked) router: a flat one over 64 experts puts bf16's top-8 choices at
    near-ties (one rounding swaps an expert), which the allowance on the logits cannot see."""
    model = tiny(name, device, torch.bfloat16, flat_router=False)
    assert_generate_gives_hf_tokens_up_to_near_tie(model, GREEDY)


@pytest.mark.parametrize("fields", [
    dict(layer_types=["full_attention"] * 3),  # no window
    dict(rope_parameters={k: ROPE["sliding_attention"] for k in ROPE}),  # one rope for every layer
], ids=["window", "rope_per_layer_type"])
def test_olmo3_s_window_and_rope_tables_change_the_tokens(fields):
    """Without them HF's tokens differ, so the greedy tests catch a decoder that left one out."""
    assert not torch.equal(hf_tokens(tiny("olmo3")), hf_tokens(tiny("olmo3", **fields)))


def test_olmoe_s_norm_topk_prob_changes_the_tokens():
    assert not torch.equal(hf_tokens(tiny("olmoe")), hf_tokens(tiny("olmoe", norm_topk_prob=True)))


def test_native_types_left_the_fallback():
    for model_type in ("olmo3", "olmoe"):
        assert model_type in registry.NATIVE_MODEL_TYPES
        assert model_type not in registry.FALLBACK_MODEL_TYPES
        assert model_type not in registry.OTHER_DECODERS


@pytest.mark.parametrize("name, words", [("olmo3", "'olmo3' is not sharded"), ("olmoe", "mixture-of-experts")])
def test_tensor_parallel_refuses_them_by_name(name, words):
    with pytest.raises(pagedkv.UnsupportedModel, match=words):
        pagedkv.tensor_parallel(tiny(name))


@pytest.mark.parametrize("name, fields, words", [
    ("olmoe", dict(clip_qkv=2.0), "clip_qkv=2.0"),
    ("olmo3", dict(rope_parameters=dict(ROPE, full_attention=dict(rope_type="dynamic", factor=2.0,
                                                                  rope_theta=10000.0))), "rope type 'dynamic'"),
])
def test_what_the_decoders_do_not_run_is_refused(name, fields, words):
    model = tiny(name, **fields)
    reason = pagedkv.unsupported_reason(model)
    assert reason is not None and words in reason, reason
    with pytest.raises(pagedkv.UnsupportedModel, match=type(model).__name__):
        pagedkv.generate(model, torch.tensor([[3, 4, 5]]), max_new_tokens=2)
