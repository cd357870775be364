"""What every op module shares: the loaded library and an fp8 cache's scales."""

from __future__ import annotations

import torch

from pagedkv._ext import _C  # noqa: F401  (registers torch.ops.pagedkv)

_ops = torch.ops.pagedkv


def _kv_scales(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale, v_scale) -> tuple:
    """An fp8 cache's scales: given, else its views' ``kv_scale`` (set by KVCache): model code passes caches."""
    return (getattr(k_cache, "kv_scale", None) if k_scale is None else k_scale,
            getattr(v_cache, "kv_scale", None) if v_scale is None else v_scale)
