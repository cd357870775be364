"""HF's cheap logits processors in the form generate()'s captured decode step runs them: static
device tensors filled once per call (so one CUDA graph serves every value), no host sync.

- `bias`: one [V] fp32 additive vector: single-token sequence_bias values, and -inf for
  single-token bad_words_ids and for suppress_tokens. HF adds sequence_bias before its repetition
  penalty and sets the others to -inf after it; a -inf stays -inf through the penalty (times or
  divided by a positive number) and min_new_tokens' EOS suppression, so one addition before the
  penalty gives HF's logits.
- `begin`: begin_suppress_tokens, -inf at the first generated token only (HF's begin_index is the
  prompt width); that token is sampled from the prefill's logits, outside the captured step.
- `min_p` (with do_sample, and only where HF's set equals it: hf/generation_config.py): HF's
  MinPLogitsWarper after temperature: softmax(logits / T), tokens below min_p * p_max to -inf.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True, slots=True)
class FastProcessors:
    """One generate() call's cheap processors (hashable: part of GenerationSettings)."""

    bias: tuple[tuple[int, float], ...] = ()  # (token, additive value), tokens in [0, V)
    begin: tuple[int, ...] = ()  # begin_suppress_tokens in [0, V)
    min_p: float | None = None  # None: off (greedy, or not set)

    def bias_vector(self, vocab: int, device: torch.device) -> torch.Tensor:
        """[V] fp32: each token's values summed (HF adds each processor's bias in turn)."""
        out = torch.zeros(vocab, dtype=torch.float32)
        for token, value in self.bias:
            out[token] += value
        return out.to(device)

    def begin_vector(self, vocab: int, device: torch.device) -> torch.Tensor:
        """[V] fp32: -inf at begin_suppress_tokens, else 0."""
        out = torch.zeros(vocab, dtype=torch.float32)
        out[list(self.begin)] = -float("inf")
        return out.to(device)


def apply_min_p(logits: torch.Tensor, temperatures: torch.Tensor, min_p: torch.Tensor) -> None:
    """In place, HF's MinPLogitsWarper after its TemperatureLogitsWarper (the mask only: the
    sampling op divides by T itself). logits: [n, V] fp32; temperatures, min_p: [n] fp32.
    HF's softmax is over the scores top-k already cut, which scales every kept probability and
    p_max alike, so the kept set is the same."""
    probs = torch.softmax(logits / temperatures[:, None], dim=-1)  # [n, V]
    dropped = probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    logits.masked_fill_(dropped, -float("inf"))
