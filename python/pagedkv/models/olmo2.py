"""OLMo-2 and OLMo-3 on pagedkv ops, HF's weights and HF's rounding.

What differs from models/llama.py, each as HF's modeling_olmo2.py computes it:
- no norm before the attention or the MLP: each sublayer's OUTPUT is normed, then added to the
  residual, and the residual itself is the next sublayer's input:

      x += norm_post_attn(attention(x));  x += norm_post_ff(mlp(x));  logits = head(norm(x))

- q and k are RMS-normed over ALL heads' vectors at once (weights [Hq * Dh], [Hkv * Dh]), before
  the rotation;
- every RMSNorm multiplies its weight into the fp32 value and rounds once
  (``(weight * normed_fp32).to(dtype)``; Llama's rounds, then multiplies), and the rotation runs
  in fp32 (its cos/sin are not cast to the dtype) and rounds once.

The fused ops round as Llama does, so those three steps are plain PyTorch here, HF's own
arithmetic (exact in every dtype, on every device, inside CUDA graphs); K and V then go to the
cache through ops.rope_and_write_kv with the identity rotation (cos 1, sin 0: the values pass
unchanged). The GEMMs, SiLU*mul and attention are pagedkv's ops, as in models/llama.py.

OLMo-3 is OLMo-2 with sliding-window layers (config.layer_types; "sliding_attention" layers see
config.sliding_window tokens, HF's sliding mask) and a rotary table per layer type (its
rope_parameters per type: OLMo-3 7B's yarn on the full layers only), as models/gemma.py runs Gemma-3.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from pagedkv import ops
from pagedkv.layers.attention import ForwardMetadata, attention_workspace, paged_attention
from pagedkv.layers.hf_rounding import rms_norm_fp32_weight, rotate_fp32  # HF's rounding (tests read them here too)
from pagedkv.layers.rotary import identity_rotation, rope_type
from pagedkv.models.llama import _fuse_rows
from pagedkv.models.module_path import causal_lm_reason, head_dim_reason, layer_modules_reason, layer_path, path_reason
from pagedkv.models.native_weights import NativeWeights, attention_scale, norm_eps
from pagedkv.models.windows import layer_types, rope_kinds

OLMO2_MODEL_TYPES = ("olmo2", "olmo3")
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclasses.dataclass(slots=True)
class Olmo2LayerWeights:
    qkv: torch.Tensor  # [(Hq + 2 * Hkv) * Dh, D]
    qkv_bias: torch.Tensor | None  # [(Hq + 2 * Hkv) * Dh] (attention_bias=True)
    q_norm: torch.Tensor  # [Hq * Dh]: over all heads at once
    k_norm: torch.Tensor  # [Hkv * Dh]
    o: torch.Tensor  # [D, Hq * Dh]
    o_bias: torch.Tensor | None  # [D]
    post_attn_norm: torch.Tensor  # [D]: the attention output's norm
    post_ff_norm: torch.Tensor  # [D]: the MLP output's norm
    gate_up: torch.Tensor  # [2 * I, D]
    down: torch.Tensor  # [D, I]
    window: int = 0  # tokens a query attends back to, itself included (0: the whole context)
    rope: int = 0  # which rotary table of the cos_sin stack (OLMo-3: one per layer type)


@dataclasses.dataclass(slots=True)
class Olmo2Weights(NativeWeights[Olmo2LayerWeights]):
    """DecoderWeights' interface (models/llama.py) for OLMo-2 and OLMo-3: the shared fields only."""


def _rope_types(config) -> list[str]:
    """Each rotary table's rope type (OLMo-3's rope_parameters hold one dict per layer type)."""
    if config.model_type != "olmo3":
        return [rope_type(config)]
    params = getattr(config, "rope_parameters", None) or {}
    return [(params.get(kind) or {}).get("rope_type", "default") for kind in rope_kinds(config)]


def olmo2_reason(model, head_dims: tuple[int, ...], rope_types: tuple[str, ...]) -> str | None:
    """None if this file runs `model` exactly, else what it does not run, as a sentence (dtype
    and placement are the registry's)."""
    config = model.config
    reason = causal_lm_reason(model)
    if reason is not None:
        return reason
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act={config.hidden_act!r} is not supported; supported: 'silu'"
    unknown = set(layer_types(config)) - set(LAYER_TYPES)
    if unknown:
        return f"layer_types {sorted(unknown)} are not supported; supported: {', '.join(LAYER_TYPES)}"
    for kind in _rope_types(config):
        if kind not in rope_types:
            return f"rope type {kind!r} is not supported; supported: {', '.join(rope_types)}"
    reason = head_dim_reason(config, head_dims)
    if reason is not None:
        return reason
    return _module_reason(model)


def _module_reason(model) -> str | None:
    """A module of another type on the decoder's path is refused (models/module_path.py)."""
    norms = ("post_attention_layernorm", "post_feedforward_layernorm")
    return (path_reason(layer_path(model, norms, ("q_norm", "k_norm")), model.config.model_type)
            or layer_modules_reason(model, "silu"))


def extract_olmo2_weights(model) -> Olmo2Weights:
    """Take (and fuse, in place: see models/llama.py's extract_weights) the weights of an HF
    Olmo2ForCausalLM or Olmo3ForCausalLM. Call outside inference mode."""
    config, inner = model.config, model.model
    types, kinds = layer_types(config), rope_kinds(config)
    window = int(getattr(config, "sliding_window", None) or 0)
    layers = []
    for i, layer in enumerate(inner.layers):
        attn, mlp = layer.self_attn, layer.mlp
        qkv, qkv_bias = _fuse_rows([attn.q_proj, attn.k_proj, attn.v_proj], attn.q_proj.bias is not None)
        gate_up, _ = _fuse_rows([mlp.gate_proj, mlp.up_proj], False)
        layers.append(Olmo2LayerWeights(
            qkv=qkv, qkv_bias=qkv_bias, q_norm=attn.q_norm.weight.detach(), k_norm=attn.k_norm.weight.detach(),
            o=attn.o_proj.weight.detach(), o_bias=None if attn.o_proj.bias is None else attn.o_proj.bias.detach(),
            post_attn_norm=layer.post_attention_layernorm.weight.detach(),
            post_ff_norm=layer.post_feedforward_layernorm.weight.detach(),
            gate_up=gate_up, down=mlp.down_proj.weight.detach(),
            window=window if types[i] == "sliding_attention" else 0, rope=kinds.index(types[i]),
        ))
    attn0 = inner.layers[0].self_attn
    return Olmo2Weights(
        embed=inner.embed_tokens.weight.detach(), layers=layers, final_norm=inner.norm.weight.detach(),
        lm_head=model.lm_head.weight.detach(), vocab_size=int(model.lm_head.weight.shape[0]),
        num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
        head_dim=attn0.head_dim, eps=norm_eps(model, config.rms_norm_eps), scale=attention_scale(inner.layers),
    )


class Olmo2Decoder:
    """The forward of one OLMo-2 model over the paged cache (PagedDecoder's interface)."""

    def __init__(self, weights: Olmo2Weights, cos_sin: torch.Tensor,
                 k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]):
        self.w = weights
        self.cos_sin = cos_sin  # [R, max_position, Dh] fp32: cos | sin halves (windows.layer_type_cos_sin)
        self.k_caches = k_caches  # per layer [num_blocks, block_size, Hkv, Dh]
        self.v_caches = v_caches
        self.identity = identity_rotation(weights.head_dim, cos_sin.device)  # [1, Dh]: K/V writes only

    def _attention(self, i: int, layer: Olmo2LayerWeights, x: torch.Tensor, meta: ForwardMetadata,
                   at_zero: torch.Tensor, workspace: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> (O projection [T, D], the step's attention workspace)."""
        w = self.w
        num_tokens, eps = x.shape[0], w.eps
        q_size, kv_size = w.num_heads * w.head_dim, w.num_kv_heads * w.head_dim
        qkv = ops.linear(x, layer.qkv, layer.qkv_bias)  # [T, (Hq + 2 Hkv) Dh]
        q = rms_norm_fp32_weight(qkv[:, :q_size], layer.q_norm, eps).view(num_tokens, w.num_heads, w.head_dim)
        k = rms_norm_fp32_weight(qkv[:, q_size:q_size + kv_size], layer.k_norm, eps)
        k = k.view(num_tokens, w.num_kv_heads, w.head_dim)
        v = qkv[:, q_size + kv_size:].view(num_tokens, w.num_kv_heads, w.head_dim)
        q = rotate_fp32(q, self.cos_sin[layer.rope], meta.positions)
        k = rotate_fp32(k, self.cos_sin[layer.rope], meta.positions)
        ops.rope_and_write_kv(q, k, v, at_zero, self.identity, self.k_caches[i], self.v_caches[i],
                              meta.slot_mapping)
        if workspace is None:
            workspace = attention_workspace(q, self.k_caches[0], meta)
        attn = paged_attention(q, self.k_caches[i], self.v_caches[i], meta, w.scale, workspace,
                               sliding_window=layer.window)  # [T, Hq, Dh]
        return ops.linear(attn.view(num_tokens, q_size), layer.o, layer.o_bias), workspace

    def forward(self, input_ids: torch.Tensor, meta: ForwardMetadata,
                logits_rows: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [T] -> logits [R, V] for the rows `logits_rows` [R] of the T tokens (all
        when None), in the model's dtype."""
        w = self.w
        workspace = None
        at_zero = torch.zeros_like(meta.positions)  # [T]: every token at the identity's position
        residual = F.embedding(input_ids, w.embed)  # [T, D]: also each sublayer's input
        for i, layer in enumerate(w.layers):
            out, workspace = self._attention(i, layer, residual, meta, at_zero, workspace)
            residual.add_(rms_norm_fp32_weight(out, layer.post_attn_norm, w.eps))
            out = ops.linear(ops.gate_up_silu(residual, layer.gate_up), layer.down)  # [T, D]
            residual.add_(rms_norm_fp32_weight(out, layer.post_ff_norm, w.eps))
        hidden = residual if logits_rows is None else residual[logits_rows]
        return ops.linear(rms_norm_fp32_weight(hidden, w.final_norm, w.eps), w.lm_head)
