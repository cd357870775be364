"""A tiny random Llama whose greedy tokens do not hang on rounding: what `python -m pagedkv`'s
self-check and scripts/soak.py compare against HF's own generate."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(seed: int = 0, vocab: int = 256, hidden: int = 256, heads: int = 4,
               kv_heads: int = 2) -> LlamaForCausalLM:
    """2 layers, fp32, on the CPU. Its matrices are widened (std 0.3 * 16 / sqrt(fan-in)) so the
    logits are far apart: greedy tokens then vary and do not depend on the order of additions,
    and pagedkv must give HF's exactly."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3 * 16 / p.shape[-1] ** 0.5)
    return model.eval()
