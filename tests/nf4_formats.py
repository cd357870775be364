"""A tiny reference quantizer that writes one linear layer's random fp weight as bitsandbytes
serializes a Params4bit (NF4, with or without double quantization: QuantState.as_dict(packed=True)
under the layer's `weight.` prefix), and bitsandbytes' own dequantization (QuantState.from_dict,
dequantize_blockwise, dequantize_4bit), transcribed from bitsandbytes/functional.py. Written
value by value, independently of pagedkv.quant's reader."""

from __future__ import annotations

import json

import torch

# bitsandbytes' get_4bit_type("nf4")
NF4_CODE = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
            -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
            0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
            0.7229568362236023, 1.0]


def create_dynamic_map(max_exponent_bits: int = 7, total_bits: int = 8) -> torch.Tensor:
    """bitsandbytes' signed 8-bit dynamic codebook (the nested absmax's quant_map)."""
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
    return (values.unsqueeze(-1) - code).abs().argmin(-1)


def to_bnb_nf4(w: torch.Tensor, block_size: int = 64, double_quant: bool = True,
               nested_block: int = 256) -> dict[str, torch.Tensor]:
    """w [out, in] -> the state dict entries of one Linear4bit's weight (keys prefixed "weight.")."""
    out_features, in_features = w.shape
    code = torch.tensor(NF4_CODE)
    flat = w.float().reshape(-1)
    blocks = flat.view(-1, block_size)
    absmax = blocks.abs().amax(-1)
    q = _nearest(blocks / absmax.unsqueeze(-1), code).reshape(-1)
    packed = torch.empty(q.numel() // 2, dtype=torch.uint8)
    for b in range(packed.numel()):
        packed[b] = (int(q[2 * b]) << 4) | int(q[2 * b + 1])
    meta = {"quant_type": "nf4", "blocksize": block_size, "dtype": "bfloat16", "shape": [out_features, in_features]}
    state = {"weight": packed.view(-1, 1), "weight.quant_map": code}
    if double_quant:
        offset = absmax.mean()
        centered = absmax - offset
        nested_code = create_dynamic_map()
        groups = -(-centered.numel() // nested_block)
        nested_absmax = torch.empty(groups)
        qabsmax = torch.empty(centered.numel(), dtype=torch.uint8)
        for g in range(groups):
            chunk = centered[g * nested_block:(g + 1) * nested_block]
            nested_absmax[g] = chunk.abs().max()
            codes = _nearest(chunk / nested_absmax[g], nested_code)
            qabsmax[g * nested_block:(g + 1) * nested_block] = codes.to(torch.uint8)
        state.update({"weight.absmax": qabsmax, "weight.nested_absmax": nested_absmax,
                      "weight.nested_quant_map": nested_code})
        meta.update({"nested_blocksize": nested_block, "nested_dtype": "float32", "nested_offset": offset.item()})
    else:
        state["weight.absmax"] = absmax
    state["weight.quant_state.bitsandbytes__nf4"] = torch.tensor(list(json.dumps(meta).encode("utf-8")),
                                                                 dtype=torch.uint8)
    return state


def bnb_dequantize(state: dict[str, torch.Tensor]) -> torch.Tensor:
    """bitsandbytes' dequantize_4bit of a serialized layer, in fp32 -> W [out, in]."""
    meta = json.loads(bytes(state["weight.quant_state.bitsandbytes__nf4"].tolist()).decode("utf-8"))
    absmax = state["weight.absmax"]
    if "weight.nested_absmax" in state:  # dequantize_blockwise(absmax, state2) + offset
        nested_block = meta["nested_blocksize"]
        index = torch.arange(absmax.numel()) // nested_block
        absmax = state["weight.nested_quant_map"][absmax.long()] * state["weight.nested_absmax"][index]
        absmax = absmax + torch.tensor(float(meta["nested_offset"]), dtype=torch.float32)
    packed = state["weight"].reshape(-1)
    values = torch.empty(packed.numel() * 2)
    code = state["weight.quant_map"]
    for b in range(packed.numel()):
        values[2 * b] = code[int(packed[b]) >> 4]
        values[2 * b + 1] = code[int(packed[b]) & 0xF]
    scale = absmax[torch.arange(values.numel()) // meta["blocksize"]]
    return (values * scale).view(*meta["shape"])
