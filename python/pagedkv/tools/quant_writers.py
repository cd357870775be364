"""Reference quantizers that write one linear layer's fp weight [out, in] in the exact on-disk
tensors of a quantized checkpoint format, for tests and benchmarks/bench_quantized.py (which
writes checkpoints of a 7B shape with them, so they are vectorized and run on w's device):

    to_finegrained              transformers' FineGrainedFP8 (e4m3, block or per-tensor scales,
                                UE8M0 power-of-two scales): weight, weight_scale_inv
    to_compressed_tensors_int4  compressed-tensors' symmetric W4A16 "pack-quantized":
                                weight_packed, weight_scale, weight_shape
    to_bnb_nf4                  bitsandbytes' serialized Params4bit (NF4, with or without double
                                quantization): weight, weight.absmax, weight.quant_map, ...
    to_bnb_int8                 bitsandbytes' serialized Linear8bitLt (LLM.int8): weight, SCB
                                [, weight_format]
    ct_config                   a compressed-tensors quantization_config as llm-compressor writes it
    to_torchao_int4             torchao's Int4WeightOnlyConfig "tile_packed_to_4d" as transformers
                                saves it: _weight_qdata, _weight_scale_and_zero (tinygemm_qparams:
                                its qparams; the packing is pagedkv.quant.torchao_int4's, checked
                                against torch's own packing kernel by tests/test_quant_torchao_int4.py;
                                its config.json entry: pagedkv.quant.formats.torchao_int4_config)

Each format's own dequantization formula, transcribed loop by loop from its package, stays in
tests/ (fp8_formats.py, int4_formats.py, nf4_formats.py, int8_formats.py): the references these are checked
against (tests/test_quant_writers.py), independently of pagedkv.quant's readers.
"""

from __future__ import annotations

import json

import torch

from pagedkv.quant.torchao_int4 import K_PAD, N_PAD, pack_tile_packed

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448

# bitsandbytes' get_4bit_type("nf4")
NF4_CODE = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
            -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
            0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
            0.7229568362236023, 1.0]


def _fp8_scales(amax: torch.Tensor, ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' Fp8Quantize per tile: scale = 448 / amax (1 for an all-zero tile), stored
    scale_inv = 1 / scale (a power of two, rounded up, for ue8m0). -> (scale, scale_inv) fp32."""
    amax = amax.float()
    scale = torch.where(amax > 0, FP8_MAX / amax, torch.ones_like(amax))
    inv = 1.0 / scale
    if ue8m0:
        inv = torch.pow(2.0, torch.ceil(torch.log2(inv)))
        scale = 1.0 / inv
    return scale, inv


def to_finegrained(w: torch.Tensor, block: tuple[int, int] | None, ue8m0: bool = False) -> dict[str, torch.Tensor]:
    """w [out, in] -> weight [out, in] e4m3 + weight_scale_inv [ceil(out/bn), ceil(in/bk)] float32
    (float8_e8m0fnu when ue8m0), edge tiles partial as in the "-FP8" releases; block None: one
    scalar scale. q = clamp(w * scale, +-448) as e4m3, scale of the tile."""
    if block is None:
        scale, inv = _fp8_scales(w.abs().amax(), ue8m0)
        return {"weight": torch.clamp(w.float() * scale, -FP8_MAX, FP8_MAX).to(FP8), "weight_scale_inv": inv.reshape(())}
    bn, bk = block
    out_features, in_features = w.shape
    rows, cols = -(-out_features // bn), -(-in_features // bk)
    padded = w.new_zeros(rows * bn, cols * bk, dtype=torch.float32)  # zeros leave each tile's amax as is
    padded[:out_features, :in_features] = w
    tiles = padded.view(rows, bn, cols, bk)
    scale, inv = _fp8_scales(tiles.abs().amax(dim=(1, 3)), ue8m0)  # [rows, cols]
    q = torch.clamp(tiles * scale[:, None, :, None], -FP8_MAX, FP8_MAX).to(FP8).view(rows * bn, cols * bk)
    return {"weight": q[:out_features, :in_features].contiguous(),
            "weight_scale_inv": inv.to(torch.float8_e8m0fnu) if ue8m0 else inv}


def to_int32(words: torch.Tensor) -> torch.Tensor:
    """uint32 values held in int64 -> the same bits as int32 (what the checkpoints store)."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def to_compressed_tensors_int4(w: torch.Tensor, group_size: int, scale_dtype: torch.dtype = torch.bfloat16
                               ) -> dict[str, torch.Tensor]:
    """compressed-tensors' symmetric int4 "pack-quantized" layer (strategy "group"; group_size =
    in for "channel"): scale = amax / 7.5 per group in scale_dtype, q = clamp(round(w / scale),
    -8, 7), pack_to_int32 along the input: column 8w + i of a row in bits 4i of word w, as q + 8.
    -> weight_packed [out, in/8] int32, weight_scale [out, in/g], weight_shape [2] int64."""
    out_features, in_features = w.shape
    groups = w.float().view(out_features, in_features // group_size, group_size)
    scale = (groups.abs().amax(-1) / 7.5).clamp(min=1e-6).to(scale_dtype)
    q = torch.round(groups / scale.float().unsqueeze(-1)).clamp(-8, 7).long().view(out_features, in_features)
    unsigned = q + 8
    packed = torch.zeros(out_features, in_features // 8, dtype=torch.int64, device=w.device)
    for i in range(8):
        packed |= unsigned[:, i::8] << (4 * i)
    return {"weight_packed": to_int32(packed), "weight_scale": scale,
            "weight_shape": torch.tensor([out_features, in_features])}


def create_dynamic_map(max_exponent_bits: int = 7, total_bits: int = 8) -> torch.Tensor:
    """bitsandbytes' signed 8-bit dynamic codebook (the nested absmax's quant_map) [256] float32."""
    data: list[float] = []
    non_sign_bits = total_bits - 1
    for i in range(max_exponent_bits):
        fraction_items = int(2 ** (i + non_sign_bits - max_exponent_bits) + 1)
        boundaries = torch.linspace(0.1, 1, fraction_items)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    data.append(0)
    data.append(1.0)
    data.sort()
    return torch.tensor(data)


def _nearest(values: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """The index of each value's nearest code (the first on a tie), as uint8 [values.numel()];
    in chunks: a [chunk, len(code)] difference of 2^26 floats (256 MB) at a time."""
    flat = values.reshape(-1)
    chunk = (1 << 26) // code.numel()
    out = torch.empty(flat.numel(), dtype=torch.uint8, device=flat.device)
    for start in range(0, flat.numel(), chunk):
        out[start:start + chunk] = (flat[start:start + chunk, None] - code).abs().argmin(-1)
    return out


def to_bnb_int8(w: torch.Tensor, weight_format: bool = True) -> dict[str, torch.Tensor]:
    """w [out, in] -> one Linear8bitLt's state dict entries (keys "weight", "SCB" and, as
    bitsandbytes writes it, "weight_format" 0 = "row"): each row rounded to int8 under its absmax
    (int8_vectorwise_quant: round(127 * w / absmax))."""
    w = w.float()
    scb = w.abs().amax(-1).clamp_min(1e-12)  # [out]
    q = torch.round(w * (127.0 / scb).unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
    state = {"weight": q, "SCB": scb}
    if weight_format:
        state["weight_format"] = torch.tensor(0, dtype=torch.uint8)
    return state


def to_bnb_nf4(w: torch.Tensor, block_size: int = 64, double_quant: bool = True,
               nested_block: int = 256) -> dict[str, torch.Tensor]:
    """w [out, in] -> the state dict entries of one Linear4bit's weight (keys "weight",
    "weight.absmax", ...: QuantState.as_dict(packed=True) under the layer's prefix). Each run of
    block_size values of the flattened weight -> its nearest NF4 code times the run's absmax,
    two codes a byte (the first in the high nibble); with double_quant the absmax, less its
    mean, in bitsandbytes' 8-bit dynamic code per nested_block of them."""
    out_features, in_features = w.shape
    device = w.device
    code = torch.tensor(NF4_CODE, device=device)
    blocks = w.float().reshape(-1, block_size)
    absmax = blocks.abs().amax(-1)
    q = _nearest(blocks / absmax.unsqueeze(-1), code)
    packed = (q[0::2] << 4) | q[1::2]
    meta = {"quant_type": "nf4", "blocksize": block_size, "dtype": "bfloat16", "shape": [out_features, in_features]}
    state = {"weight": packed.view(-1, 1), "weight.quant_map": code}
    if double_quant:
        offset = absmax.mean()
        centered = absmax - offset
        nested_code = create_dynamic_map().to(device)
        groups = -(-centered.numel() // nested_block)
        padded = centered.new_zeros(groups * nested_block)  # zeros leave each group's max as is
        padded[:centered.numel()] = centered
        padded = padded.view(groups, nested_block)
        nested_absmax = padded.abs().amax(-1)
        qabsmax = _nearest(padded / nested_absmax.unsqueeze(-1), nested_code)[:centered.numel()]
        state.update({"weight.absmax": qabsmax, "weight.nested_absmax": nested_absmax,
                      "weight.nested_quant_map": nested_code})
        meta.update({"nested_blocksize": nested_block, "nested_dtype": "float32", "nested_offset": offset.item()})
    else:
        state["weight.absmax"] = absmax
    state["weight.quant_state.bitsandbytes__nf4"] = torch.tensor(list(json.dumps(meta).encode("utf-8")),
                                                                 dtype=torch.uint8)
    return state


def ct_config(fmt: str, weights: dict, input_activations: dict | None = None) -> dict:
    """A compressed-tensors quantization_config as llm-compressor writes it (one scheme over every
    Linear but the LM head): fmt "pack-quantized" (int4) or "float-quantized" (FP8)."""
    group = {"targets": ["Linear"], "weights": {"symmetric": True, "dynamic": False, **weights},
             "input_activations": input_activations, "output_activations": None}
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": group}, "ignore": ["lm_head"], "kv_cache_scheme": None}


def tinygemm_qparams(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q [N, K] uint8 0..15, scale and zero [N, K / g] bf16) as torchao's tinygemm
    qparams make them: scale = (max - min) / 15, zero = min + 8 scale, w ~ (q - 8) scale + zero."""
    groups = w.float().view(w.shape[0], -1, group_size)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scale = ((high - low).clamp(min=1e-6) / 15).to(torch.bfloat16)
    zero = (low + 8 * scale.float()).to(torch.bfloat16)
    q = ((groups - zero.float()) / scale.float() + 8).round().clamp(0, 15).to(torch.uint8)
    return q.view(w.shape), scale.squeeze(-1), zero.squeeze(-1)


def to_torchao_int4(w: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """A linear's weight as transformers saves a torchao Int4TilePackedTo4dTensor (the module's
    tensors `_weight_qdata` [N' / 8, K' / 128, 32, 4] int32 and `_weight_scale_and_zero`
    [K' / g, N', 2] bf16, N and K padded to 8 and 1024 as torchao pads them)."""
    q, scale, zero = tinygemm_qparams(w, group_size)
    n, k = q.shape
    k_pad, n_pad = -(-k // K_PAD) * K_PAD, -(-n // N_PAD) * N_PAD
    scale_and_zero = torch.zeros(k_pad // group_size, n_pad, 2, dtype=torch.bfloat16, device=w.device)
    scale_and_zero[:k // group_size, :n] = torch.stack([scale.t(), zero.t()], dim=-1)
    return {"_weight_qdata": pack_tile_packed(q), "_weight_scale_and_zero": scale_and_zero}
