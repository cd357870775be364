"""supports(model) and the reason it gives when it says no."""

from __future__ import annotations

import pytest
import torch
from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM)

from pagedkv.models.registry import supports, unsupported_reason
from pagedkv.models.windows import layer_windows

SMALL = dict(vocab_size=64, hidden_size=128, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=2, num_key_value_heads=1)  # head_dim 64


@pytest.mark.parametrize("config_cls, model_cls", [
    (LlamaConfig, LlamaForCausalLM), (Qwen2Config, Qwen2ForCausalLM),
    (Qwen3Config, Qwen3ForCausalLM), (MistralConfig, MistralForCausalLM),
])
def test_supported_architectures(config_cls, model_cls):
    model = model_cls(config_cls(**SMALL))
    assert supports(model), unsupported_reason(model)


@pytest.mark.parametrize("model, match", [
    (lambda: GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)),
     r"model_type 'gpt2' is not supported; supported: llama, qwen2, qwen3, mistral"),
    (lambda: LlamaForCausalLM(LlamaConfig(**SMALL, hidden_act="gelu")), r"hidden_act='gelu'"),
    (lambda: LlamaForCausalLM(LlamaConfig(**SMALL, rope_scaling={"rope_type": "proportional", "factor": 2.0})),
     r"rope type 'proportional' is not supported"),
    (lambda: Qwen2ForCausalLM(Qwen2Config(**SMALL, layer_types=["full_attention", "sliding_attention"])),
     r"layer_types \['full_attention', 'sliding_attention'\] are not supported"),
    (lambda: LlamaForCausalLM(LlamaConfig(**SMALL)).to(torch.float64),
     r"parameter dtypes \['torch.float64'\] are not supported"),
])
def test_unsupported_models_say_why(model, match):
    m = model()
    assert not supports(m)
    assert pytest.importorskip("re").search(match, unsupported_reason(m))


def test_mistral_window():
    """A sliding window is supported on every device: each layer runs with it (nothing caps
    sequences at it; tests/test_sliding_window.py runs past it), a model without one has none."""
    mistral = MistralForCausalLM(MistralConfig(**SMALL, sliding_window=64))
    assert supports(mistral), unsupported_reason(mistral)
    assert layer_windows(mistral.config) == [64, 64]
    assert layer_windows(LlamaConfig(**SMALL)) == [0, 0]
