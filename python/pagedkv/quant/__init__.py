"""Quantized weights: checkpoint formats read into canonical forms (int4: AWQ, GPTQ,
compressed-tensors W4A16, torchao tile_packed_to_4d; FP8: FineGrainedFP8, compressed-tensors;
bitsandbytes NF4 and LLM.int8), the quantization_config checks (formats.py), pagedkv's kernel
layouts and the ops that compute with them; dispatch.py picks a decoder linear's op
(models/quantized_checkpoint.py reads checkpoints)."""

from pagedkv.quant.int4 import Int4Weight, dequantize, from_awq, from_compressed_tensors_int4, from_gptq
from pagedkv.quant.fp8 import Fp8Weight, dequantize_fp8, from_compressed_tensors_fp8, from_finegrained_fp8
from pagedkv.quant.int8 import Int8Weight, dequantize_int8, from_bnb_int8
from pagedkv.quant.linear import W4A16Weight, linear_w4a16, linear_w4a16_weight, pack_w4a16
from pagedkv.quant.linear_fp8 import linear_fp8, linear_fp8_weight
from pagedkv.quant.linear_int8 import linear_int8, linear_int8_weight
from pagedkv.quant.linear_nf4 import Nf4Packed, linear_nf4, linear_nf4_weight, pack_nf4
from pagedkv.quant.nf4 import Nf4Weight, dequantize_nf4, from_bnb_nf4
from pagedkv.quant.torchao_int4 import from_torchao_tile_packed

__all__ = [
    "Int4Weight", "W4A16Weight", "dequantize", "from_awq", "from_compressed_tensors_int4", "from_gptq",
    "from_torchao_tile_packed", "linear_w4a16", "linear_w4a16_weight", "pack_w4a16", "Fp8Weight", "dequantize_fp8",
    "from_compressed_tensors_fp8", "from_finegrained_fp8", "linear_fp8", "linear_fp8_weight", "Nf4Packed",
    "Nf4Weight", "dequantize_nf4", "from_bnb_nf4", "linear_nf4", "linear_nf4_weight", "pack_nf4", "Int8Weight",
    "dequantize_int8", "from_bnb_int8", "linear_int8", "linear_int8_weight",
]
