"""The MLP's gated activation on a fused [gate, up] tensor."""

from __future__ import annotations

import torch

from pagedkv.ops._common import _ops

# The gate activations of the gated MLP ops (silu_and_mul, gate_up_silu), by their ops' names.
GATED_ACTIVATIONS = ("silu", "gelu_tanh")


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None, activation: str = "silu") -> torch.Tensor:
    """``act(x[..., :I]) * x[..., I:]`` rounded as HF's ``act_fn(gate) * up`` in the dtype.

    x: [..., 2 * I] contiguous (gate, then up), float32/float16/bfloat16; out: [..., I] or None
    to allocate one; activation: "silu" or "gelu_tanh" (HF's gelu_pytorch_tanh, torch's
    ``gelu(approximate="tanh")``). Returns out.
    """
    if out is None:
        out = x.new_empty(*x.shape[:-1], x.shape[-1] // 2)
    _ops.silu_and_mul(out, x, activation)
    return out


@torch.library.register_fake("pagedkv::silu_and_mul")
def _silu_and_mul_fake(out, x, activation="silu") -> None:
    return None
