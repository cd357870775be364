"""bitsandbytes NF4 checkpoints (a serialized Params4bit, with or without double quantization)
read into one canonical form.

bitsandbytes flattens the [out, in] weight, quantizes each run of `blocksize` values (64 by
default) to the nearest of 16 codebook values (NF4: quantiles of a normal, in [-1, 1]) times the
run's absmax, and stores, under the layer's `weight` name:

    weight                           [out * in / 2, 1] uint8: two codes a byte, the first value
                                     in the high nibble (other quant_storage dtypes: the same bytes)
    weight.absmax                    [out * in / blocksize] float32, or with double quantization
                                     uint8 codes of (absmax - offset) in an 8-bit dynamic codebook
    weight.quant_map                 [16] float32: the NF4 codebook
    weight.nested_absmax             [ceil(blocks / nested_blocksize)] float32 (double quant.)
    weight.nested_quant_map          [256] float32: the 8-bit dynamic codebook (double quant.)
    weight.quant_state.bitsandbytes__nf4  uint8 bytes of a JSON object: quant_type, blocksize,
                                     dtype, shape, and nested_blocksize, nested_dtype, nested_offset

and dequantizes (QuantState.from_dict, dequantize_blockwise, dequantize_4bit) in fp32:
absmax = nested_quant_map[absmax] * nested_absmax[block // nested_blocksize] + offset, then
w = quant_map[code] * absmax[value // blocksize].

The canonical form (Nf4Weight) is output-major: codes q [out, in], the absmax already
dequantized to fp32 [out, in / blocksize] (exactly as bitsandbytes computes it), the codebook.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping

import torch


@dataclasses.dataclass(slots=True)
class Nf4Weight:
    """One linear layer's NF4 weight: W[j, c] = code[q[j, c]] * absmax[j, c // block_size]."""

    q: torch.Tensor  # [out, in] uint8, 0..15
    absmax: torch.Tensor  # [out, in / block_size] float32
    code: torch.Tensor  # [16] float32
    block_size: int


def dequantize_nf4(w: Nf4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[out, in] weight, computed in fp32 (one rounding per value, as bitsandbytes does) then cast."""
    out_features, in_features = w.q.shape
    values = w.code[w.q.long()].view(out_features, -1, w.block_size)
    return (values * w.absmax.unsqueeze(-1)).view(out_features, in_features).to(dtype)


def _tensor(state: Mapping[str, torch.Tensor], key: str, dtype: torch.dtype, numel: int | None) -> torch.Tensor:
    if key not in state:
        raise ValueError(f"the quant state has no {key!r} (keys: {sorted(state)})")
    t = state[key]
    if t.dtype != dtype or (numel is not None and t.numel() != numel):
        size = "" if numel is None else f"{numel} values of "
        raise ValueError(f"{key} must be {size}{dtype}, got {list(t.shape)} {t.dtype}")
    return t.reshape(-1)


def from_bnb_nf4(weight: torch.Tensor, quant_state: Mapping[str, torch.Tensor]) -> Nf4Weight:
    """A bitsandbytes Params4bit as serialized -> Nf4Weight.

    weight: the packed bytes (any shape; quant_storage other than uint8 is read as its bytes);
    quant_state: the layer's `weight.*` tensors, keyed with or without their prefix (as
    QuantState.from_dict strips it): absmax, quant_map, quant_state.bitsandbytes__nf4 and, with
    double quantization, nested_absmax and nested_quant_map.
    """
    state = {key.split(".")[-1]: value for key, value in quant_state.items()}
    if "bitsandbytes__nf4" not in state:
        found = [key for key in state if key.startswith("bitsandbytes__")]
        raise ValueError(f"the quant state must hold 'quant_state.bitsandbytes__nf4' (an NF4 layer), found "
                         f"{found or sorted(state)}")
    meta = json.loads(bytes(state["bitsandbytes__nf4"].cpu().to(torch.uint8).tolist()).decode("utf-8"))
    if meta.get("quant_type") != "nf4":
        raise ValueError(f"quant_type {meta.get('quant_type')!r} must be 'nf4'")
    out_features, in_features = (int(d) for d in meta["shape"])
    block_size = int(meta["blocksize"])
    if in_features % block_size or block_size % 2:
        raise ValueError(f"in_features {in_features} must be a multiple of the even blocksize {block_size} (a block "
                         "within one output row)")
    blocks = out_features * in_features // block_size
    packed = weight.contiguous().view(torch.uint8).reshape(-1)
    if packed.numel() != out_features * in_features // 2:
        raise ValueError(f"weight must hold {out_features * in_features // 2} bytes (shape "
                         f"{[out_features, in_features]}, two values a byte), got {packed.numel()}")
    code = _tensor(state, "quant_map", torch.float32, 16)
    if "nested_absmax" in state:
        nested_block = int(meta["nested_blocksize"])
        qabsmax = _tensor(state, "absmax", torch.uint8, blocks).long()
        nested_absmax = _tensor(state, "nested_absmax", torch.float32, -(-blocks // nested_block))
        nested_code = _tensor(state, "nested_quant_map", torch.float32, 256)
        offset = torch.tensor(float(meta["nested_offset"]), dtype=torch.float32)
        absmax = nested_code[qabsmax] * nested_absmax.repeat_interleave(nested_block)[:blocks] + offset
    else:
        absmax = _tensor(state, "absmax", torch.float32, blocks)
    q = torch.stack((packed >> 4, packed & 0xF), dim=-1).view(out_features, in_features)
    return Nf4Weight(q=q.contiguous(), absmax=absmax.view(out_features, -1).contiguous(), code=code.contiguous(),
                     block_size=block_size)
