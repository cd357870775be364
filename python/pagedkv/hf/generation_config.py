"""Resolving an HF ``generate()`` call into what pagedkv runs, exactly as HF resolves it.

HF merges, by priority, the call's kwargs or ``generation_config`` > ``model.generation_config`` >
global defaults (e.g. ``max_length=20``, ``top_k=50``). pagedkv reuses HF's own resolution, then
refuses any setting it does not implement, naming it, instead of silently ignoring it.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import GenerationConfig

from pagedkv.runtime.fixed_batch import GenerationSettings

# Settings pagedkv implements; any other field that differs from HF's global default is refused.
SUPPORTED_FIELDS = frozenset({
    "max_length", "max_new_tokens", "min_length", "min_new_tokens", "do_sample", "temperature",
    "top_k", "top_p", "repetition_penalty", "eos_token_id", "pad_token_id", "bos_token_id",
    "return_dict_in_generate", "use_cache", "num_beams", "num_return_sequences",
    # Carried by many checkpoints' generation_config.json; they change nothing in greedy/sampling.
    "transformers_version", "_from_model_config", "early_stopping", "length_penalty",
    "cache_implementation", "disable_compile", "compile_config",
})
# Fields whose only accepted value is HF's default (checked above for everything else).
_MUST_BE = {"use_cache": True, "num_beams": 1, "num_return_sequences": 1}


class UnsupportedGenerationArgument(ValueError):
    """A generate() argument or generation-config setting that pagedkv does not implement."""


def _global_defaults() -> dict[str, Any]:
    getter = getattr(GenerationConfig, "_get_default_generation_params", None)
    return getter() if getter else GenerationConfig().to_dict()


def _resolve(model, generation_config: GenerationConfig | None, kwargs: dict[str, Any]):
    """HF's own merge (model._prepare_generation_config); returns (config, leftover kwargs)."""
    return model._prepare_generation_config(generation_config, **kwargs)


def resolve_generation(
    model, prompt_length: int, generation_config: GenerationConfig | None, kwargs: dict[str, Any]
) -> GenerationSettings:
    """Resolve and check a generate() call. prompt_length is input_ids.shape[1] (padded length),
    which HF's max_length and min_length include."""
    config, leftover = _resolve(model, generation_config, dict(kwargs))
    leftover = {k: v for k, v in leftover.items() if v is not None}
    if leftover:
        raise UnsupportedGenerationArgument(
            f"pagedkv.generate: unsupported argument(s) {sorted(leftover)}; supported: input_ids, "
            f"attention_mask, generation_config, streamer and the generation settings "
            f"{sorted(f for f in SUPPORTED_FIELDS if not f.startswith('_'))}"
        )
    defaults = _global_defaults()
    for name, value in config.to_dict().items():
        default = defaults.get(name)
        if name in _MUST_BE and value not in (None, _MUST_BE[name]):
            raise UnsupportedGenerationArgument(
                f"pagedkv.generate: {name}={value!r} is not supported; allowed: {_MUST_BE[name]!r}"
            )
        is_off = value is None or value is False or value in ({}, [], ()) or value == default
        if name not in SUPPORTED_FIELDS and not is_off:
            raise UnsupportedGenerationArgument(
                f"pagedkv.generate: generation setting {name}={value!r} is not supported "
                f"(HF default: {default!r}); supported settings: "
                f"{sorted(f for f in SUPPORTED_FIELDS if not f.startswith('_'))}"
            )

    if config.max_new_tokens is not None:
        max_new = config.max_new_tokens
        source = f"max_new_tokens={max_new}"
    else:
        max_new = config.max_length - prompt_length
        source = f"max_length={config.max_length} with prompts of length {prompt_length}"
    if max_new <= 0:
        raise ValueError(f"pagedkv.generate: {source} leaves no token to generate; it must allow >= 1")
    min_new = max(config.min_new_tokens or 0, (config.min_length or 0) - prompt_length, 0)

    eos = config.eos_token_id
    eos_ids = tuple(int(t) for t in (eos.tolist() if isinstance(eos, torch.Tensor) else
                                    eos if isinstance(eos, (list, tuple)) else
                                    [] if eos is None else [eos]))
    pad = config.pad_token_id
    pad = eos_ids[0] if pad is None and eos_ids else pad  # HF pads with the first EOS id

    do_sample = bool(config.do_sample)
    temperature = float(config.temperature if config.temperature is not None else 1.0)
    top_k = int(config.top_k or 0)
    top_p = float(config.top_p if config.top_p is not None else 1.0)
    penalty = float(config.repetition_penalty if config.repetition_penalty is not None else 1.0)
    # Checked with or without do_sample (HF only warns when greedy ignores them): a bad value is
    # a mistake either way. `not x > 0` also catches NaN.
    if not temperature >= 0 or (do_sample and not temperature > 0):
        raise ValueError(f"pagedkv.generate: temperature={temperature}; it must be > 0 with "
                         "do_sample=True (>= 0 when greedy, where it is not used)")
    if not 0 < top_p <= 1:
        raise ValueError(f"pagedkv.generate: top_p={top_p}; it must be in (0, 1] (1 turns it off)")
    if top_k < 0:
        raise ValueError(f"pagedkv.generate: top_k={top_k}; it must be >= 0 (0 turns it off)")
    if not penalty > 0:
        raise ValueError(f"pagedkv.generate: repetition_penalty={penalty}; it must be > 0")
    return GenerationSettings(
        max_new_tokens=max_new, min_new_tokens=min_new, eos_token_ids=eos_ids, pad_token_id=pad,
        do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
        repetition_penalty=penalty, return_dict_in_generate=bool(config.return_dict_in_generate),
    )
