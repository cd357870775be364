"""Gemma, Gemma-2 and Gemma-3 (text) on pagedkv ops, HF's weights and HF's rounding.

What differs from models/llama.py, each as HF's modeling_gemma*.py computes it:
- every RMSNorm scales by (1 + weight) in fp32 and rounds once (ops.rms_norm gemma_style);
- the embedding is scaled by sqrt(hidden), the scale rounded to the dtype first;
- the MLP is GELU (tanh approximation) gated: gelu_tanh(gate) * up;
- Gemma-2/3 "sandwich" layers: the attention and MLP outputs are normalized before they are added
  to the residual, and the MLP input has its own norm:

      h = norm_in(x) -> attention -> norm_post_attn;  x += h
      h = norm_pre_ff(x) -> MLP -> norm_post_ff;       x += h

- Gemma-2: attention logits softcapped (cap * tanh(s / cap)), scale query_pre_attn_scalar**-0.5,
  final logits softcapped; sliding-window layers alternate with global ones (config.layer_types);
- Gemma-3: per-head q/k norms (Gemma-style) before the rotation, sliding and full layers with their
  own rotary tables (rope_parameters per layer type); no attention softcap (HF passes none).

Sliding windows and attention softcaps are computed by the attention kernels, CPU and CUDA alike.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from pagedkv import ops
from pagedkv.layers.attention import ForwardMetadata, attention_workspace, paged_attention
from pagedkv.models.fallback import LENGTH_DEPENDENT_ROPE
from pagedkv.models.llama import _fuse_rows
from pagedkv.models.module_path import causal_lm_reason, head_dim_reason, layer_modules_reason, layer_path, path_reason
from pagedkv.models.native_weights import NativeWeights, attention_scale, attention_setting, norm_eps
from pagedkv.models.windows import layer_types, rope_kinds

GEMMA_MODEL_TYPES = ("gemma", "gemma2", "gemma3_text")
ACTIVATION = "gelu_pytorch_tanh"  # HF's name of torch's gelu(approximate="tanh"); ops: "gelu_tanh"
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclasses.dataclass(slots=True)
class GemmaLayerWeights:
    input_norm: torch.Tensor  # [D]
    qkv: torch.Tensor  # [(Hq + 2 * Hkv) * Dh, D]
    qkv_bias: torch.Tensor | None  # [(Hq + 2 * Hkv) * Dh] (attention_bias=True)
    q_norm: torch.Tensor | None  # [Dh] (Gemma-3)
    k_norm: torch.Tensor | None  # [Dh] (Gemma-3)
    o: torch.Tensor  # [D, Hq * Dh]
    o_bias: torch.Tensor | None  # [D]
    post_attn_norm: torch.Tensor  # [D]: Gemma's MLP input norm; Gemma-2/3's attention output norm
    pre_ff_norm: torch.Tensor | None  # [D] (Gemma-2/3: the MLP input norm)
    post_ff_norm: torch.Tensor | None  # [D] (Gemma-2/3: the MLP output norm)
    gate_up: torch.Tensor  # [2 * I, D]
    down: torch.Tensor  # [D, I]
    window: int  # tokens a query attends back to, itself included (0: the whole context)
    rope: int  # which rotary table of the cos_sin stack (Gemma-3: one per layer type)


@dataclasses.dataclass(slots=True)
class GemmaWeights(NativeWeights[GemmaLayerWeights]):
    """DecoderWeights' interface (models/llama.py) for the Gemma family."""

    embed_scale: torch.Tensor  # [] in the model's dtype: sqrt(D) rounded, as HF multiplies it
    attn_softcap: float  # 0: none
    final_softcap: float  # 0: none


def _activation(config) -> str | None:
    # Gemma reads hidden_act (its config maps the legacy "gelu" to the tanh one); Gemma-2/3 read
    # hidden_activation.
    if config.model_type == "gemma":
        return getattr(config, "hidden_act", None)
    return getattr(config, "hidden_activation", None)


def _attention_softcap(model) -> float:
    # Gemma-3's attention passes no softcap to HF's attention function, whatever the config says;
    # Gemma-2's passes its module's attn_logit_softcapping (set from the config at init).
    config = model.config
    if config.model_type != "gemma2":
        return 0.0
    return attention_setting(model.model.layers, "attn_logit_softcapping",
                             getattr(config, "attn_logit_softcapping", None) or 0.0, "attention softcap")


def gemma_reason(model, head_dims: tuple[int, ...]) -> str | None:
    """None if models/gemma.py runs `model` exactly, else what it does not run, as a sentence
    (dtype and placement are the registry's)."""
    config = model.config
    reason = causal_lm_reason(model)
    if reason is not None:
        return reason
    act = _activation(config)
    if act != ACTIVATION:
        return f"activation {act!r} is not supported for {config.model_type}; supported: {ACTIVATION!r}"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    nested = [v for v in rope.values() if isinstance(v, dict)]  # per layer type (Gemma-3)
    for params in [rope, *nested]:
        kind = params.get("rope_type", params.get("type"))
        if kind in LENGTH_DEPENDENT_ROPE:
            return f"rope type {kind!r} is not supported (its frequencies depend on the sequence length)"
    reason = head_dim_reason(config, head_dims)
    if reason is not None:
        return reason
    unknown = set(layer_types(config)) - set(LAYER_TYPES)
    if unknown:
        return f"layer_types {sorted(unknown)} are not supported; supported: {', '.join(LAYER_TYPES)}"
    if getattr(config, "use_bidirectional_attention", False):
        return "use_bidirectional_attention=True is not supported (pagedkv's attention is causal)"
    return _module_reason(model)


def _module_reason(model) -> str | None:
    """A module of another type on the decoder's path is refused (models/module_path.py)."""
    config = model.config
    norms = ("input_layernorm", "post_attention_layernorm")
    if config.model_type != "gemma":
        norms += ("pre_feedforward_layernorm", "post_feedforward_layernorm")
    attention_modules = ("q_norm", "k_norm") if config.model_type == "gemma3_text" else ()
    # embed_tokens: transformers' scaled embedding module (the scale is taken as HF applies it)
    return (path_reason(layer_path(model, norms, attention_modules, embedding=None), config.model_type)
            or layer_modules_reason(model, _activation(config)))


def extract_gemma_weights(model) -> GemmaWeights:
    """Take (and fuse, in place: see models/llama.py's extract_weights) the weights of an HF
    Gemma/Gemma-2/Gemma-3 *ForCausalLM. Call outside inference mode."""
    config, inner = model.config, model.model
    types, kinds = layer_types(config), rope_kinds(config)
    layers = []
    for i, layer in enumerate(inner.layers):
        attn, mlp = layer.self_attn, layer.mlp
        qkv, qkv_bias = _fuse_rows([attn.q_proj, attn.k_proj, attn.v_proj], attn.q_proj.bias is not None)
        gate_up, _ = _fuse_rows([mlp.gate_proj, mlp.up_proj], False)
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        pre_ff, post_ff = getattr(layer, "pre_feedforward_layernorm", None), getattr(layer, "post_feedforward_layernorm", None)
        sliding = types[i] == "sliding_attention"
        layers.append(GemmaLayerWeights(
            input_norm=layer.input_layernorm.weight.detach(), qkv=qkv, qkv_bias=qkv_bias,
            q_norm=None if q_norm is None else q_norm.weight.detach(),
            k_norm=None if k_norm is None else k_norm.weight.detach(),
            o=attn.o_proj.weight.detach(), o_bias=None if attn.o_proj.bias is None else attn.o_proj.bias.detach(),
            post_attn_norm=layer.post_attention_layernorm.weight.detach(),
            pre_ff_norm=None if pre_ff is None else pre_ff.weight.detach(),
            post_ff_norm=None if post_ff is None else post_ff.weight.detach(),
            gate_up=gate_up, down=mlp.down_proj.weight.detach(),
            window=int(config.sliding_window) if sliding and config.sliding_window else 0,
            rope=kinds.index(types[i]) if len(kinds) > 1 else 0,
        ))
    embed = inner.embed_tokens.weight.detach()
    scale = getattr(inner.embed_tokens, "embed_scale", None)  # fp32 [] buffer in transformers 5
    scale = torch.tensor(config.hidden_size ** 0.5) if scale is None else scale.detach()
    attn0 = inner.layers[0].self_attn
    return GemmaWeights(
        embed=embed, embed_scale=scale.to(device=embed.device, dtype=embed.dtype), layers=layers,
        final_norm=inner.norm.weight.detach(), lm_head=model.lm_head.weight.detach(),
        vocab_size=int(model.lm_head.weight.shape[0]), num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads, head_dim=attn0.head_dim, eps=norm_eps(model, config.rms_norm_eps),
        scale=attention_scale(inner.layers), attn_softcap=_attention_softcap(model),
        final_softcap=float(getattr(config, "final_logit_softcapping", None) or 0.0),
    )


class GemmaDecoder:
    """The forward of one Gemma-family model over the paged cache (PagedDecoder's interface)."""

    def __init__(self, weights: GemmaWeights, cos_sin: torch.Tensor,
                 k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]):
        self.w = weights
        self.cos_sin = cos_sin  # [R, max_position, Dh] fp32 (windows.layer_type_cos_sin)
        self.k_caches = k_caches  # per layer [num_blocks, block_size, Hkv, Dh]
        self.v_caches = v_caches

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, weight, self.w.eps, gemma_style=True)

    def _attention(self, i: int, layer: GemmaLayerWeights, hidden: torch.Tensor, meta: ForwardMetadata,
                   workspace: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden [T, D] (normed) -> (O projection [T, D], the step's attention workspace)."""
        w = self.w
        num_tokens = hidden.shape[0]
        q_size, kv_size = w.num_heads * w.head_dim, w.num_kv_heads * w.head_dim
        qkv = ops.linear(hidden, layer.qkv, layer.qkv_bias)  # [T, (Hq + 2 Hkv) Dh]
        q = qkv[:, :q_size].view(num_tokens, w.num_heads, w.head_dim)
        k = qkv[:, q_size:q_size + kv_size].view(num_tokens, w.num_kv_heads, w.head_dim)
        v = qkv[:, q_size + kv_size:].view(num_tokens, w.num_kv_heads, w.head_dim)
        if layer.q_norm is not None:  # Gemma-3: (1 + weight) per head, before the rotation
            q = self._norm(q.contiguous(), layer.q_norm)
            k = self._norm(k.contiguous(), layer.k_norm)
        ops.rope_and_write_kv(q, k, v, meta.positions, self.cos_sin[layer.rope], self.k_caches[i],
                              self.v_caches[i], meta.slot_mapping)
        if workspace is None:
            workspace = attention_workspace(q, self.k_caches[0], meta)
        extra = {}
        if layer.window:
            extra["sliding_window"] = layer.window
        if w.attn_softcap:
            extra["logit_softcap"] = w.attn_softcap
        attn = paged_attention(q, self.k_caches[i], self.v_caches[i], meta, w.scale, workspace,
                               **extra)  # [T, Hq, Dh]
        return ops.linear(attn.view(num_tokens, q_size), layer.o, layer.o_bias), workspace

    def forward(self, input_ids: torch.Tensor, meta: ForwardMetadata,
                logits_rows: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [T] -> logits [R, V] for the rows `logits_rows` [R] of the T tokens (all
        when None), in the model's dtype."""
        w = self.w
        eps = w.eps
        workspace = None
        residual = F.embedding(input_ids, w.embed) * w.embed_scale  # [T, D]
        hidden = self._norm(residual, w.layers[0].input_norm)
        for i, layer in enumerate(w.layers):
            hidden, workspace = self._attention(i, layer, hidden, meta, workspace)
            if layer.pre_ff_norm is None:  # Gemma: Llama's layout, the norm after the add
                ops.fused_add_rms_norm(hidden, residual, layer.post_attn_norm, eps, gemma_style=True)
            else:  # Gemma-2/3: norm the attention output, add, norm the MLP input
                hidden = self._norm(hidden, layer.post_attn_norm)
                ops.fused_add_rms_norm(hidden, residual, layer.pre_ff_norm, eps, gemma_style=True)
            act = ops.gate_up_silu(hidden, layer.gate_up, activation="gelu_tanh")  # [T, I]
            hidden = ops.linear(act, layer.down)
            if layer.post_ff_norm is not None:
                hidden = self._norm(hidden, layer.post_ff_norm)
            after = w.layers[i + 1].input_norm if i + 1 < len(w.layers) else w.final_norm
            ops.fused_add_rms_norm(hidden, residual, after, eps, gemma_style=True)
        if logits_rows is not None:
            hidden = hidden[logits_rows]
        logits = ops.linear(hidden, w.lm_head)  # [R, V]
        if w.final_softcap:  # HF's order and rounding: / cap, tanh, * cap in the dtype
            logits = logits.div_(w.final_softcap).tanh_().mul_(w.final_softcap)
        return logits
