"""Which layers of a Llama-family model (models/llama.py) attend through a sliding window, and
how wide, as each type's HF modeling code decides it (its masks: HF's eager and SDPA attention
follow the mask, not the module's `sliding_window` attribute, which only flash-attention reads).

- one mask for every layer, a window when config.sliding_window is set: Mistral, Mixtral, Phi-3,
  Qwen3-MoE (Mistral's config warns about layer_types and its model ignores them);
- per layer, by config.layer_types ("sliding_attention" layers get config.sliding_window): Qwen2,
  Qwen3, Qwen2-MoE (their configs derive layer_types from use_sliding_window and
  max_window_layers, and leave sliding_window None/0 without use_sliding_window), Ministral, CWM;
- no window: the rest (Llama's modeling has none).
"""

from __future__ import annotations

import torch

from pagedkv.layers.rotary import build_cos_sin_cache

WHOLE_MODEL_WINDOW = ("mistral", "mixtral", "phi3", "qwen3_moe")
PER_LAYER_WINDOW = ("qwen2", "qwen3", "qwen2_moe", "ministral", "cwm")


def layer_windows(config) -> list[int]:
    """[num_layers]: each layer's window (a query at position p sees keys j with p - j < window,
    HF's sliding mask), 0 for a layer that attends to the whole context."""
    num_layers = config.num_hidden_layers
    window = int(getattr(config, "sliding_window", None) or 0)
    if config.model_type in WHOLE_MODEL_WINDOW:
        return [window] * num_layers
    if config.model_type in PER_LAYER_WINDOW:
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * num_layers
        return [window if kind == "sliding_attention" else 0 for kind in layer_types]
    return [0] * num_layers


def every_layer_window(weights) -> int:
    """The widest window of a native model whose every layer has one (the engine gives back the
    blocks that fell out of it: KVCache.release_out_of_window), else 0: a layer sees the whole
    context (Gemma-2/3, OLMo-3, Qwen2 below max_window_layers), or the model runs on the fallback
    path, whose HF modules pass their windows per call."""
    windows = getattr(weights, "windows", None)  # DecoderWeights; Gemma's and OLMo-2's per layer
    if windows is None:
        windows = [getattr(layer, "window", 0) for layer in weights.layers]  # fallback: layers of None
    return max(windows) if windows and all(w > 0 for w in windows) else 0


# Gemma's and OLMo-2's modeling attend every layer to the whole context (their configs may still
# carry layer_types); Gemma-3's and OLMo-3's rotary takes the layer type: one table per type.
FULL_ATTENTION_ONLY = ("gemma", "olmo2")
ROPE_PER_LAYER_TYPE = ("gemma3_text", "olmo3")


def layer_types(config) -> list[str]:
    """[num_layers]: each layer's HF layer type ("full_attention", "sliding_attention", ...) for the
    Gemma and OLMo-2 families (models/gemma.py, models/olmo2.py)."""
    full = ["full_attention"] * config.num_hidden_layers
    if config.model_type in FULL_ATTENTION_ONLY:
        return full
    return list(getattr(config, "layer_types", None) or full)


def rope_kinds(config) -> list[str]:
    """The layer types that have a rotary table of their own (sorted), or one shared table."""
    return sorted(set(layer_types(config))) if config.model_type in ROPE_PER_LAYER_TYPE else ["full_attention"]


@torch.no_grad()
def layer_type_cos_sin(model, max_positions: int, device: torch.device) -> torch.Tensor:
    """[R, max_positions, rot_dim] fp32, cos | sin halves: the rotary tables a layer's rope index
    picks (R = len(rope_kinds)), from the model's own rotary module, which for Gemma-3 and OLMo-3
    takes the layer type (one table per type)."""
    config, rotary = model.config, model.model.rotary_emb
    if config.model_type not in ROPE_PER_LAYER_TYPE:
        return build_cos_sin_cache(config, max_positions, device, rotary_emb=rotary)[None]
    on = next(rotary.buffers()).device
    positions = torch.arange(max_positions, device=on)[None]  # int64, as HF's position_ids
    tables = []
    for kind in rope_kinds(config):
        cos, sin = rotary(torch.empty(1, dtype=torch.float32, device=on), positions, kind)  # [1, P, Dh]
        half = cos.shape[-1] // 2
        tables.append(torch.cat([cos[0, :, :half], sin[0, :, :half]], dim=-1).to(device))
    return torch.stack(tables).contiguous()
