"""SamplingParams: how one request is decoded (per request, not per engine)."""

from __future__ import annotations

import dataclasses
import operator

FLOAT32_MAX = 3.4028234663852886e38  # temperatures are float32 on the device
TOKEN_ID_LIMIT = 2**31  # token ids are int32 on the device


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


@dataclasses.dataclass(slots=True)
class SamplingParams:
    """Per-request decoding settings of ``pagedkv.LLM``.

    temperature 0 is greedy (exactly argmax); > 0 samples from softmax(logits / temperature)
    restricted to the top_k tokens (0 = off), then to the top_p probability mass (1.0 = off).
    A request finishes with reason "stop" on an EOS id of the model (unless ignore_eos) or one of
    stop_token_ids (the stop token is kept in the output ids), else "length" after max_tokens new
    tokens (or at the engine's max_model_len). n samples share the prompt's cache blocks; sample i
    draws with seed + i, so a seeded request gives the same tokens whatever else runs beside it.
    seed None: a random seed per request.

    Counts and ids are ints, never bools: max_tokens >= 1 (no upper bound), n >= 1, top_k >= 0
    (any value >= the vocabulary size is off), seed in [0, 2**62), stop_token_ids in [0, 2**31);
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
        if not _is_int(self.top_k) or self.top_k < 0:
            errors.append(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            errors.append(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if not _is_int(self.n) or self.n < 1:
            errors.append(f"n must be an int >= 1, got {self.n!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**62):
            errors.append(f"seed must be None or an int in [0, 2**62), got {self.seed!r}")
        if errors:
            raise ValueError("pagedkv.SamplingParams: " + "; ".join(errors))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
