"""bitsandbytes' own dequantization of a serialized NF4 Params4bit (QuantState.from_dict,
dequantize_blockwise, dequantize_4bit), transcribed from bitsandbytes/functional.py value by
value, independently of pagedkv.quant's reader. The writer (to_bnb_nf4: QuantState.as_dict(
packed=True) under the layer's `weight.` prefix, with or without double quantization) is shared
with the benchmarks: pagedkv.tools.quant_writers."""

from __future__ import annotations

import json

import torch

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
