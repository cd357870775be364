"""The KV cache's element type (``kv_cache_dtype``) and an fp8 cache's scales (``kv_cache_scales``),
as generate() and pagedkv.LLM take them.

"auto" (the default) stores K/V in the model's dtype. "fp8" stores them as e4m3
(torch.float8_e4m3fn): half the bytes per token, so a cache of the same memory holds twice the
tokens. Each layer has one fp32 scale for K and one for V: the write stores
``round_to_e4m3(clamp(x / scale, -448, 448))``, attention reads ``float(x) * scale`` (the
softmax sums and the weighted V sum in fp64, on the CPU and CUDA alike). The scales, in this order:
- ``kv_cache_scales`` given as a list of one (k_scale, v_scale) pair per layer: those;
- ``kv_cache_scales="calibrate"`` (generate() only): amax of each layer's K (after RoPE) and V
  over this call's prompts, from one HF forward of the model, divided by 448 (e4m3's largest);
- else the checkpoint's, when its attention modules carry ``k_scale``/``v_scale`` (one value each,
  as compressed-tensors' kv_cache_scheme writes them);
- else 1.0 (vLLM's default): values past +-448 saturate.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

import torch

KV_CACHE_DTYPES = ("auto", "fp8")
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
_SCALE_NAME = re.compile(r"layers\.(\d+)\.self_attn\.(k|v)_scale$")


def kv_cache_dtype(value: Any, model_dtype: torch.dtype, who: str) -> torch.dtype:
    """The cache dtype for a kv_cache_dtype argument: "auto" (or None) the model's, "fp8"
    torch.float8_e4m3fn (also accepted by that name or as the dtype itself)."""
    if value is None or value == "auto":
        return model_dtype
    if value in ("fp8", "fp8_e4m3", "float8_e4m3fn", torch.float8_e4m3fn):
        return torch.float8_e4m3fn
    raise ValueError(f"{who}: kv_cache_dtype={value!r} is not supported; allowed: "
                     f"{', '.join(map(repr, KV_CACHE_DTYPES))} (fp8: e4m3, torch.float8_e4m3fn)")


def check_fp8_allowed(who: str, *, fallback: bool, tensor_parallel: bool, beams: bool = False) -> None:
    """Refuse the runs an fp8 cache does not support yet, before anything is made."""
    why = ("the model runs on its own HF modules (pagedkv's fallback path, whose K/V writes are "
           "16-bit)" if fallback else "tensor parallelism is not supported with it" if tensor_parallel
           else "beam search (num_beams > 1) is not supported with it" if beams else None)
    if why is not None:
        raise ValueError(f"{who}: kv_cache_dtype='fp8' cannot run here: {why}; use "
                         "kv_cache_dtype='auto'")


def checkpoint_kv_scales(model: torch.nn.Module, num_layers: int) -> list[tuple[float, float]] | None:
    """The checkpoint's per-layer (k_scale, v_scale) when every layer's attention module holds
    both as one-element parameters or buffers (``model.layers.N.self_attn.k_scale``), else None."""
    found: dict[tuple[int, str], torch.Tensor] = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        match = _SCALE_NAME.search(name)
        if match:
            found[int(match[1]), match[2]] = tensor
    if not found:
        return None
    if len(found) != 2 * num_layers or any(t.numel() != 1 for t in found.values()):
        raise ValueError(f"pagedkv: the checkpoint's k_scale/v_scale are not one value per layer for "
                         f"K and V ({len(found)} tensors for {num_layers} layers; per-head scales are "
                         "not supported); pass kv_cache_scales=[(k_scale, v_scale), ...] per layer")
    return [(float(found[i, "k"]), float(found[i, "v"])) for i in range(num_layers)]


@torch.inference_mode()
def calibrate_kv_scales(model: torch.nn.Module, input_ids: torch.Tensor,
                        attention_mask: torch.Tensor | None = None) -> list[tuple[float, float]]:
    """Per layer (amax(K) / 448, amax(V) / 448) over the prompts' real tokens, K after RoPE, from
    one forward of the HF model (a layer whose amax is 0 gets 1.0). Usable for pagedkv.LLM's
    kv_cache_scales: ``LLM(model, kv_cache_dtype="fp8", kv_cache_scales=calibrate_kv_scales(...))``."""
    out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=True)
    past = out.past_key_values
    layers = getattr(past, "layers", None)
    pairs = ([(layer.keys, layer.values) for layer in layers] if layers is not None
             else [(past.key_cache[i], past.value_cache[i]) for i in range(len(past.key_cache))])
    scales = []
    for k, v in pairs:  # [B, Hkv, S, D] each (a sliding layer may keep only its last S)
        amax = []
        for x in (k, v):
            if attention_mask is not None:
                x = x * attention_mask[:, None, -x.shape[2]:, None].to(x.dtype)  # padding: 0
            m = float(x.float().abs().amax())
            amax.append(m / FP8_MAX if m > 0 else 1.0)
        scales.append((amax[0], amax[1]))
    return scales


def kv_cache_scales(model: torch.nn.Module, value: Any, num_layers: int, who: str,
                    input_ids: torch.Tensor | None = None,
                    attention_mask: torch.Tensor | None = None) -> list[tuple[float, float]] | None:
    """The per-layer scales of an fp8 cache for a kv_cache_scales argument (see the module's
    docstring); None: all 1.0. input_ids: the prompts "calibrate" runs on (None: refused)."""
    if value is None:
        return checkpoint_kv_scales(model, num_layers)
    if isinstance(value, str):
        if value != "calibrate":
            raise ValueError(f"{who}: kv_cache_scales={value!r}; allowed: None, 'calibrate' or a list "
                             "of (k_scale, v_scale) per layer")
        if input_ids is None:
            raise ValueError(f"{who}: kv_cache_scales='calibrate' needs prompts; compute them with "
                             "pagedkv.cache.kv_dtype.calibrate_kv_scales(model, input_ids) and pass the list")
        return calibrate_kv_scales(model, input_ids, attention_mask)
    if not isinstance(value, Sequence) or len(value) != num_layers or any(
            not isinstance(p, Sequence) or len(p) != 2 for p in value):
        raise ValueError(f"{who}: kv_cache_scales must be None, 'calibrate' or {num_layers} "
                         f"(k_scale, v_scale) pairs, one per layer; got {type(value).__name__}")
    pairs = [(float(k), float(v)) for k, v in value]
    if not all(0 < x < float("inf") for pair in pairs for x in pair):
        raise ValueError(f"{who}: kv_cache_scales must be positive finite numbers; got {pairs[:4]}...")
    return pairs


def kv_cache_options(model: torch.nn.Module, state: Any, dtype_arg: Any, scales_arg: Any, who: str, *,
                     beams: bool = False, input_ids: torch.Tensor | None = None,
                     attention_mask: torch.Tensor | None = None
                     ) -> tuple[torch.dtype, list[tuple[float, float]] | None]:
    """(cache dtype, fp8 scales or None) for a call's kv_cache_dtype and kv_cache_scales, checked
    before anything runs. state: the model's runtime.model.PreparedModel (dtype, tp, weights,
    quant)."""
    dtype = kv_cache_dtype(dtype_arg, state.dtype, who)
    if dtype != torch.float8_e4m3fn:
        if scales_arg is not None:
            raise ValueError(f"{who}: kv_cache_scales applies to kv_cache_dtype='fp8' only; the cache "
                             f"is {dtype}")
        return dtype, None
    # models/fallback.py's weights (a model run on its own HF modules), named: models/ is a
    # layer above cache/ and is not imported here. tests/test_fp8_kv_generate.py checks the name.
    fallback = type(state.weights).__name__ == "FallbackWeights"
    check_fp8_allowed(who, fallback=fallback, tensor_parallel=state.tp is not None, beams=beams)
    if scales_arg == "calibrate" and state.quant is not None:
        raise ValueError(f"{who}: kv_cache_scales='calibrate' runs the HF model, which pagedkv reads "
                         f"{state.quant} weights beside; pass the scales as a list")
    return dtype, kv_cache_scales(model, scales_arg, len(state.weights.layers), who, input_ids,
                                  attention_mask)
