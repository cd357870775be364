"""SamplingParams: how one request is decoded (per request, not per engine)."""

from __future__ import annotations

import dataclasses
import operator

FLOAT32_MAX = 3.4028234663852886e38  # temperatures are float32 on the device
TOKEN_ID_LIMIT = 2**31  # token ids are int32 on the device
MAX_LOGPROBS = 20  # vLLM's default max_logprobs: top tokens reported per output token


def _is_int(value) -> bool:
    """A count, seed or id: an int, never a bool (True is not 1 token)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _token_ids(values) -> tuple[int, ...] | None:
    """stop_token_ids as plain ints (numpy/torch integer scalars pass), or None unless each is an
    int in [0, 2**31) (a string, a float or a bool is not)."""
    if isinstance(values, (str, bytes)):
        return None
    try:
        items = tuple(values)
        ids = tuple(operator.index(v) for v in items if not isinstance(v, bool))
    except TypeError:
        return None
    if len(ids) != len(items) or not all(0 <= t < TOKEN_ID_LIMIT for t in ids):
        return None
    return ids


def _stop_strings(value) -> tuple[str, ...] | None:
    """stop as a tuple of non-empty strings (one string, or a list of them), or None if not."""
    items = (value,) if isinstance(value, str) else value
    try:
        items = tuple(items)
    except TypeError:
        return None
    return items if all(isinstance(s, str) and s for s in items) else None


def _number(value) -> float | None:
    """A real number as a float (never a bool or a string), else None."""
    if isinstance(value, (bool, str, bytes)):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


@dataclasses.dataclass(slots=True)
class SamplingParams:
    """Per-request decoding settings of ``pagedkv.LLM``.

    temperature 0 is greedy (exactly argmax); > 0 samples from softmax(logits / temperature)
    restricted to the top_k tokens (0 = off), then to the top_p probability mass (1.0 = off).
    A request finishes with reason "stop" on an EOS id of the model (unless ignore_eos) or one of
    stop_token_ids (the stop token is kept in the output ids), else "length" after max_tokens new
    tokens (or at the engine's max_model_len). stop: strings that end the output text (vLLM's rule:
    the text ends before the stop string, or after it with include_stop_str_in_output; token_ids
    keep the token that completed it; finish_reason "stop", stop_reason the string; needs a
    tokenizer). n samples share the prompt's cache blocks; sample i
    draws with seed + i, so a seeded request gives the same tokens whatever else runs beside it.
    seed None: a random seed per request.

    Logits processing (vLLM's semantics, per request, on the device): repetition_penalty
    (HF's: logits of tokens in the prompt or output divided by it if positive, multiplied if
    negative; 1 = off), frequency_penalty (minus it times each token's count in the output) and
    presence_penalty (minus it once for each token in the output), both in [-2, 2] (0 = off), then
    min_p in [0, 1] (tokens whose probability after temperature is below min_p times the top
    one's are dropped; 0 = off). logprobs=k in [0, 20]: each output token's logprob and rank, and
    the k most likely tokens', from the model's raw distribution (before any processing).

    Speculative decoding (engine/speculation.py), for an engine made with it: None takes the
    engine's setting; prompt_lookup_num_tokens (>= 0, 0 = off for this request) and
    max_matching_ngram_size (>= 1) on an engine with prompt lookup, num_assistant_tokens (>= 0)
    on one with an assistant_model.

    Counts and ids are ints, never bools: max_tokens >= 1 (no upper bound), n >= 1, top_k >= -1
    (-1 and 0 are off, -1 is stored as 0; any value >= the vocabulary size is off), seed in [0, 2**62), stop_token_ids in [0, 2**31);
    temperature finite in float32.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    skip_special_tokens: bool = True
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0
    logprobs: int | None = None
    prompt_lookup_num_tokens: int | None = None
    max_matching_ngram_size: int | None = None
    num_assistant_tokens: int | None = None

    def __post_init__(self) -> None:
        errors = []
        stop_ids = _token_ids(self.stop_token_ids)
        if stop_ids is None:
            errors.append(f"stop_token_ids must be ints in [0, 2**31) (token ids), got {self.stop_token_ids!r}")
        else:
            self.stop_token_ids = stop_ids
        # No upper bound: a request also ends at the engine's max_model_len.
        if not _is_int(self.max_tokens) or self.max_tokens <= 0:
            errors.append(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0:  # also catches NaN
            errors.append(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        elif not self.temperature <= FLOAT32_MAX:  # inf, or past float32: no longer a temperature
            errors.append(f"temperature must be finite (at most {FLOAT32_MAX:.4g}, float32), "
                          f"got {self.temperature!r}")
        # Any top_k >= the vocabulary size is off; the sampler stores those past int32 as 2**31 - 1.
        if not _is_int(self.top_k) or self.top_k < -1:
            errors.append(f"top_k must be an int >= -1 (-1 or 0 = off), got {self.top_k!r}")
        elif self.top_k == -1:
            self.top_k = 0  # vLLM's "off"
        if not 0 < self.top_p <= 1:
            errors.append(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if not _is_int(self.n) or self.n < 1:
            errors.append(f"n must be an int >= 1, got {self.n!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**62):
            errors.append(f"seed must be None or an int in [0, 2**62), got {self.seed!r}")
        errors += self._check_processing()
        if errors:
            raise ValueError("pagedkv.SamplingParams: " + "; ".join(errors))

    def _check_processing(self) -> list[str]:
        """The errors of the stop strings, penalties, min_p and logprobs (vLLM's ranges)."""
        errors = []
        stop = () if self.stop is None else _stop_strings(self.stop)
        if stop is None:
            errors.append(f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        else:
            self.stop = stop
        for name, low, high, off in (("repetition_penalty", 0, FLOAT32_MAX, 1), ("presence_penalty", -2, 2, 0),
                                     ("frequency_penalty", -2, 2, 0), ("min_p", 0, 1, 0)):
            value = _number(getattr(self, name))
            if value is None or not low <= value <= high or (name == "repetition_penalty" and value == 0):
                allowed = "a finite number > 0" if name == "repetition_penalty" else f"in [{low}, {high}]"
                errors.append(f"{name} must be {allowed} ({off} = off), got {getattr(self, name)!r}")
            else:
                setattr(self, name, value)
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            errors.append(f"logprobs must be None or an int in [0, {MAX_LOGPROBS}] (top tokens per output "
                          f"token), got {self.logprobs!r}")
        for name, low in (("prompt_lookup_num_tokens", 0), ("max_matching_ngram_size", 1),
                          ("num_assistant_tokens", 0)):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < low):
                errors.append(f"{name} must be None (the engine's) or an int >= {low}, got {value!r}")
        return errors

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether a penalty needs the request's token counts on the device."""
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def special(self) -> bool:
        """Whether the engine processes the request's rows beyond plain sampling (penalties, min_p,
        logprobs) or reads its tokens back with more than the stop-id rule (stop strings)."""
        return self.penalized or self.min_p > 0 or self.logprobs is not None or bool(self.stop)
