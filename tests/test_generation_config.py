"""generate()'s argument resolution: HF's merge order and defaults, and clear refusals."""

from __future__ import annotations

import pytest
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from pagedkv.hf.generation_config import UnsupportedGenerationArgument, resolve_generation


@pytest.fixture(scope="module")
def model():
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, eos_token_id=2)
    return LlamaForCausalLM(config)


def test_defaults_follow_hf(model):
    with pytest.warns(UserWarning, match=r"model-agnostic default `max_length` \(=20\)"):
        s = resolve_generation(model, prompt_length=5, generation_config=None, kwargs={})
    # HF generates max_length=20 NEW tokens by default (its _prepare_generated_length)
    assert s.max_new_tokens == 20
    assert (s.do_sample, s.top_k, s.top_p, s.temperature) == (False, 50, 1.0, 1.0)
    assert s.eos_token_ids == (2,) and s.pad_token_id == 2  # HF pads with the first EOS


def test_kwargs_override_model_config(model):
    model.generation_config.temperature = 0.7
    try:
        s = resolve_generation(model, 5, None, dict(do_sample=True, max_new_tokens=3, top_k=0,
                                                    eos_token_id=[5, 6], min_new_tokens=2))
    finally:
        model.generation_config.temperature = None
    assert (s.max_new_tokens, s.min_new_tokens, s.temperature, s.top_k) == (3, 2, 0.7, 0)
    assert s.eos_token_ids == (5, 6) and s.pad_token_id == 5


def test_generation_config_object(model):
    s = resolve_generation(model, 5, GenerationConfig(max_new_tokens=4, repetition_penalty=1.2), {})
    assert (s.max_new_tokens, s.repetition_penalty) == (4, 1.2)


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_beams=4, num_beam_groups=2), r"num_beam_groups=2 is not supported"),
    # (no_repeat_ngram_size, stop_strings, output_scores: the processed path, test_hf_processors.py)
    (dict(guidance_scale=2.0), r"guidance_scale=2.0 is not supported"),
    (dict(output_attentions=True), r"unsupported argument\(s\) \[.output_attentions.\]"),
    (dict(not_an_argument=1), r"unsupported argument\(s\) \['not_an_argument'\]"),
    (dict(use_cache=False), r"use_cache=False is not supported; allowed: True \(pagedkv always decodes from its "
                            r"paged KV cache, whose tokens are the ones HF gives without a cache"),
])
def test_unsupported_settings_are_named(model, kwargs, match):
    with pytest.raises(UnsupportedGenerationArgument, match=match):
        resolve_generation(model, 5, None, kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_new_tokens=0), r"max_new_tokens. must be greater than 0"),  # HF checks this one
    (dict(max_length=5), r"max_length=5 with prompts of length 5 leaves no token"),
    (dict(do_sample=True, temperature=-1.0), r"temperature=-1.0; it must be > 0"),
    (dict(do_sample=True, top_p=1.5), r"top_p=1.5; it must be in \(0, 1\]"),
    (dict(do_sample=True, top_p=0.0), r"top_p=0.0; it must be in \(0, 1\]"),
    (dict(repetition_penalty=0.0), r"repetition_penalty=0.0; it must be > 0"),
])
def test_invalid_values(model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        resolve_generation(model, 5, None, kwargs)


@pytest.mark.parametrize("kwargs", [dict(not_an_argument=1), dict(output_hidden_states=True)])
def test_refusals_list_only_user_facing_settings(model, kwargs):
    """Fields that checkpoints' generation_config.json carry (transformers_version, cache_implementation,
    ...) change nothing and are accepted, but are not settings to offer a user."""
    with pytest.raises(UnsupportedGenerationArgument) as refused:
        resolve_generation(model, 5, None, kwargs)
    message = str(refused.value)
    assert "max_new_tokens" in message and "repetition_penalty" in message
    for internal in ("transformers_version", "cache_implementation", "compile_config", "disable_compile"):
        assert internal not in message, internal
