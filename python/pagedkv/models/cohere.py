"""Cohere (Command-R, CohereForCausalLM) on pagedkv ops, HF's weights and HF's rounding.

What differs from models/llama.py, each as HF's modeling_cohere.py computes it:
- one norm a layer, a LayerNorm (mean subtracted, weight, no bias; fp32 inside, rounded once),
  and a parallel block: attention and MLP both read the normed input, summed in HF's order

      h = ln(x);  x = (x + attention(h)) + mlp(h);  logits = head(ln(x)) * logit_scale

- optionally (use_qk_norm) a per-head LayerNorm on q and k (weights [H, Dh]) before the rotation;
- an interleaved rotary embedding (pairs (2i, 2i + 1)), run as the half-split one on q/k rows
  permuted at load (models/interleaved_rope.py), in fp32 with cos/sin rounded to the dtype
  first, rounded once (HF's apply_rotary_pos_emb); the LM head is tied to the embedding by default.

The norms and the rotation are plain PyTorch (layers/hf_rounding.py), HF's own arithmetic; K and
V then go to the cache through ops.rope_and_write_kv with the identity rotation. The permuted
q/k norms reduce over the head's dimensions in another order than HF's: equal up to fp32's last
bit. The GEMMs, SiLU*mul and attention are pagedkv's ops; no host sync and no data-dependent
branch, so decode steps replay as CUDA graphs.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from pagedkv import ops
from pagedkv.layers.attention import ForwardMetadata, attention_workspace, paged_attention
from pagedkv.layers.hf_rounding import layer_norm_fp32, rotate_fp32
from pagedkv.layers.rotary import identity_rotation, rope_type
from pagedkv.models.interleaved_rope import fuse_qkv_halves, permute_last
from pagedkv.models.llama import _fuse_rows
from pagedkv.models.module_path import causal_lm_reason, head_dim_reason, layer_modules_reason, layer_path, path_reason
from pagedkv.models.native_weights import NativeWeights, attention_scale, norm_eps

COHERE_MODEL_TYPES = ("cohere",)


@dataclasses.dataclass(slots=True)
class CohereLayerWeights:
    input_norm: torch.Tensor  # [D]: the one LayerNorm, read by attention and MLP alike
    qkv: torch.Tensor  # [(Hq + 2 * Hkv) * Dh, D], q and k rows permuted per head
    qkv_bias: torch.Tensor | None  # [(Hq + 2 * Hkv) * Dh] (attention_bias=True), permuted alike
    q_norm: torch.Tensor | None  # [Hq, Dh] (use_qk_norm), each head's dimensions permuted
    k_norm: torch.Tensor | None  # [Hkv, Dh]
    o: torch.Tensor  # [D, Hq * Dh]
    o_bias: torch.Tensor | None  # [D]
    gate_up: torch.Tensor  # [2 * I, D]
    down: torch.Tensor  # [D, I]


@dataclasses.dataclass(slots=True)
class CohereWeights(NativeWeights[CohereLayerWeights]):
    """DecoderWeights' interface (models/llama.py) for Cohere."""

    logit_scale: float  # HF multiplies the logits by it


def cohere_reason(model, head_dims: tuple[int, ...], rope_types: tuple[str, ...]) -> str | None:
    """None if this file runs `model` exactly, else what it does not run, as a sentence (dtype
    and placement are the registry's)."""
    config = model.config
    reason = causal_lm_reason(model)
    if reason is not None:
        return reason
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act={config.hidden_act!r} is not supported; supported: 'silu'"
    kind = rope_type(config)
    if kind not in rope_types:
        return f"rope type {kind!r} is not supported; supported: {', '.join(rope_types)}"
    reason = head_dim_reason(config, head_dims)
    if reason is not None:
        return reason
    qk_norms = ("q_norm", "k_norm") if getattr(config, "use_qk_norm", False) else ()
    return (path_reason(layer_path(model, ("input_layernorm",), qk_norms), config.model_type)
            or layer_modules_reason(model, "silu"))


def extract_cohere_weights(model) -> CohereWeights:
    """Take the weights of an HF CohereForCausalLM: q/k rows permuted (a copy, models/
    interleaved_rope.py), v and gate/up fused in place as models/llama.py's extract_weights
    does. Call outside inference mode."""
    config, inner = model.config, model.model
    layers = []
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        head_dim = attn.head_dim
        qkv, qkv_bias = fuse_qkv_halves(attn, head_dim)
        q_norm, k_norm = attn._modules.get("q_norm"), attn._modules.get("k_norm")
        layers.append(CohereLayerWeights(
            input_norm=layer.input_layernorm.weight.detach(), qkv=qkv, qkv_bias=qkv_bias,
            q_norm=None if q_norm is None else permute_last(q_norm.weight),
            k_norm=None if k_norm is None else permute_last(k_norm.weight),
            o=attn.o_proj.weight.detach(), o_bias=None if attn.o_proj.bias is None else attn.o_proj.bias.detach(),
            gate_up=_fuse_rows([mlp.gate_proj, mlp.up_proj], False)[0], down=mlp.down_proj.weight.detach(),
        ))
    attn0 = inner.layers[0].self_attn
    return CohereWeights(
        embed=inner.embed_tokens.weight.detach(), layers=layers, final_norm=inner.norm.weight.detach(),
        lm_head=model.lm_head.weight.detach(), vocab_size=int(model.lm_head.weight.shape[0]),
        num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
        head_dim=attn0.head_dim, eps=norm_eps(model, config.layer_norm_eps), scale=attention_scale(inner.layers),
        logit_scale=float(model.logit_scale),
    )


class CohereDecoder:
    """The forward of one Cohere model over the paged cache (PagedDecoder's interface)."""

    def __init__(self, weights: CohereWeights, cos_sin: torch.Tensor,
                 k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]):
        self.w = weights
        # [max_position, Dh] fp32, cos | sin halves: HF casts them to the dtype, then rotates in fp32
        self.cos_sin = cos_sin.to(weights.embed.dtype).float()
        self.k_caches = k_caches  # per layer [num_blocks, block_size, Hkv, Dh]
        self.v_caches = v_caches
        self.identity = identity_rotation(weights.head_dim, cos_sin.device)  # [1, Dh]: K/V writes only

    def _attention(self, i: int, layer: CohereLayerWeights, x: torch.Tensor, meta: ForwardMetadata,
                   at_zero: torch.Tensor, workspace: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] (normed) -> (O projection [T, D], the step's attention workspace)."""
        w = self.w
        num_tokens = x.shape[0]
        q_size, kv_size = w.num_heads * w.head_dim, w.num_kv_heads * w.head_dim
        qkv = ops.linear(x, layer.qkv, layer.qkv_bias)  # [T, (Hq + 2 Hkv) Dh]
        q = qkv[:, :q_size].view(num_tokens, w.num_heads, w.head_dim)
        k = qkv[:, q_size:q_size + kv_size].view(num_tokens, w.num_kv_heads, w.head_dim)
        v = qkv[:, q_size + kv_size:].view(num_tokens, w.num_kv_heads, w.head_dim)
        if layer.q_norm is not None:  # use_qk_norm: each head's LayerNorm
            q, k = layer_norm_fp32(q, layer.q_norm, w.eps), layer_norm_fp32(k, layer.k_norm, w.eps)
        q = rotate_fp32(q, self.cos_sin, meta.positions)
        k = rotate_fp32(k, self.cos_sin, meta.positions)
        ops.rope_and_write_kv(q, k, v, at_zero, self.identity, self.k_caches[i], self.v_caches[i],
                              meta.slot_mapping)
        if workspace is None:
            workspace = attention_workspace(q, self.k_caches[0], meta)
        attn = paged_attention(q, self.k_caches[i], self.v_caches[i], meta, w.scale, workspace)  # [T, Hq, Dh]
        return ops.linear(attn.view(num_tokens, q_size), layer.o, layer.o_bias), workspace

    def forward(self, input_ids: torch.Tensor, meta: ForwardMetadata,
                logits_rows: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [T] -> logits [R, V] for the rows `logits_rows` [R] of the T tokens (all
        when None), in the model's dtype."""
        w = self.w
        workspace = None
        at_zero = torch.zeros_like(meta.positions)  # [T]: every token at the identity's position
        residual = F.embedding(input_ids, w.embed)  # [T, D]
        for i, layer in enumerate(w.layers):
            x = layer_norm_fp32(residual, layer.input_norm, w.eps)  # [T, D]: both branches' input
            out, workspace = self._attention(i, layer, x, meta, at_zero, workspace)
            mlp = ops.linear(ops.gate_up_silu(x, layer.gate_up), layer.down)  # [T, D]
            residual.add_(out).add_(mlp)  # HF: residual + attention + mlp, left to right
        hidden = residual if logits_rows is None else residual[logits_rows]
        logits = ops.linear(layer_norm_fp32(hidden, w.final_norm, w.eps), w.lm_head)
        return logits.mul_(w.logit_scale)
