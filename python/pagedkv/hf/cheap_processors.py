"""Which of HF's processor settings generate()'s fast path runs itself (runtime/fast_processors.py),
read through HF's own processor classes so that their checks, EOS filtering and merges are HF's.

Fast-eligible: suppress_tokens, begin_suppress_tokens, bad_words_ids and sequence_bias whose words
are all single tokens, and min_p: ignored without do_sample (HF builds no warper then); with it,
exact only at top_p == 1. HF's min_p mask (p < min_p * p_max) compares ratios of probabilities, so
top-k's cut before it (which keeps the top token) changes no ratio; but top-p after min_p would
measure its mass on min_p's renormalized distribution, a different set than HF's top-p-then-min_p.
A call that sets anything else of PROCESSED_FIELDS, or a longer word, takes the processed path.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.generation import MinPLogitsWarper, NoBadWordsLogitsProcessor, SequenceBiasLogitsProcessor

from pagedkv.runtime.fast_processors import FastProcessors

CHEAP_FIELDS = frozenset({"suppress_tokens", "begin_suppress_tokens", "bad_words_ids", "sequence_bias", "min_p"})


def _tokens(values: Any, vocab: int) -> list[int]:
    """HF's suppression lists as its torch.isin over the vocabulary reads them: ids outside
    [0, vocab) match nothing."""
    ids = torch.tensor(list(values), dtype=torch.int64).flatten().tolist()
    return sorted({t for t in ids if 0 <= t < vocab})


def _single_token_biases(processor: SequenceBiasLogitsProcessor, vocab: int) -> list[tuple[int, float]] | None:
    """The processor's (token, bias) pairs, None if a word is longer than one token. Refuses ids
    outside the vocabulary, as HF's first call does (here before any work)."""
    biases = processor.sequence_bias  # {tuple of ids: float}, after HF's checks and conversion
    if any(len(word) != 1 for word in biases):
        return None
    invalid = [word[0] for word in biases if word[0] >= vocab]
    if invalid:
        raise ValueError(f"pagedkv.generate: The model vocabulary size is {vocab}, but the following "
                         f"tokens were being biased: {invalid}")
    return [(word[0], float(bias)) for word, bias in biases.items()]


def fast_processors(config, in_use: list[str], eos_ids: tuple[int, ...], vocab: int, do_sample: bool,
                    top_p: float) -> FastProcessors | None:
    """The call's cheap processors for the fast path, or None when a setting in use needs the
    processed path. in_use: the call's PROCESSED_FIELDS set (output_scores/output_logits aside);
    eos_ids: as the config gives them (HF filters bad words equal to an EOS id)."""
    if not set(in_use) <= CHEAP_FIELDS:
        return None
    try:
        bias: list[tuple[int, float]] = []
        # HF's order: sequence_bias, (repetition penalty), bad words, (min_new_tokens), suppress.
        if "sequence_bias" in in_use:
            pairs = _single_token_biases(SequenceBiasLogitsProcessor(config.sequence_bias), vocab)
            if pairs is None:
                return None
            bias += pairs
        if "bad_words_ids" in in_use:
            eos = torch.tensor(eos_ids, dtype=torch.int64) if eos_ids else None
            pairs = _single_token_biases(NoBadWordsLogitsProcessor(config.bad_words_ids, eos), vocab)
            if pairs is None:
                return None
            bias += pairs
        if "suppress_tokens" in in_use:
            bias += [(t, -float("inf")) for t in _tokens(config.suppress_tokens, vocab)]
        begin = _tokens(config.begin_suppress_tokens, vocab) if "begin_suppress_tokens" in in_use else []
        min_p = None
        if "min_p" in in_use and do_sample:
            min_p = MinPLogitsWarper(config.min_p).min_p  # HF's check of its value
            if top_p < 1.0:
                return None
            min_p = min_p or None  # 0 drops nothing
    except ValueError as error:  # HF's checks of the settings
        if str(error).startswith("pagedkv"):
            raise
        raise ValueError(f"pagedkv.generate: {error}") from error
    return FastProcessors(bias=tuple(bias), begin=tuple(begin), min_p=min_p)
