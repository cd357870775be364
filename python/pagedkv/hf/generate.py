"""A drop-in HF ``generate()``: same arguments, same greedy tokens, on pagedkv's runner.

    out = pagedkv.generate(model, input_ids, attention_mask=mask, max_new_tokens=64)
    pagedkv.patch(model)   # model.generate(...) now runs on pagedkv; pagedkv.unpatch(model)

This module checks the inputs and resolves HF's arguments; runtime/fixed_batch.py runs the batch.
"""

from __future__ import annotations

import contextlib
from typing import Any, Literal, overload

import torch
from transformers import GenerationConfig
from transformers.generation.utils import GenerateBeamDecoderOnlyOutput, GenerateDecoderOnlyOutput

from pagedkv.cache import KVCache
from pagedkv.cache.kv_dtype import kv_cache_options
from pagedkv.hf import arguments, beam_search
from pagedkv.hf.generation_config import UnsupportedGenerationArgument, resolve_generation
from pagedkv.hf.processing import CallArguments, processed_decode
from pagedkv.models.module_hooks import check_no_forward_hooks
from pagedkv.models.registry import check_no_dropout, check_supported, compiled_original
from pagedkv.runtime.draft_model import SCHEDULES, DraftRefused, check_draft, drafting
from pagedkv.runtime.fixed_batch import FixedBatch, GenerationSettings
from pagedkv.runtime.model import PREPARED_ATTR, device_of, prepared
from pagedkv.runtime.prefix_reuse import weights_version


def _inferred_mask(input_ids: torch.Tensor, settings: GenerationSettings) -> torch.Tensor | None:
    """HF's _prepare_attention_mask_for_generation without an attention_mask: the mask is
    input_ids != pad_token_id when the pad id (the first EOS id if unset) occurs in input_ids
    and is not an EOS id; else none (every token counts)."""
    pad, eos = settings.pad_token_id, settings.eos_token_ids
    if pad is None or pad in eos or not bool((input_ids == pad).any()):
        return None
    return input_ids != pad


def _prompts_from_left_padded(input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                              inferred_from: int | None = None) -> list[list[int]]:
    """Each row's real tokens. HF's decoder-only generate expects left padding.
    inferred_from: the pad id the mask was inferred from (for the error message)."""
    if attention_mask is None:
        return input_ids.tolist()
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError("pagedkv.generate: attention_mask must be a tensor [batch, prompt_length] "
                        f"of 0/1, got {type(attention_mask).__name__}")
    if attention_mask.device != input_ids.device:
        raise ValueError(f"pagedkv.generate: attention_mask is on {attention_mask.device} but input_ids "
                         f"is on {input_ids.device}; both must be on the model's device")
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"pagedkv.generate: attention_mask has shape {tuple(attention_mask.shape)} "
                         f"but input_ids has {tuple(input_ids.shape)}; they must match")
    mask = attention_mask.cpu()
    if mask.dtype != torch.bool:
        # HF reads other values as weights (2 doubles positions, 0.5 scales attention), so no
        # drop-in gives its tokens for them.
        bad = mask[(mask != 0) & (mask != 1)]
        if bad.numel():
            raise ValueError("pagedkv.generate: attention_mask must hold only 0 and 1 (bool, integer or "
                             f"float dtype); got {sorted(set(bad.tolist()))[:5]}")
        mask = mask.bool()
    lengths = mask.sum(1)
    width = input_ids.shape[1]
    expected = torch.arange(width).unsqueeze(0) >= (width - lengths).unsqueeze(1)
    if not torch.equal(mask, expected):
        source = ("attention_mask" if inferred_from is None else f"the attention mask, inferred from "
                  f"pad_token_id={inferred_from} as HF does without one,")
        raise ValueError(f"pagedkv.generate: {source} must be left-padded (zeros, then ones in each "
                         "row), as HF's decoder-only generate expects; got another pattern"
                         + ("" if inferred_from is None else "; pass attention_mask")
                         + '. Tokenize with tokenizer.padding_side = "left"')
    if (lengths == 0).any():
        raise ValueError(f"pagedkv.generate: row(s) {(lengths == 0).nonzero().flatten().tolist()} "
                         "of attention_mask are empty; every prompt needs at least one token")
    ids = input_ids.cpu()
    return [ids[r, width - int(n):].tolist() for r, n in enumerate(lengths)]


def _check_inputs(model, input_ids) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError("pagedkv.generate: input_ids must be a 2-D tensor [batch, prompt_length] "
                         f"of token ids, got {type(input_ids).__name__} "
                         f"{tuple(getattr(input_ids, 'shape', ()))}")
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"pagedkv.generate: input_ids has dtype {input_ids.dtype}; allowed: torch.int64, torch.int32")
    if input_ids.numel() == 0:
        raise ValueError("pagedkv.generate: input_ids is empty; every prompt needs at least one token")
    device = device_of(model)
    if input_ids.device != device:
        raise ValueError(f"pagedkv.generate: input_ids is on {input_ids.device} but pagedkv runs the "
                         f"model on {device}; move them there")
    vocab = model.config.vocab_size
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or hi >= vocab:
        raise ValueError(f"pagedkv.generate: input_ids hold ids in [{lo}, {hi}]; allowed: [0, {vocab - 1}]")


# The return type follows return_dict_in_generate where a type checker can see it: a tensor by
# default, the output object when the argument is True, either with a generation_config.
@overload
def generate(model: torch.nn.Module, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
             generation_config: GenerationConfig | None = None, streamer: Any = None,
             use_cuda_graphs: bool | None = None, *, return_dict_in_generate: Literal[True],
             **kwargs: Any) -> GenerateDecoderOnlyOutput | GenerateBeamDecoderOnlyOutput: ...
@overload
def generate(model: torch.nn.Module, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
             generation_config: None = None, streamer: Any = None, use_cuda_graphs: bool | None = None,
             *, return_dict_in_generate: Literal[False] | None = None, **kwargs: Any) -> torch.Tensor: ...
@overload
def generate(model: torch.nn.Module, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
             generation_config: GenerationConfig | None = None, streamer: Any = None,
             use_cuda_graphs: bool | None = None,
             **kwargs: Any) -> torch.Tensor | GenerateDecoderOnlyOutput | GenerateBeamDecoderOnlyOutput: ...
def generate(model: torch.nn.Module, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
             generation_config: GenerationConfig | None = None, streamer: Any = None,
             use_cuda_graphs: bool | None = None,
             **kwargs: Any) -> torch.Tensor | GenerateDecoderOnlyOutput | GenerateBeamDecoderOnlyOutput:
    """HF ``model.generate`` on pagedkv. input_ids: [B, S] (left-padded, with attention_mask),
    on the model's device. Returns what HF returns: a [B, S + N] tensor of the prompts and the new
    tokens (pad_token_id after a row's EOS), or with return_dict_in_generate=True HF's output
    object (GenerateBeamDecoderOnlyOutput for num_beams > 1, else GenerateDecoderOnlyOutput) with
    `sequences`, and `scores`/`logits`/... as asked; its past_key_values is None (pagedkv's own
    prefix cache keeps the K/V for the next call). Settings HF accepts but pagedkv does not implement raise
    UnsupportedGenerationArgument naming them. use_cuda_graphs: default on for CUDA models.
    The result is an ordinary tensor, as HF's (no_grad), not an inference tensor.
    kv_cache_dtype: "auto" (the model's dtype) or "fp8" (e4m3: half the bytes per token; scales
    per layer from kv_cache_scales: None = the checkpoint's k_scale/v_scale if any, else 1.0;
    "calibrate" = amax over this call's prompts / 448; or a list of (k_scale, v_scale) per layer;
    see pagedkv/cache/kv_dtype.py and docs/limits.md). Not with beams, tensor parallel or fallback models."""
    model = compiled_original(model)  # torch.compile(model): pagedkv runs the original's weights
    with torch.inference_mode():
        new_tokens, settings, outputs = _generate(model, input_ids, attention_mask, generation_config,
                                                  streamer, use_cuda_graphs, kwargs)  # [B, N]
    if isinstance(new_tokens, GenerateBeamDecoderOnlyOutput):  # beam search: HF's whole output
        output = beam_search.plain(new_tokens)
        return output if settings.return_dict_in_generate else output.sequences
    with torch.no_grad():  # outside inference mode: the concatenation is an ordinary tensor
        rows = _rows(input_ids, settings.num_return_sequences)  # [B * n, S]
        sequences = torch.cat([rows, new_tokens.to(input_ids.dtype)], dim=1)
    if settings.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=sequences, **outputs)
    return sequences


def _generate(model, input_ids, attention_mask, generation_config, streamer, use_cuda_graphs,
              kwargs) -> tuple[torch.Tensor, GenerationSettings, dict[str, Any]]:
    """The new tokens [B * num_return_sequences, N], the call's settings, and the output fields
    besides `sequences` (scores, logits: the processed path's, hf/processed_decode.py). With
    num_beams > 1, HF's whole beam output in place of the new tokens."""
    check_supported(model)
    check_no_dropout(model, "pagedkv.generate")
    check_no_forward_hooks(model, "pagedkv.generate")
    if kwargs.get("inputs_embeds") is not None:
        raise UnsupportedGenerationArgument(
            "pagedkv.generate: inputs_embeds is not supported: pagedkv.generate takes token ids; pass "
            "input_ids (the embeddings are looked up from them on the device)")
    if kwargs.get("past_key_values") is not None:
        raise UnsupportedGenerationArgument(
            "pagedkv.generate: past_key_values is not supported: pagedkv reuses the K/V of earlier "
            "generate() calls by itself (their prompts' and outputs' full blocks stay in its prefix "
            "cache); pass the whole conversation as input_ids, without past_key_values")
    _check_inputs(model, input_ids)
    kv_args = kwargs.pop("kv_cache_dtype", "auto"), kwargs.pop("kv_cache_scales", None)
    call = CallArguments.pop_from(kwargs)  # logits_processor, stopping_criteria, ...
    draft = kwargs.pop("assistant_model", None)
    assisted = None if draft is None else _assistant_tokens(draft, kwargs)  # (k, schedule)
    settings = resolve_generation(model, input_ids.shape[1], generation_config, kwargs,
                                  batch_without_mask=attention_mask is None and input_ids.shape[0] > 1)
    inferred_from = None
    if attention_mask is None:
        attention_mask = _inferred_mask(input_ids, settings)
        inferred_from = settings.pad_token_id
    prompts = _prompts_from_left_padded(input_ids, attention_mask, inferred_from)
    beams = settings.num_beams > 1
    n = settings.num_return_sequences
    # None: the fast path (no processor, criterion or scores asked for). Rows as HF expands them.
    decode = None if beams else processed_decode(model, _rows(input_ids, n), _rows(attention_mask, n),
                                                 generation_config, kwargs, call, settings, streamer)
    if decode is not None and settings.prompt_lookup_num_tokens:
        raise UnsupportedGenerationArgument(
            "pagedkv.generate: prompt_lookup_num_tokens is not supported yet with HF's processed path "
            "(logits_processor, stopping_criteria, prefix_allowed_tokens_fn, output_scores or "
            "output_logits); drop them or prompt_lookup_num_tokens")
    if draft is not None:
        _check_assisted(model, draft, settings, decode is not None)
    state = prepared(model)
    kv_dtype, kv_scales = kv_cache_options(model, state, *kv_args, "pagedkv.generate", beams=beams,
                                           input_ids=input_ids, attention_mask=attention_mask)
    with state.lock:  # one call at a time per model: they share its fixed batch and cache
        if state.fixed_batch is None:
            state.fixed_batch = FixedBatch(state)
        state.fixed_batch.kv_dtype, state.fixed_batch.kv_scales = kv_dtype, kv_scales
        state.fixed_batch.note_weights(weights_version(model))  # cached K/V of older weights go
        if beams:  # HF's beam search, each beam a fork on the cache (hf/beam_search.py)
            return beam_search.beam_search(model, state.fixed_batch, prompts, input_ids, attention_mask,
                                           generation_config, kwargs, call, settings, streamer), settings, {}
        proposals = contextlib.nullcontext() if draft is None else drafting(
            draft, prompts, *assisted, settings.max_new_tokens, settings.eos_token_ids)
        with proposals as proposer:  # a draft model's proposer: its own cache, freed however this ends
            new_tokens = state.fixed_batch.generate(prompts, _rows(input_ids, n), settings, streamer,
                                                    use_cuda_graphs, decode_loop=decode, proposer=proposer)  # [B, N]
    outputs = {} if decode is None else {"scores": decode.scores, "logits": decode.logits}
    return new_tokens, settings, outputs


def _assistant_tokens(draft, kwargs: dict[str, Any]) -> tuple[int, str]:
    """(num_assistant_tokens, num_assistant_tokens_schedule), popped from the call's kwargs: the
    call's values, else the draft's generation_config's (where HF's AssistedCandidateGenerator
    reads them), else HF's global defaults."""
    config = getattr(draft, "generation_config", None)
    defaults = GenerationConfig._get_default_generation_params() if hasattr(
        GenerationConfig, "_get_default_generation_params") else GenerationConfig().to_dict()
    found = {}
    for name in ("num_assistant_tokens", "num_assistant_tokens_schedule"):
        value = kwargs.pop(name, None)
        found[name] = next((v for v in (value, getattr(config, name, None), defaults.get(name)) if v is not None),
                           None)
    k = arguments.integer("num_assistant_tokens", found["num_assistant_tokens"])
    if k is None or k < 1:
        raise ValueError(f"pagedkv.generate: num_assistant_tokens={k}; it must be >= 1")
    schedule = found["num_assistant_tokens_schedule"] or "constant"
    if schedule not in SCHEDULES:
        raise ValueError(f"pagedkv.generate: num_assistant_tokens_schedule={schedule!r}; allowed: "
                         f"{', '.join(map(repr, SCHEDULES))}")
    return k, schedule


def _check_assisted(model, draft, settings: GenerationSettings, processed: bool) -> None:
    """Refuse, naming them, a draft or settings that assisted decoding does not run with yet."""
    try:
        check_draft(model, draft)
    except DraftRefused as error:
        raise UnsupportedGenerationArgument(f"pagedkv.generate: {error}") from None
    # Sampling keeps the target's distribution: the greedy draft's proposal is a point mass, and
    # prompt lookup's speculative sampling rule (runtime/speculative_sampling.py) is exact for it.
    refused = [name for name, on in (
        ("num_return_sequences > 1", settings.num_return_sequences > 1),
        ("num_beams > 1", settings.num_beams > 1),
        ("repetition_penalty", settings.repetition_penalty != 1.0),
        ("prompt_lookup_num_tokens", settings.prompt_lookup_num_tokens > 0),
        ("logits processors (processors, stopping_criteria, output_scores, ...)",
         processed or settings.processors is not None)) if on]
    if refused:
        raise UnsupportedGenerationArgument(
            f"pagedkv.generate: assistant_model runs greedy decoding or sampling (temperature, top_k, "
            f"top_p) without other logits processors for now; "
            f"not supported yet with {', '.join(refused)}")


def _rows(tensor: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """[B, ...] -> [B * n, ...], each row n times (HF's expansion for num_return_sequences)."""
    return tensor if tensor is None or n == 1 else tensor.repeat_interleave(n, dim=0)


def kv_cache_of(model) -> KVCache | None:
    """The KV cache generate() runs `model` on (None before its first call). Between calls it
    holds no sequence; its blocks are free or cached (earlier calls' K/V, evictable: handed out
    when a call needs them), so ``cache.num_free_blocks == cache.num_blocks``."""
    state = getattr(compiled_original(model), PREPARED_ATTR, None)
    return None if state is None or state.fixed_batch is None else state.fixed_batch.cache
