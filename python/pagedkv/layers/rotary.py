"""The cos/sin cache that ``ops.rope_and_write_kv`` reads, computed by HF's own rotary embedding.

HF's ``<Model>RotaryEmbedding`` computes ``inv_freq`` on the CPU from the config (default, llama3,
yarn, linear... rope types, rope_theta, partial_rotary_factor) and, in every forward, cos/sin in
float32 on the model's device as ``cos(position * inv_freq) * attention_scaling``. Calling that
very module for positions 0..max_position-1 on the target device gives the values HF would use,
bit for bit; the kernel then casts them to the model dtype, as HF does before
``apply_rotary_pos_emb``.
"""

from __future__ import annotations

import importlib

import torch

# Rope types whose frequencies depend on the current sequence length: no static cache fits them.
_DYNAMIC_ROPE_TYPES = ("dynamic", "longrope")


def rope_type(config) -> str:
    """The config's rope type ("default", "llama3", "yarn", ...), across transformers versions."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return params.get("rope_type", params.get("type", "default")) or "default"


def hf_rotary_embedding(config) -> torch.nn.Module:
    """A fresh instance of the config's ``<Model>RotaryEmbedding`` (on the CPU, as HF builds it)."""
    module_name = f"transformers.models.{config.model_type}.modeling_{config.model_type}"
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(
            f"pagedkv: no transformers module {module_name} for model_type {config.model_type!r}; "
            "pass rotary_emb= (the model's own rotary embedding module)"
        ) from err
    classes = [
        cls for name, cls in vars(module).items()
        if name.endswith("RotaryEmbedding") and isinstance(cls, type) and cls.__module__ == module_name
    ]
    if len(classes) != 1:
        raise ValueError(
            f"pagedkv: {module_name} defines {len(classes)} RotaryEmbedding classes, expected one; "
            "pass rotary_emb= (the model's own rotary embedding module)"
        )
    return classes[0](config)


@torch.no_grad()
def build_cos_sin_cache(
    config, max_position: int, device: torch.device | str, rotary_emb: torch.nn.Module | None = None
) -> torch.Tensor:
    """cos_sin_cache [max_position, rot_dim] float32 on device: cos of the rot_dim/2 frequencies,
    then their sin, for positions 0..max_position-1 (HF's rotate-half convention repeats both
    halves). rot_dim is head_dim, or less with a partial_rotary_factor.

    rotary_emb: the loaded model's rotary embedding (e.g. ``model.model.rotary_emb``), used as is;
    by default a fresh one is built from the config. Rope types "dynamic" and "longrope" change
    their frequencies with the sequence length and are refused.
    """
    kind = rope_type(config)
    if kind in _DYNAMIC_ROPE_TYPES:
        raise NotImplementedError(
            f"pagedkv: rope type {kind!r} recomputes its frequencies per sequence length; "
            "a static cos/sin cache cannot reproduce it"
        )
    if rotary_emb is None:
        rotary_emb = hf_rotary_embedding(config).to(device)
    on = rotary_emb.inv_freq.device
    positions = torch.arange(max_position, device=on)[None]  # int64, as HF's position_ids
    cos, sin = rotary_emb(torch.empty(1, dtype=torch.float32, device=on), positions)
    half = cos.shape[-1] // 2
    return torch.cat([cos[0, :, :half], sin[0, :, :half]], dim=-1).to(device).contiguous()
