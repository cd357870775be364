"""bitsandbytes' own dequantization of a serialized LLM.int8 Linear8bitLt (int8_vectorwise_dequant),
transcribed from bitsandbytes/functional.py, independently of pagedkv.quant's reader. The writer
(to_bnb_int8) is shared with the benchmarks: pagedkv.tools.quant_writers."""

from __future__ import annotations

import torch


def bnb_int8_dequantize(state: dict[str, torch.Tensor]) -> torch.Tensor:
    """int8_vectorwise_dequant(weight, SCB) in fp32 -> W [out, in]: A * stats.view(-1, 1) * (1 / 127)."""
    return state["weight"] * state["SCB"].view(-1, 1) * 7.874015718698502e-3
