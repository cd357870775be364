"""AWQ and GPTQ checkpoints (int4 weight-only) read into the Llama-family decoder's weights, each
linear of the decoder layers in pagedkv's W4A16 layout: read once from its packed tensors
(qweight, qzeros, scales[, g_idx]) and repacked (quant.pack_w4a16), never dequantized. The
embedding, norms, biases and LM head (unquantized in these checkpoints) are cast to the
activations' dtype; so is a linear a checkpoint left unquantized (modules_to_not_convert).

    config.json "quantization_config":
        {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": true, "version": "gemm"}
        {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": true, "sym": true,
         "checkpoint_format": "gptq"}   # "gptq_v2": zeros stored as they are, not zero - 1

QKV and gate/up are packed as one weight each when their parts allow it (the same group size
and, with desc_act, the same column order: GPTQ sorts q, k, v by the same input's statistics);
else they stay parts side by side (quant/dispatch.py).
"""

from __future__ import annotations

import dataclasses

import torch

from pagedkv.models.llama import DecoderWeights, LayerWeights
from pagedkv.models.windows import layer_windows
from pagedkv.quant.dispatch import LinearWeight
from pagedkv.quant.int4 import Int4Weight, from_awq, from_gptq
from pagedkv.quant.linear import W4A16Weight, pack_w4a16

QUANT_METHODS = ("awq", "gptq")
AWQ_VERSIONS = ("gemm",)  # AutoAWQ's GEMM packing (quant/int4.py); GEMV and Marlin pack otherwise
AWQ_BACKENDS = ("autoawq",)  # llm-awq's checkpoints pack another way
GPTQ_ZERO_OFFSET = {"gptq": True, "gptq_v2": False}  # checkpoint_format -> zeros stored as zero - 1


@dataclasses.dataclass(frozen=True, slots=True)
class QuantFormat:
    method: str  # "awq" or "gptq"
    group_size: int  # -1: one group over all input columns
    zero_offset: bool  # GPTQ's historical format: zeros stored as zero - 1


def quant_format(quant_config) -> QuantFormat:
    """A config's quantization_config (a dict, or HF's config object) checked: ValueError naming
    the field, its value and what is allowed."""
    if not quant_config:
        raise ValueError("the checkpoint's config.json has no quantization_config; an unquantized "
                         "checkpoint loads with transformers' from_pretrained (then pagedkv.generate)")
    q = quant_config if isinstance(quant_config, dict) else quant_config.to_dict()

    def refuse(field: str, allowed: str) -> ValueError:
        return ValueError(f"quantization_config.{field}={q.get(field)!r} is not supported; supported: {allowed}")

    method = str(q.get("quant_method", "")).lower()
    if method not in QUANT_METHODS:
        raise refuse("quant_method", "'awq', 'gptq' (4-bit, int4 weight-only)")
    if q.get("bits") != 4:
        raise refuse("bits", "4")
    group_size = q.get("group_size")
    if not isinstance(group_size, int) or not (group_size == -1 or (group_size > 0 and group_size % 32 == 0)):
        raise refuse("group_size", "-1 or a multiple of 32 (pagedkv's int4 kernel reads groups of 32 columns)")
    if method == "awq":
        if str(q.get("version", "gemm")).lower() not in AWQ_VERSIONS:
            raise refuse("version", "'gemm'")
        if q.get("backend") not in (None,) + AWQ_BACKENDS:
            raise refuse("backend", "'autoawq'")
        if not q.get("zero_point", True):
            raise refuse("zero_point", "true")
        return QuantFormat("awq", group_size, False)
    if str(q.get("checkpoint_format", "gptq")).lower() not in GPTQ_ZERO_OFFSET:
        raise refuse("checkpoint_format", "'gptq', 'gptq_v2'")
    if q.get("lm_head", False):
        raise refuse("lm_head", "false (pagedkv runs the LM head in the activations' dtype)")
    return QuantFormat("gptq", group_size, GPTQ_ZERO_OFFSET[str(q.get("checkpoint_format", "gptq")).lower()])


def read_quantized(model, reader, fmt: QuantFormat, device: torch.device, dtype: torch.dtype) -> DecoderWeights:
    """The weights of `model` (an HF skeleton on meta: its names and shapes, from
    checkpoint_shards.empty_model) read through `reader` (a SafetensorsReader). Raises
    ValueError naming a missing or misshapen tensor."""
    config, inner = model.config, model.model
    params = dict(model.named_parameters())  # a tied LM head is listed once, as the embedding
    tied = model.lm_head.weight is inner.embed_tokens.weight

    def dense(name: str) -> torch.Tensor | None:
        param = params.get(name)
        if param is None:
            return None
        stored = reader.shape(name)
        if stored != tuple(param.shape):
            raise ValueError(f"pagedkv: tensor {name!r} in {reader.where(name)} has shape {list(stored)}; "
                             f"the config makes it {list(param.shape)}")
        return reader.read(name).to(device=device, dtype=dtype).contiguous()

    def linear(prefix: str) -> Int4Weight | torch.Tensor:
        if f"{prefix}.qweight" not in reader.files:  # left unquantized (modules_to_not_convert)
            return dense(f"{prefix}.weight")
        read = {part: reader.read(f"{prefix}.{part}") for part in ("qweight", "qzeros", "scales")}
        try:
            if fmt.method == "awq":
                w = from_awq(**read, group_size=fmt.group_size)
            else:
                g_idx = reader.read(f"{prefix}.g_idx") if f"{prefix}.g_idx" in reader.files else None
                w = from_gptq(**read, g_idx=g_idx, group_size=fmt.group_size, zero_offset=fmt.zero_offset)
        except ValueError as error:
            raise ValueError(f"pagedkv: {prefix} in {reader.where(prefix + '.qweight')}: {error}") from None
        want = tuple(params[f"{prefix}.weight"].shape)
        if tuple(w.q.shape) != want:
            raise ValueError(f"pagedkv: {prefix}'s packed tensors hold a [{w.q.shape[0]}, {w.q.shape[1]}] "
                             f"weight; the config makes it {list(want)}")
        return w

    def fused(prefixes: list[str]) -> LinearWeight:
        parts = [linear(p) for p in prefixes]
        if all(isinstance(p, torch.Tensor) for p in parts):
            return parts[0] if len(parts) == 1 else torch.cat(parts)
        if all(isinstance(p, Int4Weight) for p in parts) and _same_columns(parts):
            return _to(pack_w4a16(_stack(parts)), device)
        return tuple(_to(pack_w4a16(p), device) if isinstance(p, Int4Weight) else p for p in parts)

    def bias(prefixes: list[str]) -> torch.Tensor | None:
        found = [dense(f"{p}.bias") for p in prefixes]
        return None if found[0] is None else torch.cat(found)

    layers = []
    for i in range(len(inner.layers)):
        at = f"model.layers.{i}"
        qkv = [f"{at}.self_attn.{n}_proj" for n in "qkv"]
        layers.append(LayerWeights(
            input_norm=dense(f"{at}.input_layernorm.weight"), qkv=fused(qkv), qkv_bias=bias(qkv),
            q_norm=dense(f"{at}.self_attn.q_norm.weight"), k_norm=dense(f"{at}.self_attn.k_norm.weight"),
            o=fused([f"{at}.self_attn.o_proj"]), o_bias=bias([f"{at}.self_attn.o_proj"]),
            post_norm=dense(f"{at}.post_attention_layernorm.weight"),
            gate_up=fused([f"{at}.mlp.gate_proj", f"{at}.mlp.up_proj"]), down=fused([f"{at}.mlp.down_proj"]),
        ))
    embed = dense("model.embed_tokens.weight")
    attn0 = inner.layers[0].self_attn
    return DecoderWeights(
        embed=embed, layers=layers, final_norm=dense("model.norm.weight"),
        lm_head=embed if tied else dense("lm_head.weight"), vocab_size=int(model.lm_head.weight.shape[0]),
        num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
        head_dim=attn0.head_dim, eps=float(config.rms_norm_eps), scale=float(attn0.scaling),
        windows=layer_windows(config),
    )


def _same_columns(parts: list[Int4Weight]) -> bool:
    """Whether the parts can be one packed weight: the same groups over the same column order."""
    first = parts[0]
    for p in parts[1:]:
        if p.group_size != first.group_size or p.scales.dtype != first.scales.dtype:
            return False
        if (p.perm is None) != (first.perm is None) or (p.perm is not None and not torch.equal(p.perm, first.perm)):
            return False
    return True


def _stack(parts: list[Int4Weight]) -> Int4Weight:
    """Parts with the same columns (_same_columns) as one weight, their output rows in order."""
    return Int4Weight(q=torch.cat([p.q for p in parts]), scales=torch.cat([p.scales for p in parts]),
                      zeros=torch.cat([p.zeros for p in parts]), group_size=parts[0].group_size,
                      perm=parts[0].perm)


def _to(w: W4A16Weight, device: torch.device) -> W4A16Weight:
    return W4A16Weight(packed=w.packed.to(device), scales=w.scales.to(device), zeros=w.zeros.to(device),
                       group_size=w.group_size, perm=None if w.perm is None else w.perm.to(device))
