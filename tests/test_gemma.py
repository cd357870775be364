"""Gemma, Gemma-2 and Gemma-3 (text) on pagedkv's own decoder (models/gemma.py): tiny random fp32
models with each one's structural features (head_dim 256, GQA, tied embeddings, sandwich norms,
window 8 on alternating layers under longer sequences, attention and final softcaps,
query_pre_attn_scalar, Gemma-3's q/k norms and per-layer-type rope bases) give HF's greedy tokens
through generate and LLM and hold no block after; what the decoder does not run is refused by name."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import pagedkv
import tp_worker
from conftest import DEVICES
from models import widen
from pagedkv.models import gemma, registry
from pagedkv.runtime.model import prepared
from test_engine import (assert_llm_gives_hf_greedy_tokens, assert_native_generate_gives_hf_tokens,
                         assert_nothing_held, random_prompts)

COMMON = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=256, max_position_embeddings=512,
              bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True)
ALTERNATING = ["sliding_attention", "full_attention", "sliding_attention"]
WINDOW = 8  # the prompts (5, 19 tokens) and 16 new tokens run past it
# name -> (model_type, config fields beyond COMMON). Gemma-2/3 untied: with tied embeddings their
# sandwich-normed tiny layers barely move the residual off the (sqrt(D)-scaled) token embedding,
# and the tied head then repeats one token whatever the prompt.
CASES = {
    "gemma": ("gemma", dict(attention_bias=True)),
    "gemma2": ("gemma2", dict(sliding_window=WINDOW, layer_types=ALTERNATING, attn_logit_softcapping=5.0,
                              final_logit_softcapping=4.0, query_pre_attn_scalar=144, tie_word_embeddings=False)),
    "gemma3_text": ("gemma3_text", dict(sliding_window=WINDOW, layer_types=ALTERNATING, query_pre_attn_scalar=144,
                                        final_logit_softcapping=6.0, tie_word_embeddings=False)),
}
GREEDY = dict(max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)


def tiny(name: str, device: str = "cpu", seed: int = 0, **fields):
    """Weights widened and norm weights jittered (Gemma's zero-initialised norms give one token);
    Gemma-2/3's embedding a quarter of that, so the layers' normed outputs move the residual."""
    model_type, own = CASES[name]
    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **{**COMMON, **own, **fields})
    # Gemma-2 in transformers 5.17 defaults to sdpa, which drops the attention softcap without a
    # word (5.24 refuses sdpa for it): HF's eager attention is the model's reference.
    eager = dict(attn_implementation="eager") if model_type == "gemma2" else {}
    model = widen(AutoModelForCausalLM.from_config(config, **eager), norms=True)
    if model_type != "gemma":
        with torch.no_grad():
            model.model.embed_tokens.weight.div_(4)
    return model.to(device).eval()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(CASES))
def test_generate_gives_hf_greedy_tokens(name, device):
    assert_native_generate_gives_hf_tokens(tiny(name, device), gemma.GemmaWeights, GREEDY)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(CASES))
def test_llm_gives_hf_greedy_tokens(name, device):
    """Prompts chunked by an 8-token step budget: prefill chunks over cached context (past the
    window), decode rows in the same steps."""
    model = tiny(name, device)
    prompts = random_prompts([5, 19, 12])
    llm = pagedkv.LLM(model, max_num_seqs=3, max_num_batched_tokens=8)
    assert isinstance(llm.runner.decoder, gemma.GemmaDecoder)
    assert_llm_gives_hf_greedy_tokens(llm, model, prompts, GREEDY)


def test_attention_softcap_changes_the_tokens():
    """The cap above is small enough to matter: without it HF's tokens differ, so the greedy
    tests catch a decoder that left it out."""
    ids, mask = tp_worker.left_padded([5, 19], 256, "cpu", seed=1)
    capped = tiny("gemma2").generate(ids, attention_mask=mask, **GREEDY)
    uncapped = tiny("gemma2", attn_logit_softcapping=None).generate(ids, attention_mask=mask, **GREEDY)
    assert not torch.equal(capped, uncapped)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["gemma2", "gemma3_text"])
def test_final_softcap_is_in_the_logits(name, device):
    """The final cap is monotonic (greedy tokens cannot show it): the logits generate returns
    are HF's, within the cap."""
    model = tiny(name, device)
    ids, mask = tp_worker.left_padded([5, 19], 256, device, seed=1)
    kw = dict(GREEDY, max_new_tokens=4, output_logits=True, return_dict_in_generate=True)
    expected = model.generate(ids, attention_mask=mask, **kw).logits
    got = pagedkv.generate(model, ids, attention_mask=mask, **kw).logits
    cap = model.config.final_logit_softcapping
    for ours, hf in zip(got, expected, strict=True):
        torch.testing.assert_close(ours, hf, atol=1e-4, rtol=1e-4)
        assert ours.abs().max() <= cap
    assert max(hf.abs().max() for hf in tiny(name, final_logit_softcapping=None).generate(
        ids.cpu(), attention_mask=mask.cpu(), **kw).logits) > cap  # the cap binds here


def test_windows_change_the_tokens():
    """Window 8 matters for these sequences: with a window past them HF's tokens differ."""
    ids, mask = tp_worker.left_padded([5, 19], 256, "cpu", seed=1)
    for name in ("gemma2", "gemma3_text"):
        windowed = tiny(name).generate(ids, attention_mask=mask, **GREEDY)
        whole = tiny(name, sliding_window=512).generate(ids, attention_mask=mask, **GREEDY)
        assert not torch.equal(windowed, whole), name


def test_native_types_left_the_fallback():
    for model_type in gemma.GEMMA_MODEL_TYPES:
        assert model_type not in registry.FALLBACK_MODEL_TYPES
        assert model_type not in registry.OTHER_DECODERS


@pytest.mark.parametrize("name, fields, words", [
    ("gemma3_text", dict(use_bidirectional_attention=True), "use_bidirectional_attention=True"),
    ("gemma2", dict(hidden_activation="gelu"), "activation 'gelu'"),
    ("gemma", dict(head_dim=80, num_attention_heads=4), "head_dim 80"),
])
def test_what_the_decoder_does_not_run_is_refused(name, fields, words):
    model = tiny(name, **fields)
    if "head_dim" in fields and 80 in registry.SUPPORTED_HEAD_DIMS:
        pytest.skip("head_dim 80 runs here")
    reason = pagedkv.unsupported_reason(model)
    assert reason is not None and words in reason, reason
    with pytest.raises(pagedkv.UnsupportedModel, match=type(model).__name__):
        pagedkv.generate(model, torch.tensor([[3, 4, 5]]), max_new_tokens=2)


@pytest.mark.parametrize("device", DEVICES)
def test_runs_past_its_window_with_its_window(device):
    """The window layers keep their window on every device (CUDA included: nothing caps sequences
    at it): prompts of 5 and 19 tokens + 50 new ones pass window 64 with HF's greedy tokens."""
    model = tiny("gemma3_text", device, sliding_window=64)
    ids, mask = tp_worker.left_padded([5, 19], 256, device, seed=1)
    kw = dict(GREEDY, max_new_tokens=50)
    assert torch.equal(pagedkv.generate(model, ids, attention_mask=mask, **kw),
                       model.generate(ids, attention_mask=mask, **kw))
    assert [layer.window for layer in prepared(model).weights.layers] == [64, 0, 64]
    assert_nothing_held(model)


def test_an_adapter_on_a_projection_is_refused():
    model = tiny("gemma3_text")
    layer = model.model.layers[1].mlp
    layer.up_proj = torch.nn.Sequential(layer.up_proj)
    reason = pagedkv.unsupported_reason(model)
    assert reason is not None and "model.layers.1.mlp.up_proj is a Sequential" in reason, reason


def test_tensor_parallel_refuses_gemma_by_name():
    with pytest.raises(pagedkv.UnsupportedModel, match="'gemma2' .* is not sharded"):
        pagedkv.tensor_parallel(tiny("gemma2"))


def test_weights_are_hf_s_own_tensors():
    """In-place writes to HF's parameters (optimizer steps) are seen without taking them again."""
    model = tiny("gemma2")
    ids, mask = tp_worker.left_padded([5, 19], 256, "cpu", seed=1)
    pagedkv.generate(model, ids, attention_mask=mask, **GREEDY)
    state = prepared(model)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.25)
    assert prepared(model) is state
    assert torch.equal(pagedkv.generate(model, ids, attention_mask=mask, **GREEDY),
                       model.generate(ids, attention_mask=mask, **GREEDY))
