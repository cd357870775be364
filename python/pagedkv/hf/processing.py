"""Which generate() calls take the processed decode path, and HF's own objects that path runs.

A call takes it when it passes a logits_processor, stopping_criteria or prefix_allowed_tokens_fn,
sets a setting of PROCESSED_FIELDS (min_p, no_repeat_ngram_size, stop_strings, max_time, ...),
or asks for scores or logits (return_dict_in_generate with output_scores / output_logits); the
cheap settings the fast path runs itself (settings.processors: hf/cheap_processors.py) do not
count. Its
processors and criteria are built by HF's own generate code (model._get_logits_processor,
model._get_stopping_criteria) from the call's config prepared as HF prepares it, so their
order, merge with the user's lists and arithmetic are HF's. Any other call keeps the fast path.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation import MaxLengthCriteria

from pagedkv.hf import arguments
from pagedkv.hf.cheap_processors import CHEAP_FIELDS
from pagedkv.hf.generation_config import PROCESSED_FIELDS, UnsupportedGenerationArgument, settings_in_use
from pagedkv.hf.processed_decode import ProcessedDecode
from pagedkv.runtime.fixed_batch import GenerationSettings
from pagedkv.runtime.model import PREPARED_ATTR


@dataclasses.dataclass(slots=True)
class CallArguments:
    """generate()'s own arguments of the processed path (HF's signature; not config fields)."""

    logits_processor: list | None = None
    stopping_criteria: list | None = None
    prefix_allowed_tokens_fn: Callable[[int, torch.Tensor], list[int]] | None = None
    tokenizer: Any = None  # for stop_strings, as HF's generate takes it

    @classmethod
    def pop_from(cls, kwargs: dict[str, Any]) -> CallArguments:
        """Take these arguments out of generate()'s kwargs (the rest are config settings)."""
        return cls(**{f.name: kwargs.pop(f.name, None) for f in dataclasses.fields(cls)})

    def in_use(self) -> list[str]:
        return [name for name in ("logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn")
                if getattr(self, name)]  # an empty list asks for nothing, as in HF


def _config(model, generation_config: GenerationConfig | None, kwargs: dict[str, Any]) -> GenerationConfig:
    return model._prepare_generation_config(generation_config, **arguments.normalized(kwargs))[0]


def processed_decode(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                     generation_config: GenerationConfig | None, kwargs: dict[str, Any],
                     call: CallArguments, settings: GenerationSettings, streamer) -> ProcessedDecode | None:
    """The processed path's loop for this call, or None when the call takes the fast path.
    kwargs: the generation settings (as generate() got them, call arguments popped); settings:
    the same call resolved and checked (resolve_generation). attention_mask: [B, S], given or
    inferred as HF infers it (None: every token counts)."""
    config = _config(model, generation_config, kwargs)
    scores_wanted = config.return_dict_in_generate and (config.output_scores or config.output_logits)
    fields = settings_in_use(config, PROCESSED_FIELDS - {"output_scores", "output_logits"})
    if settings.processors is not None:  # every field in use is cheap and fast-eligible
        fields = [name for name in fields if name not in CHEAP_FIELDS]
    if not (fields or call.in_use() or scores_wanted):
        return None
    state = getattr(model, PREPARED_ATTR, None)
    if state is not None and state.tp is not None:
        raise UnsupportedGenerationArgument(
            f"pagedkv.generate: {sorted(fields + call.in_use()) or ['output_scores/output_logits']} run "
            "HF's processors on each rank's host, which tensor-parallel generate does not do; "
            "generate on one device for them")
    try:
        processors, criteria = _hf_objects(model, config, input_ids, attention_mask, call, settings)
    except ValueError as error:  # HF's checks of the settings (min_p in [0, 1], ...)
        if isinstance(error, UnsupportedGenerationArgument) or str(error).startswith("pagedkv"):
            raise
        raise ValueError(f"pagedkv.generate: {error}") from error
    return ProcessedDecode(input_ids, processors, criteria, do_sample=settings.do_sample,
                           pad_token_id=config._pad_token_tensor, max_new_tokens=settings.max_new_tokens,
                           output_scores=bool(scores_wanted and config.output_scores),
                           output_logits=bool(scores_wanted and config.output_logits), streamer=streamer)


def _hf_objects(model, config: GenerationConfig, input_ids: torch.Tensor,
                attention_mask: torch.Tensor | None, call: CallArguments,
                settings: GenerationSettings) -> tuple[LogitsProcessorList, StoppingCriteriaList]:
    """HF's generate steps 1, 6 and 8 for a decode-only model given input_ids [B, S]."""
    length = input_ids.shape[1]
    # HF's lengths (its max_length/min_length, what its processors and criteria read), held to
    # what pagedkv resolved, which reserved each row's cache.
    config.max_new_tokens = None
    config.max_length = length + settings.max_new_tokens
    model._prepare_generated_length(config, has_default_max_length=False, has_default_min_length=True,
                                    model_input_name="input_ids", input_ids_length=length,
                                    inputs_tensor=input_ids)
    model._prepare_special_tokens(config, attention_mask is not None, device=input_ids.device,
                                  batch_size=input_ids.shape[0])
    if attention_mask is not None and bool((attention_mask == 1).all()):
        attention_mask = None  # as HF drops an all-ones mask (its repetition penalty reads it)
    processors = model._get_logits_processor(
        config, input_ids_seq_length=length, encoder_input_ids=input_ids,
        prefix_allowed_tokens_fn=call.prefix_allowed_tokens_fn,
        logits_processor=LogitsProcessorList(call.logits_processor or []), device=input_ids.device,
        model_kwargs={"attention_mask": attention_mask})
    criteria = model._get_stopping_criteria(config, StoppingCriteriaList(call.stopping_criteria or []),
                                            tokenizer=call.tokenizer)
    for criterion in criteria:  # a user's MaxLengthCriteria replaces HF's (HF's merge)
        if isinstance(criterion, MaxLengthCriteria) and criterion.max_length > config.max_length:
            raise UnsupportedGenerationArgument(
                f"pagedkv.generate: stopping_criteria holds MaxLengthCriteria(max_length="
                f"{criterion.max_length}), longer than this call's max_length {config.max_length}: "
                "pagedkv reserves each row's cache for max_new_tokens before it runs; pass "
                "max_new_tokens (or max_length) instead")
    return processors, criteria
