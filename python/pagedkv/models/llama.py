"""The Llama-family decoder (Llama, Qwen2, Qwen3, Mistral, Phi-3, ...: models/registry.py) on
pagedkv ops, HF's weights.

One forward runs a flat batch of tokens: prefill chunks and decode tokens alike are rows of
`input_ids [T]`; where each token's K/V go and what each query attends to comes from the step's
metadata (slot_mapping, block tables, context lengths). Per layer:

    fused add+RMSNorm -> QKV GEMM (one weight) -> RoPE (+ Qwen3 q/k norm) + write K,V to the cache
    -> attention -> O GEMM -> fused add+RMSNorm -> gate_up GEMM (one weight) + SiLU*mul -> down GEMM

QKV and gate/up are fused ONCE without extra memory: the fused tensor is allocated, the HF
weights are copied in, and HF's parameters are re-pointed to views of it. The HF model keeps
working, and training (its weights are the same values, now slices of the fused tensors).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from pagedkv import ops
from pagedkv.layers.attention import ForwardMetadata, attention_workspace, paged_attention
from pagedkv.layers.hf_rounding import rms_norm_fp32_weight, rotate_fp32
from pagedkv.layers.moe import MoEWeights, moe_mlp, moe_weights
from pagedkv.layers.rotary import identity_rotation
from pagedkv.models.interleaved_rope import INTERLEAVED_ROPE_MODEL_TYPES, fuse_qkv_halves
from pagedkv.models.native_weights import NativeWeights, attention_scale, module_setting, norm_eps
from pagedkv.models.windows import layer_windows
from pagedkv.quant.dispatch import LinearWeight, apply_gate_up_silu, apply_linear


@dataclasses.dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor  # [D]
    # The linears: dense tensors, or a quantized checkpoint's packed weights (quant/dispatch.py)
    qkv: LinearWeight  # [(Hq + 2 * Hkv) * Dh, D]
    qkv_bias: torch.Tensor | None  # [(Hq + 2 * Hkv) * Dh] (Qwen2)
    q_norm: torch.Tensor | None  # [Dh] (Qwen3); [Hq * Dh]: over all heads (OLMoE)
    k_norm: torch.Tensor | None  # [Dh] (Qwen3); [Hkv * Dh] (OLMoE)
    o: LinearWeight  # [D, Hq * Dh]
    o_bias: torch.Tensor | None  # [D] (Llama's attention_bias=True)
    post_norm: torch.Tensor  # [D]
    gate_up: LinearWeight | None  # [2 * I, D]; a MoE layer's shared expert's, or None without one
    down: LinearWeight | None  # [D, I]
    moe: MoEWeights | None = None  # a mixture-of-experts MLP (layers/moe.py; gate_up/down: its shared expert)


@dataclasses.dataclass(slots=True)
class DecoderWeights(NativeWeights[LayerWeights]):
    """The model's weights as the forward uses them (the shared fields: models/native_weights.py);
    shapes in the field comments."""

    windows: list[int]  # [num_layers]: each layer's sliding window, 0 = whole context (models/windows.py)
    # Granite's scalars (1.0 elsewhere, and then skipped): the embedding times embedding_multiplier,
    # each sublayer's output times residual_multiplier before its residual add, logits / logits_scaling.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # HF's rounding where it is not Llama's (layers/hf_rounding.py), for the types that compute so:
    # RMSNorm's weight times the fp32 value, rounded once (Helium); the rotation in fp32 with fp32
    # cos/sin, rounded once (ERNIE-4.5). Identical to Llama's in fp32.
    norm_fp32_weight: bool = False
    rope_fp32: bool = False


def _fuse_rows(linears: list[torch.nn.Linear], with_bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the weights (and biases) of `linears` along the output rows into one tensor,
    and re-point each Linear's parameters to its slice, so nothing is stored twice."""
    weights = [lin.weight for lin in linears]
    fused = torch.cat([w.detach() for w in weights])
    fused_bias = torch.cat([lin.bias.detach() for lin in linears]) if with_bias else None
    row = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight.data = fused[row:row + rows]
        if with_bias:
            lin.bias.data = fused_bias[row:row + rows]
        row += rows
    return fused, fused_bias


def extract_weights(model) -> DecoderWeights:
    """Take (and fuse, in place) the weights of an HF Llama-family *ForCausalLM (registry.py's types).
    Call once per model (runtime/model.py keeps the result): weights written in place later
    (load_state_dict, optimizer steps) are seen, being HF's own tensors; new tensors, modules,
    dtypes or devices are not, so runtime/model.py takes the weights again when the model's
    fingerprint changed. Call outside inference mode: HF's parameters become views of the fused
    tensors, and must stay trainable."""
    config = model.config
    inner = model.model
    layers = []
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        moe = moe_weights(mlp, config.model_type)
        # A MoE layer's dense weights are its shared expert's (Qwen2-MoE), if it has one.
        dense = mlp._modules.get("shared_expert", mlp if moe is None else None)
        if "qkv_proj" in attn._modules:  # Phi-3 stores them fused already: [q; k; v], [gate; up]
            qkv = attn.qkv_proj.weight.detach()
            qkv_bias = None if attn.qkv_proj.bias is None else attn.qkv_proj.bias.detach()
            gate_up = mlp.gate_up_proj.weight.detach()
        elif config.model_type in INTERLEAVED_ROPE_MODEL_TYPES:  # q/k rows permuted: models/interleaved_rope.py
            qkv, qkv_bias = fuse_qkv_halves(attn, attn.head_dim)
            gate_up = _fuse_rows([dense.gate_proj, dense.up_proj], False)[0]
        else:
            qkv, qkv_bias = _fuse_rows([attn.q_proj, attn.k_proj, attn.v_proj], attn.q_proj.bias is not None)
            gate_up = None if dense is None else _fuse_rows([dense.gate_proj, dense.up_proj], False)[0]
        q_norm = getattr(attn, "q_norm", None)
        k_norm = getattr(attn, "k_norm", None)
        layers.append(LayerWeights(
            input_norm=layer.input_layernorm.weight.detach(),
            qkv=qkv, qkv_bias=qkv_bias,
            q_norm=None if q_norm is None else q_norm.weight.detach(),
            k_norm=None if k_norm is None else k_norm.weight.detach(),
            o=attn.o_proj.weight.detach(),
            o_bias=None if attn.o_proj.bias is None else attn.o_proj.bias.detach(),
            post_norm=layer.post_attention_layernorm.weight.detach(),
            gate_up=gate_up, down=None if dense is None else dense.down_proj.weight.detach(), moe=moe,
        ))
    attn0 = inner.layers[0].self_attn
    head_dim = attn0.head_dim
    return DecoderWeights(
        embed=inner.embed_tokens.weight.detach(), layers=layers,
        final_norm=inner.norm.weight.detach(), lm_head=model.lm_head.weight.detach(),
        vocab_size=int(model.lm_head.weight.shape[0]),
        num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
        head_dim=head_dim, eps=norm_eps(model, config.rms_norm_eps), scale=attention_scale(inner.layers),
        windows=layer_windows(config),
        # Granite: HF's modules hold these (set from the config at init); the logits' scaling it
        # reads off the config at each call
        embedding_multiplier=module_setting([("model", inner)], ("embedding_multiplier",),
                                            getattr(config, "embedding_multiplier", 1.0), "embedding multiplier"),
        residual_multiplier=module_setting([(f"model.layers.{i}", layer) for i, layer in enumerate(inner.layers)],
                                           ("residual_multiplier",), getattr(config, "residual_multiplier", 1.0),
                                           "residual multiplier"),
        logits_scaling=float(getattr(config, "logits_scaling", 1.0)),
        norm_fp32_weight=config.model_type == "helium", rope_fp32=config.model_type == "ernie4_5",
    )


class PagedDecoder:
    """The forward of one Llama-family model over the paged cache. Holds no per-step state."""

    def __init__(self, weights: DecoderWeights, cos_sin_cache: torch.Tensor | None,
                 k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], tp=None, rope=None):
        self.w = weights
        self.cos_sin_cache = cos_sin_cache  # [max_position, Dh] fp32: cos | sin halves
        # layers/rotary.py RopeByLength (rope "dynamic"/"longrope", cos_sin_cache None): each
        # step's cos/sin rows computed from its tokens' positions and S (meta.rope_lens)
        self.rope = rope
        self.k_caches = k_caches  # per layer [num_blocks, block_size, Hkv, Dh]
        self.v_caches = v_caches
        # pagedkv.runtime.parallel.TensorParallel when `weights` are one rank's shard: the O and down
        # products are partial sums (all-reduced) and the logits one vocabulary slice (gathered).
        self.tp = tp
        # ERNIE-4.5: one position whose rotation is the identity (its rotation runs in fp32 first)
        self.identity = identity_rotation(weights.head_dim, weights.embed.device) if weights.rope_fp32 else None

    def _add_norm(self, hidden: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> None:
        """residual += hidden (summed over the ranks first when hidden is a rank's partial O or
        down product); hidden = rms_norm(residual) * weight. In place."""
        if self.w.residual_multiplier != 1.0:  # Granite: HF rounds the product, then the sum
            hidden.mul_(self.w.residual_multiplier)
        if self.w.norm_fp32_weight:  # Helium (never sharded)
            residual.add_(hidden)
            hidden.copy_(rms_norm_fp32_weight(residual, weight, self.w.eps))
        elif self.tp is None:
            ops.fused_add_rms_norm(hidden, residual, weight, self.w.eps)
        else:
            self.tp.all_reduce_add_rms_norm(hidden, residual, weight, self.w.eps)

    def forward(self, input_ids: torch.Tensor, meta: ForwardMetadata,
                logits_rows: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [T] -> logits [R, V] for the rows `logits_rows` [R] of the T tokens (all
        when None), in the model's dtype."""
        w = self.w
        num_tokens = input_ids.shape[0]
        q_size, kv_size = w.num_heads * w.head_dim, w.num_kv_heads * w.head_dim
        # Attention's split workspace, shared by the layers: made at the first layer, when q's
        # shape is known.
        workspace = None
        residual = F.embedding(input_ids, w.embed)  # [T, D]
        if w.embedding_multiplier != 1.0:  # Granite
            residual.mul_(w.embedding_multiplier)
        norm = rms_norm_fp32_weight if w.norm_fp32_weight else ops.rms_norm
        hidden = norm(residual, w.layers[0].input_norm, w.eps)
        rope_rows, table = meta.positions, self.cos_sin_cache
        if self.rope is not None:  # this step's own table [T, rot_dim]: token t reads row t
            lens = meta.positions.long() + 1 if meta.rope_lens is None else meta.rope_lens
            table = self.rope.cos_sin(meta.positions, lens)
            rope_rows = torch.arange(num_tokens, dtype=torch.int32, device=input_ids.device)
        fp32_rows, fp32_table = rope_rows, table
        if w.rope_fp32:  # rotated below in fp32; the kernel then only writes K, V (cos 1, sin 0)
            rope_rows, table = torch.zeros_like(rope_rows), self.identity
        for i, layer in enumerate(w.layers):
            qkv = apply_linear(hidden, layer.qkv, layer.qkv_bias)  # [T, (Hq + 2 Hkv) Dh]
            q = qkv[:, :q_size].view(num_tokens, w.num_heads, w.head_dim)
            k = qkv[:, q_size:q_size + kv_size].view(num_tokens, w.num_kv_heads, w.head_dim)
            v = qkv[:, q_size + kv_size:].view(num_tokens, w.num_kv_heads, w.head_dim)
            q_norm, k_norm = layer.q_norm, layer.k_norm
            if q_norm is not None and q_norm.shape[0] != w.head_dim:  # OLMoE: over all heads at once
                q = ops.rms_norm(qkv[:, :q_size].contiguous(), q_norm, w.eps).view_as(q)
                k = ops.rms_norm(qkv[:, q_size:q_size + kv_size].contiguous(), k_norm, w.eps).view_as(k)
                q_norm = k_norm = None
            if w.rope_fp32:  # ERNIE-4.5 (no q/k norms)
                q, k = rotate_fp32(q, fp32_table, fp32_rows), rotate_fp32(k, fp32_table, fp32_rows)
            ops.rope_and_write_kv(q, k, v, rope_rows, table, self.k_caches[i],
                                  self.v_caches[i], meta.slot_mapping, q_norm_weight=q_norm,
                                  k_norm_weight=k_norm, epsilon=w.eps)
            if i == 0:
                workspace = attention_workspace(q, self.k_caches[0], meta)
            attn = paged_attention(q, self.k_caches[i], self.v_caches[i], meta, w.scale, workspace,
                                   sliding_window=w.windows[i])  # [T, Hq, Dh]
            hidden = apply_linear(attn.view(num_tokens, q_size), layer.o, layer.o_bias)
            self._add_norm(hidden, residual, layer.post_norm)
            if layer.moe is not None:
                shared = None if layer.gate_up is None else apply_linear(apply_gate_up_silu(hidden, layer.gate_up),
                                                                         layer.down)  # Qwen2-MoE's shared expert
                hidden = moe_mlp(hidden, layer.moe, shared)  # [T, D]
            else:
                act = apply_gate_up_silu(hidden, layer.gate_up)  # [T, I]
                hidden = apply_linear(act, layer.down)
            after = w.layers[i + 1].input_norm if i + 1 < len(w.layers) else w.final_norm
            self._add_norm(hidden, residual, after)
        if logits_rows is not None:
            hidden = hidden[logits_rows]
        logits = ops.linear(hidden, w.lm_head)
        if w.logits_scaling != 1.0:  # Granite: HF divides (not times the reciprocal)
            logits.div_(w.logits_scaling)
        return logits if self.tp is None else self.tp.gather_vocab(logits, w.vocab_size)

