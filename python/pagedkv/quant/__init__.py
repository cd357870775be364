"""Quantized weights: checkpoint formats read into canonical forms (int4: AWQ, GPTQ), pagedkv's
kernel layouts and the ops that compute with them. Nothing here is wired into the models yet."""

from pagedkv.quant.int4 import Int4Weight, dequantize, from_awq, from_gptq
from pagedkv.quant.linear import W4A16Weight, linear_w4a16, linear_w4a16_weight, pack_w4a16

__all__ = ["Int4Weight", "W4A16Weight", "dequantize", "from_awq", "from_gptq", "linear_w4a16",
           "linear_w4a16_weight", "pack_w4a16"]
