"""Resolving an HF ``generate()`` call into what pagedkv runs, exactly as HF resolves it.

HF merges, by priority, the call's kwargs or ``generation_config`` > ``model.generation_config`` >
global defaults (e.g. ``max_length=20``, ``top_k=50``). pagedkv reuses HF's own resolution, then
refuses any setting it does not implement, naming it, instead of silently ignoring it. Setting
values come in the forms arguments.py takes (NumPy ints, 0-d tensors, ...).
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any

from transformers import GenerationConfig
from transformers.generation.utils import GenerationMixin

from pagedkv.hf import arguments
from pagedkv.hf.cheap_processors import fast_processors
from pagedkv.runtime.fixed_batch import GenerationSettings

# Settings the processed decode path runs with HF's own logits processors and stopping criteria
# (hf/processing.py, hf/processed_decode.py); the other supported ones run on the fast path too,
# and so do the cheap ones of hf/cheap_processors.py in their fast-eligible forms.
PROCESSED_FIELDS = frozenset({
    "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "top_h", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "encoder_repetition_penalty", "bad_words_ids", "suppress_tokens",
    "begin_suppress_tokens", "sequence_bias", "renormalize_logits", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
    "watermarking_config", "max_time", "stop_strings", "output_scores", "output_logits",
})
# Settings pagedkv implements; any other field that differs from HF's global default is refused.
SUPPORTED_FIELDS = PROCESSED_FIELDS | frozenset({
    "max_length", "max_new_tokens", "min_length", "min_new_tokens", "do_sample", "temperature",
    "top_k", "top_p", "repetition_penalty", "eos_token_id", "pad_token_id", "bos_token_id",
    "return_dict_in_generate", "use_cache", "num_beams", "num_return_sequences", "early_stopping",
    "length_penalty", "prompt_lookup_num_tokens", "max_matching_ngram_size",
    # Carried by many checkpoints' generation_config.json; they change nothing.
    "transformers_version", "_from_model_config",
    "cache_implementation", "disable_compile", "compile_config",
})
# What a refusal lists as supported: the settings a user passes (not the fields above that
# checkpoints carry and that change nothing).
USER_SETTINGS = sorted(SUPPORTED_FIELDS - {"transformers_version", "_from_model_config",
                                           "cache_implementation", "disable_compile",
                                           "compile_config", "use_cache"})
# Fields whose only accepted value is HF's default (checked above for everything else), and why.
_MUST_BE = {"use_cache": (True, "pagedkv always decodes from its paged KV cache, whose tokens are the ones HF "
                                "gives without a cache (up to rounding); drop use_cache=False")}
# Settings read below, in the forms arguments.py takes.
_VALUE_FIELDS = arguments.INTEGER_FIELDS + arguments.REAL_FIELDS + arguments.FLAG_FIELDS + ("eos_token_id",)


class UnsupportedGenerationArgument(ValueError):
    """A generate() argument or generation-config setting that pagedkv does not implement."""


@functools.cache
def hf_penalizes_padding() -> bool:
    """Whether the installed transformers' generate counts a row's left padding as tokens of the
    prompt for repetition_penalty: up to 5.1x it does; later versions pass the padding lengths
    from the attention mask to RepetitionPenaltyLogitsProcessor (prompt_ignore_length)."""
    return "prompt_ignore_length" not in inspect.getsource(GenerationMixin._get_logits_processor)


def _global_defaults() -> dict[str, Any]:
    getter = getattr(GenerationConfig, "_get_default_generation_params", None)
    return getter() if getter else GenerationConfig().to_dict()


def _resolve(model, generation_config: GenerationConfig | None, kwargs: dict[str, Any]):
    """HF's own merge (model._prepare_generation_config); returns (config, leftover kwargs)."""
    return model._prepare_generation_config(generation_config, **kwargs)


def _equal(value: Any, default: Any) -> bool:
    """value == default, False where the comparison has no single truth value (arrays)."""
    try:
        return bool(value == default)
    except (TypeError, ValueError, RuntimeError):
        return False


def is_off(value: Any, default: Any) -> bool:
    """A setting that asks for nothing: unset, False, HF's default, or an empty collection."""
    return (value is None or value is False or _equal(value, default)
            or (isinstance(value, (dict, list, tuple)) and not value))


def settings_in_use(config: GenerationConfig, names: frozenset[str]) -> list[str]:
    """The settings among `names` that config sets to something other than off."""
    defaults = _global_defaults()
    return [name for name in sorted(names) if not is_off(getattr(config, name, None), defaults.get(name))]


def _check_fields(config: GenerationConfig) -> None:
    """Refuse, naming it, a setting pagedkv does not implement."""
    defaults = _global_defaults()
    for name, value in config.to_dict().items():
        default = defaults.get(name)
        if name in _MUST_BE and value is not None and not _equal(value, _MUST_BE[name][0]):
            allowed, why = _MUST_BE[name]
            raise UnsupportedGenerationArgument(
                f"pagedkv.generate: {name}={value!r} is not supported; allowed: {allowed!r} ({why})")
        if name not in SUPPORTED_FIELDS and not is_off(value, default):
            raise UnsupportedGenerationArgument(
                f"pagedkv.generate: generation setting {name}={value!r} is not supported "
                f"(HF default: {default!r}); supported settings: {USER_SETTINGS}"
            )


def _lengths(model, config: dict[str, Any], prompt_length: int, default_max_length: bool) -> tuple[int, int]:
    """(max_new_tokens, min_new_tokens) as HF's _prepare_generated_length resolves them: with
    neither max_new_tokens nor a max_length set anywhere, HF generates max_length (20) NEW
    tokens, at most max_position_embeddings in all; min_new_tokens overrides min_length."""
    max_positions = getattr(model.config, "max_position_embeddings", None)
    if config["max_new_tokens"] is not None:
        max_length = config["max_new_tokens"] + prompt_length
    elif default_max_length:
        warnings.warn(f"Using the model-agnostic default `max_length` (={config['max_length']}) to control "
                      "the generation length. We recommend setting `max_new_tokens` to control the "
                      "maximum length of the generation.", UserWarning, stacklevel=5)
        max_length = config["max_length"] + prompt_length
        if max_positions is not None and max_length > max_positions:
            max_length = max_positions
            if prompt_length >= max_length:
                raise ValueError(f"pagedkv.generate: prompts of length {prompt_length} leave no token to "
                                 f"generate within max_position_embeddings ({max_positions}); HF's default "
                                 "length is 20 new tokens, at most max_position_embeddings in all")
    else:
        max_length = config["max_length"]
    if prompt_length >= max_length:
        raise ValueError(f"pagedkv.generate: max_length={max_length} with prompts of length "
                         f"{prompt_length} leaves no token to generate; it must allow >= 1")
    for name in ("min_new_tokens", "min_length"):
        if (config[name] or 0) < 0:
            raise ValueError(f"pagedkv.generate: {name}={config[name]}; it must be >= 0")
    min_new = config["min_new_tokens"]
    if min_new is None:
        min_new = max((config["min_length"] or 0) - prompt_length, 0)
    return max_length - prompt_length, min_new


def _warn_unmasked_batch(pad_defaulted: bool, pad_is_eos: bool) -> None:
    """HF's warnings (in _prepare_special_tokens) for a batch of several rows given no
    attention_mask, when the mask cannot be inferred from the pad id."""
    if pad_defaulted:
        warnings.warn("The attention mask and the pad token id were not set, with a batched input. As a "
                      "consequence, you may observe unexpected behavior. Please pass your input's "
                      "`attention_mask` to obtain reliable results.", UserWarning, stacklevel=5)
    if pad_is_eos:
        warnings.warn("The attention mask is not set with a batched input, and cannot be inferred from input "
                      "because pad token is same as eos token. As a consequence, you may observe unexpected "
                      "behavior. Please pass your input's `attention_mask` to obtain reliable results.",
                      UserWarning, stacklevel=5)


def resolve_generation(
    model, prompt_length: int, generation_config: GenerationConfig | None, kwargs: dict[str, Any],
    batch_without_mask: bool = False,
) -> GenerationSettings:
    """Resolve and check a generate() call. prompt_length is input_ids.shape[1] (padded length),
    which HF's max_length and min_length include. batch_without_mask: several rows and no
    attention_mask (HF's warnings about padding apply)."""
    kwargs = arguments.normalized(kwargs)
    # As HF's generate: the default length applies when no max_length is set anywhere.
    default_max_length = (kwargs.get("max_length") is None
                          and getattr(generation_config, "max_length", None) is None
                          and getattr(model.generation_config, "max_length", None) is None)
    config, leftover = _resolve(model, generation_config, kwargs)
    leftover = {k: v for k, v in leftover.items() if v is not None}
    if leftover:
        raise UnsupportedGenerationArgument(
            f"pagedkv.generate: unsupported argument(s) {sorted(leftover)}; supported: input_ids, "
            f"attention_mask, generation_config, streamer, logits_processor, stopping_criteria, "
            f"prefix_allowed_tokens_fn, tokenizer and the generation settings {USER_SETTINGS}"
        )
    _check_fields(config)
    values = arguments.normalized({name: getattr(config, name, None) for name in _VALUE_FIELDS})
    max_new, min_new = _lengths(model, values, prompt_length, default_max_length)

    eos_ids = arguments.token_ids("eos_token_id", values["eos_token_id"])
    config_eos_ids = tuple(eos_ids)  # before the vocabulary filter below: HF's bad-word EOS filter reads them
    pad = values["pad_token_id"]
    pad_defaulted = pad is None and bool(eos_ids)
    pad = eos_ids[0] if pad_defaulted else pad  # HF pads with the first EOS id
    if batch_without_mask:
        _warn_unmasked_batch(pad_defaulted, pad in eos_ids)
    # Ids outside the vocabulary are never generated (HF never matches them); dropped, so that
    # min_new_tokens' EOS suppression indexes only real logits.
    eos_ids = tuple(t for t in eos_ids if 0 <= t < model.config.vocab_size)

    do_sample = bool(values["do_sample"])
    temperature = values["temperature"] if values["temperature"] is not None else 1.0
    top_k = values["top_k"] or 0
    top_p = values["top_p"] if values["top_p"] is not None else 1.0
    penalty = values["repetition_penalty"] if values["repetition_penalty"] is not None else 1.0
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
    in_use = settings_in_use(config, PROCESSED_FIELDS - {"output_scores", "output_logits"})
    processors = (fast_processors(config, in_use, config_eos_ids, model.config.vocab_size, do_sample, top_p)
                  if in_use else None)
    beams = _beams(config)
    lookup = _prompt_lookup(values, penalty, beams, in_use)
    return GenerationSettings(
        max_new_tokens=max_new, min_new_tokens=min_new, eos_token_ids=eos_ids, pad_token_id=pad,
        do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
        repetition_penalty=penalty, return_dict_in_generate=bool(values["return_dict_in_generate"]),
        penalize_padding=hf_penalizes_padding(), processors=processors, **beams, **lookup,
    )


def _prompt_lookup(values: dict[str, Any], penalty: float, beams: dict[str, int],
                   in_use: list[str]) -> dict[str, int]:
    """prompt_lookup_num_tokens and max_matching_ngram_size (HF's default 2 when unset), checked;
    refuses, naming them, the settings prompt lookup does not run with yet."""
    k, n = values["prompt_lookup_num_tokens"], values["max_matching_ngram_size"]
    for name, value in (("prompt_lookup_num_tokens", k), ("max_matching_ngram_size", n)):
        if value is not None and value <= 0:
            raise ValueError(f"pagedkv.generate: {name}={value}; it must be >= 1")
    if not k:
        return {}
    refused = [name for name, on in (("num_beams > 1", beams["num_beams"] > 1),
                                     ("num_return_sequences > 1", beams["num_return_sequences"] > 1),
                                     ("repetition_penalty", penalty != 1.0)) if on] + in_use
    if refused:
        raise UnsupportedGenerationArgument(
            f"pagedkv.generate: prompt_lookup_num_tokens runs greedy decoding or sampling (temperature, "
            f"top_k, top_p) without other logits processors for now; not supported yet with "
            f"{', '.join(refused)}")
    return {"prompt_lookup_num_tokens": k, "max_matching_ngram_size": n or 2}


def _beams(config: GenerationConfig) -> dict[str, int]:
    """num_return_sequences and num_beams (HF's validation checked how they combine: n > 1
    needs sampling or beams, n <= num_beams with beams)."""
    counts = {name: arguments.integer(name, getattr(config, name, None))
              for name in ("num_return_sequences", "num_beams")}
    counts = {name: 1 if value is None else value for name, value in counts.items()}
    for name, value in counts.items():
        if value < 1:
            raise ValueError(f"pagedkv.generate: {name}={value}; it must be >= 1")
    return counts
