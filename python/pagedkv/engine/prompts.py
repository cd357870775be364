"""What pagedkv.LLM takes as input: a model (loaded, or a name for from_pretrained) with its
tokenizer, and prompts as strings, token ids or vLLM's prompt dicts ({"prompt": str} or
{"prompt_token_ids": [...]}), checked and turned into token-id lists."""

from __future__ import annotations

import numbers
import operator
from typing import Mapping, Sequence

import torch

from pagedkv.models.registry import compiled_original

Prompt = str | Sequence[int] | Mapping[str, object]
PROMPT_KEYS = ("prompt", "prompt_token_ids")


def load_model(model, tokenizer, dtype):
    """(model in eval mode, tokenizer): model and tokenizer may be names for from_pretrained; a
    torch.compile wrapper gives its original (pagedkv runs the weights, not the compiled forward)."""
    if isinstance(model, str):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        name = model
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype or "auto")
        if torch.cuda.is_available():
            model = model.cuda()
        if tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(name)
    elif isinstance(tokenizer, str):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer)
    return compiled_original(model).eval(), tokenizer


def prompt_token_ids(prompt) -> list[int]:
    """The ids of a prompt given as ids: ints (Python, numpy, 0-d tensors; never floats), or an
    integer tensor [n] or [1, n] on any device that holds data."""
    if isinstance(prompt, torch.Tensor):
        if prompt.is_floating_point() or prompt.is_complex() or prompt.dtype == torch.bool:
            raise TypeError(f"pagedkv.LLM: a prompt tensor must hold integer token ids, got dtype {prompt.dtype}")
        if prompt.dim() > 2 or (prompt.dim() == 2 and prompt.shape[0] != 1):
            raise ValueError(f"pagedkv.LLM: a prompt tensor must be [n] or [1, n], got shape "
                             f"{tuple(prompt.shape)}; pass a batch as a list of prompts")
        if prompt.is_meta:
            raise ValueError("pagedkv.LLM: a prompt tensor is on the meta device (it holds no token ids)")
        return prompt.flatten().tolist()
    try:
        items = list(prompt)
    except TypeError:
        raise TypeError("pagedkv.LLM: a prompt is a string or a list of token ids, got "
                        f"{type(prompt).__name__}") from None
    ids = []
    for t in items:
        try:
            ids.append(operator.index(t))
        except TypeError:
            raise TypeError(f"pagedkv.LLM: token ids must be ints, got {t!r} ({type(t).__name__})") from None
    return ids


def _dict_prompt(prompt: Mapping, tokenizer) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of a prompt dict: "prompt_token_ids" if given (then "prompt" is
    only the text reported with the output), else "prompt" tokenized."""
    keys = set(prompt)
    if keys - set(PROMPT_KEYS) or not keys:
        raise ValueError(f"pagedkv.LLM: a prompt dict takes the keys 'prompt' (a string) and/or "
                         f"'prompt_token_ids' (token ids, used if both are given), got keys "
                         f"{sorted(map(repr, keys))}")
    text = prompt.get("prompt")
    if text is not None and not isinstance(text, str):
        raise TypeError(f"pagedkv.LLM: a prompt dict's 'prompt' must be a string, got {type(text).__name__}")
    if "prompt_token_ids" not in prompt:
        return tokenize_text(text, tokenizer), text
    ids = prompt["prompt_token_ids"]
    if isinstance(ids, (str, bytes)):
        raise TypeError("pagedkv.LLM: a prompt dict's 'prompt_token_ids' must be token ids, got a string; "
                        "put text under 'prompt'")
    return prompt_token_ids(ids), text


def tokenize_text(text: str, tokenizer) -> list[int]:
    if tokenizer is None:
        raise ValueError("pagedkv.LLM: a string prompt needs a tokenizer; pass tokenizer= "
                         "or give token ids")
    return list(tokenizer.encode(text))


def tokenize_prompt(prompt: Prompt, tokenizer, vocab_size: int) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of a prompt; TypeError/ValueError naming what is wrong."""
    if isinstance(prompt, Mapping):
        ids, text = _dict_prompt(prompt, tokenizer)
    elif isinstance(prompt, str):
        ids = tokenize_text(prompt, tokenizer)
        text = prompt
    else:
        ids = prompt_token_ids(prompt)
        text = None
    if not ids:
        raise ValueError("pagedkv.LLM: the prompt is empty; it needs at least one token")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"pagedkv.LLM: prompt token ids {bad[:5]} are outside "
                         f"[0, {vocab_size - 1}]")
    return text, ids


def is_token(value) -> bool:
    """Whether a batch's item is a token id (its batch is then one prompt): a Python or numpy
    integer, or a 0-d integer tensor or array."""
    if isinstance(value, numbers.Integral):
        return True
    return getattr(value, "ndim", None) == 0 and not isinstance(value, (str, bytes))


def batch_of(prompts, sampling_params) -> tuple[list, list]:
    """(prompts, one sampling-params entry per prompt) of LLM.generate/stream's arguments: one
    prompt (a string, a prompt dict, a list of ids, a 1-D tensor or array [n]) or many (a list, or a 2-D
    tensor or array [B, n]: its rows); one SamplingParams (or None) for all, or a list."""
    ndim = getattr(prompts, "ndim", None)  # torch and numpy arrays
    if ndim is not None and not isinstance(prompts, (str, bytes)):
        if ndim not in (1, 2):
            raise ValueError(f"pagedkv.LLM: prompts given as an array must be [n] (one prompt) or "
                             f"[B, n] (B prompts), got shape {tuple(prompts.shape)}")
        prompts = [prompts] if ndim == 1 else list(prompts)
    elif isinstance(prompts, (str, Mapping)) or (isinstance(prompts, (list, tuple)) and prompts
                                      and is_token(prompts[0])):
        prompts = [prompts]
    prompts = list(prompts)
    if isinstance(sampling_params, (list, tuple)):
        if len(sampling_params) != len(prompts):
            raise ValueError(f"pagedkv.LLM: got {len(sampling_params)} sampling_params for "
                             f"{len(prompts)} prompts; give one, or one per prompt")
        return prompts, list(sampling_params)
    return prompts, [sampling_params] * len(prompts)


def check_params(params, tokenizer, vocab_size: int) -> None:
    """What a SamplingParams needs of the engine: a tokenizer for stop strings, and a vocabulary
    of at least `logprobs` tokens."""
    if params.stop and tokenizer is None:
        raise ValueError("pagedkv.LLM: stop strings need a tokenizer (pass tokenizer= to pagedkv.LLM); "
                         "stop_token_ids work without one")
    if params.logprobs is not None and params.logprobs > vocab_size:
        raise ValueError(f"pagedkv.LLM: logprobs={params.logprobs} is more than the vocabulary "
                         f"({vocab_size} tokens)")
