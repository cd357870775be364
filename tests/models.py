"""Tiny random-weight HF models of each supported architecture, for tests."""

from __future__ import annotations

import torch
from transformers import (AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

_COMMON = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
               bos_token_id=1, eos_token_id=2, pad_token_id=0)

ARCHITECTURES = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**_COMMON)),
    # Llama-3 rope scaling and a large rope_theta
    "llama3": lambda: LlamaForCausalLM(LlamaConfig(**_COMMON, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "llama_bias": lambda: LlamaForCausalLM(LlamaConfig(**_COMMON, attention_bias=True)),  # QKV + O bias
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**_COMMON)),  # QKV bias
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**_COMMON, head_dim=128)),  # q/k norm
    "qwen3_tied": lambda: Qwen3ForCausalLM(Qwen3Config(**_COMMON, head_dim=128, tie_word_embeddings=True)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**_COMMON, sliding_window=512)),
}


def tiny_model(name: str, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0):
    torch.manual_seed(seed)
    model = ARCHITECTURES[name]()
    widen(model)
    return model.to(device=device, dtype=dtype).eval()


def random_model(model_type: str, fields: dict, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 seed: int = 0, norms: bool = False) -> torch.nn.Module:
    """A tiny random HF model of any type from its config fields (AutoConfig), weights widened
    (norms: the norm weights too), in eval mode on `device` in `dtype`."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **fields))
    return widen(model, norms=norms).to(device=device, dtype=dtype).eval()


def widen(model: torch.nn.Module, norms: bool = False) -> torch.nn.Module:
    """In place: random init is small; widen the weights so logits are far from ties and tokens
    vary (std 0.3 per input unit keeps activations O(1) with hidden 256). HF zeroes biases: random
    ones, so a bias the runner dropped would change tokens. norms: also perturb the other 1-D
    parameters (norm weights; Gemma's zero-initialised ones give one token otherwise)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3 * 16 / p.shape[-1] ** 0.5)
            elif name.endswith(".bias"):
                p.normal_(0, 0.3)
            elif norms:
                p.add_(torch.randn_like(p) * 0.3)
    return model
