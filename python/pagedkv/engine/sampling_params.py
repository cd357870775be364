"""SamplingParams: how one request is decoded (per request, not per engine)."""

from __future__ import annotations

import dataclasses


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
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        errors = []
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            errors.append(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0:  # also catches NaN
            errors.append(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            errors.append(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            errors.append(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if not isinstance(self.n, int) or self.n < 1:
            errors.append(f"n must be an int >= 1, got {self.n!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**62):
            errors.append(f"seed must be None or an int in [0, 2**62), got {self.seed!r}")
        if any(t < 0 for t in self.stop_token_ids):
            errors.append(f"stop_token_ids must be token ids >= 0, got {self.stop_token_ids}")
        if errors:
            raise ValueError("pagedkv.SamplingParams: " + "; ".join(errors))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
