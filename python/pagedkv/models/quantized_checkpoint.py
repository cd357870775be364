"""Quantized checkpoints read into the Llama-family decoder's weights, each linear of the decoder
layers read once from its stored tensors into its kernel's layout, never dequantized:

    int4 (W4A16)  AWQ, GPTQ (qweight, qzeros, scales[, g_idx]); compressed-tensors pack-quantized
                  (weight_packed, weight_scale, weight_shape); torchao tile_packed_to_4d
                  (_weight_qdata, _weight_scale_and_zero: float zeros) -> quant.pack_w4a16
    FP8           FineGrainedFP8 (weight, weight_scale_inv); compressed-tensors float-quantized
                  (weight, weight_scale) -> quant.Fp8Weight as stored
    NF4           bitsandbytes (weight, weight.absmax, weight.quant_map, [weight.nested_*],
                  weight.quant_state.bitsandbytes__nf4) -> quant.pack_nf4
    int8          bitsandbytes LLM.int8 (weight, SCB[, weight_format]) -> quant.Int8Weight as stored

The config's quantization_config is checked by quant/formats.py. The embedding, norms, biases
and LM head (unquantized in these checkpoints) are cast to the activations' dtype; so is a
linear a checkpoint left unquantized (modules_to_not_convert, ignore, llm_int8_skip_modules):
one without its format's quantized tensors.

A mixture-of-experts layer's experts are read by models/quantized_moe.py (FP8, int4, or dense
where the checkpoint left them unquantized).

QKV and gate/up are one weight each when their parts allow it (int4: the same group size and,
with desc_act, the same column order, as GPTQ sorts q, k, v by the same input's statistics;
FP8: the same scale columns and no scale block across two parts; NF4: the same blocks; int8:
always); else
they stay parts side by side (quant/dispatch.py).
"""

from __future__ import annotations

import dataclasses

import torch

from pagedkv.layers.moe import moe_weights
from pagedkv.models.llama import DecoderWeights, LayerWeights
from pagedkv.models.native_weights import attention_scale, norm_eps
from pagedkv.models.quantized_moe import read_moe
from pagedkv.models.windows import layer_windows
from pagedkv.quant.dispatch import LinearWeight
from pagedkv.quant.formats import QuantFormat, quant_format
from pagedkv.quant.fp8 import Fp8Weight, from_compressed_tensors_fp8, from_finegrained_fp8
from pagedkv.quant.int4 import Int4Weight, from_awq, from_compressed_tensors_int4, from_gptq
from pagedkv.quant.int8 import Int8Weight, from_bnb_int8
from pagedkv.quant.linear import pack_w4a16
from pagedkv.quant.linear_nf4 import pack_nf4
from pagedkv.quant.nf4 import Nf4Weight, from_bnb_nf4
from pagedkv.quant.torchao_int4 import from_torchao_tile_packed

__all__ = ["QuantFormat", "quant_format", "read_quantized"]
# The tensor that marks a linear as quantized in each format (absent: left unquantized, dense)
MARKERS = {"awq": "qweight", "gptq": "qweight", "compressed-tensors w4a16": "weight_packed",
           "fp8": "weight_scale_inv", "compressed-tensors fp8": "weight_scale",
           "bitsandbytes nf4": "weight.quant_state.bitsandbytes__nf4", "bitsandbytes int8": "SCB",
           "torchao int4": "_weight_qdata"}
# torchao's optional inner tensors that change what a weight computes (AWQ-style activation scales)
TORCHAO_REFUSED = ("_weight_act_pre_scale",)
Quantized = Int4Weight | Fp8Weight | Nf4Weight | Int8Weight


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

    def linear(prefix: str, expert: bool = False) -> Quantized | torch.Tensor:
        """expert: one expert's projection, checked against the skeleton by models/quantized_moe.py."""
        marker = f"{prefix}.{MARKERS[fmt.name]}"
        if marker not in reader.files:  # left unquantized
            if expert:
                if f"{prefix}.weight" not in reader.files:
                    raise ValueError(f"pagedkv: the checkpoint has no {prefix!r} (an expert's projection)")
                return reader.read(f"{prefix}.weight")
            return dense(f"{prefix}.weight")
        try:
            shape = None if expert else tuple(params[f"{prefix}.weight"].shape)
            w = _read_linear(reader, prefix, fmt, shape)
        except ValueError as error:
            raise ValueError(f"pagedkv: {prefix} in {reader.where(marker)}: {error}") from None
        if expert:
            return w
        want = tuple(params[f"{prefix}.weight"].shape)
        got = tuple((w.weight if isinstance(w, Fp8Weight) else w.q).shape)
        if got != want:
            raise ValueError(f"pagedkv: {prefix}'s quantized tensors hold a [{got[0]}, {got[1]}] weight; the "
                             f"config makes it {list(want)}")
        return w

    def fused(prefixes: list[str]) -> LinearWeight:
        parts = [linear(p) for p in prefixes]
        if all(isinstance(p, torch.Tensor) for p in parts):
            return parts[0] if len(parts) == 1 else torch.cat(parts)
        one = _stack(parts)
        if one is not None:
            return _kernel_layout(one, device)
        return tuple(p if isinstance(p, torch.Tensor) else _kernel_layout(p, device) for p in parts)

    def bias(prefixes: list[str]) -> torch.Tensor | None:
        found = [dense(f"{p}.bias") for p in prefixes]
        return None if found[0] is None else torch.cat(found)

    layers = []
    for i in range(len(inner.layers)):
        at = f"model.layers.{i}"
        qkv = [f"{at}.self_attn.{n}_proj" for n in "qkv"]
        moe = moe_weights(inner.layers[i].mlp, config.model_type)  # the skeleton's routing settings
        # A MoE layer's dense MLP is its shared expert (Qwen2-MoE), if it has one.
        mlp = f"{at}.mlp" if moe is None else f"{at}.mlp.shared_expert"
        dense_mlp = moe is None or moe.shared_gate is not None
        if moe is not None:
            moe = read_moe(moe, reader, at, config.model_type, lambda prefix: linear(prefix, expert=True), device,
                           dtype)
        layers.append(LayerWeights(
            input_norm=dense(f"{at}.input_layernorm.weight"), qkv=fused(qkv), qkv_bias=bias(qkv),
            q_norm=dense(f"{at}.self_attn.q_norm.weight"), k_norm=dense(f"{at}.self_attn.k_norm.weight"),
            o=fused([f"{at}.self_attn.o_proj"]), o_bias=bias([f"{at}.self_attn.o_proj"]),
            post_norm=dense(f"{at}.post_attention_layernorm.weight"),
            gate_up=fused([f"{mlp}.gate_proj", f"{mlp}.up_proj"]) if dense_mlp else None,
            down=fused([f"{mlp}.down_proj"]) if dense_mlp else None, moe=moe,
        ))
    embed = dense("model.embed_tokens.weight")
    attn0 = inner.layers[0].self_attn
    return DecoderWeights(
        embed=embed, layers=layers, final_norm=dense("model.norm.weight"),
        lm_head=embed if tied else dense("lm_head.weight"), vocab_size=int(model.lm_head.weight.shape[0]),
        num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
        head_dim=attn0.head_dim, eps=norm_eps(model, config.rms_norm_eps), scale=attention_scale(inner.layers),
        windows=layer_windows(config),
    )


def _read_linear(reader, prefix: str, fmt: QuantFormat, shape: tuple[int, int] | None = None) -> Quantized:
    """One linear's stored tensors through its format's reader (quant/) -> its canonical form.
    shape: the linear's [out, in] (torchao stores it padded; None: an expert's, refused there)."""
    def read(*names: str) -> dict[str, torch.Tensor]:
        return {name: reader.read(f"{prefix}.{name}") for name in names}

    if fmt.name == "torchao int4":
        if shape is None:
            raise ValueError("torchao int4 experts are not read (supported: torchao int4 decoder linears; "
                             "MoE experts as FP8 or AWQ/GPTQ/compressed-tensors int4)")
        for extra in TORCHAO_REFUSED:
            if f"{prefix}.{extra}" in reader.files:
                raise ValueError(f"{extra} is stored (activation pre-scaling); supported: torchao int4 layers "
                                 "without it")
        return from_torchao_tile_packed(reader.read(f"{prefix}._weight_qdata"),
                                        reader.read(f"{prefix}._weight_scale_and_zero"), *shape, fmt.group_size)
    if fmt.name == "awq":
        return from_awq(**read("qweight", "qzeros", "scales"), group_size=fmt.group_size)
    if fmt.name == "gptq":
        g_idx = reader.read(f"{prefix}.g_idx") if f"{prefix}.g_idx" in reader.files else None
        return from_gptq(**read("qweight", "qzeros", "scales"), g_idx=g_idx, group_size=fmt.group_size,
                         zero_offset=fmt.zero_offset)
    if fmt.name == "compressed-tensors w4a16":
        for extra in ("weight_zero_point", "weight_g_idx"):
            if f"{prefix}.{extra}" in reader.files:
                raise ValueError(f"{extra} is stored (an asymmetric or group-act-order layer); supported: "
                                 "symmetric layers without weight_zero_point or weight_g_idx")
        return from_compressed_tensors_int4(**read("weight_packed", "weight_scale", "weight_shape"),
                                            group_size=fmt.group_size)
    if fmt.name == "fp8":
        return from_finegrained_fp8(**read("weight", "weight_scale_inv"), block_size=fmt.block)
    if fmt.name == "compressed-tensors fp8":
        return from_compressed_tensors_fp8(**read("weight", "weight_scale"), block_size=fmt.block)
    if fmt.name == "bitsandbytes int8":
        if shape is None:
            raise ValueError("LLM.int8 experts are not read (supported: LLM.int8 decoder linears; MoE experts as FP8 "
                             "or AWQ/GPTQ/compressed-tensors int4)")
        stored_format = f"{prefix}.weight_format"
        return from_bnb_int8(reader.read(f"{prefix}.weight"), reader.read(f"{prefix}.SCB"),
                             reader.read(stored_format) if stored_format in reader.files else None)
    state = {name: reader.read(name) for name in reader.files if name.startswith(f"{prefix}.weight.")}
    return from_bnb_nf4(reader.read(f"{prefix}.weight"), state)


def _stack(parts: list) -> Quantized | None:
    """Parts of one fused layer (QKV, gate/up) as one weight, their output rows in order, or None
    where they cannot share one: a part left dense, other groups or column orders (int4),
    other scale columns or a scale block across two parts (FP8), other blocks (NF4). int8
    parts always stack (a scale a row)."""
    first = parts[0]
    if len(parts) == 1:
        return first
    if not all(type(p) is type(first) for p in parts):
        return None
    if isinstance(first, Int4Weight):
        for p in parts[1:]:
            if (p.group_size != first.group_size or p.scales.dtype != first.scales.dtype
                    or p.zeros.dtype != first.zeros.dtype):
                return None
            if (p.perm is None) != (first.perm is None) or (p.perm is not None and not torch.equal(p.perm, first.perm)):
                return None
        return Int4Weight(q=torch.cat([p.q for p in parts]), scales=torch.cat([p.scales for p in parts]),
                          zeros=torch.cat([p.zeros for p in parts]), group_size=first.group_size, perm=first.perm)
    if isinstance(first, Fp8Weight):
        parts = [_per_row(p) if p.block == tuple(p.weight.shape) else p for p in parts]  # per tensor: exact
        block = parts[0].block
        if any(p.block != block for p in parts) or any(p.weight.shape[0] % block[0] for p in parts[:-1]):
            return None
        return Fp8Weight(weight=torch.cat([p.weight for p in parts]), scales=torch.cat([p.scales for p in parts]),
                         block=block)
    if isinstance(first, Int8Weight):
        return Int8Weight(q=torch.cat([p.q for p in parts]), scb=torch.cat([p.scb for p in parts]))
    if any(p.block_size != first.block_size or not torch.equal(p.code, first.code) for p in parts[1:]):
        return None
    return Nf4Weight(q=torch.cat([p.q for p in parts]), absmax=torch.cat([p.absmax for p in parts]),
                     code=first.code, block_size=first.block_size)


def _per_row(w: Fp8Weight) -> Fp8Weight:
    """A per-tensor FP8 weight with its one scale repeated per output row (the same W)."""
    return Fp8Weight(weight=w.weight, scales=w.scales.expand(w.weight.shape[0], 1).contiguous(),
                     block=(1, w.weight.shape[1]))


def _kernel_layout(w: Quantized, device: torch.device) -> LinearWeight:
    """A canonical form repacked for its linear op (quant/dispatch.py), moved to `device`."""
    packed = pack_w4a16(w) if isinstance(w, Int4Weight) else pack_nf4(w) if isinstance(w, Nf4Weight) else w
    moved = {f.name: getattr(packed, f.name) for f in dataclasses.fields(packed)}
    return type(packed)(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in moved.items()})
