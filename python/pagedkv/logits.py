"""The logits processing of HF's greedy/sample loop that pagedkv applies before its sampler, in
HF's order and arithmetic, on device and without host syncs (so it runs inside a CUDA graph):
repetition penalty, then min_new_tokens' EOS suppression. Temperature, top-k and top-p are done
by the sampling op."""

from __future__ import annotations

import torch


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> None:
    """In place, HF's RepetitionPenaltyLogitsProcessor: logits of tokens already in the sequence
    (prompt included) are divided by `penalty` if positive, multiplied if negative.
    logits: [B, V] float32; seen: [B, V] bool."""
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    torch.where(seen, penalized, logits, out=logits)


def suppress_eos(logits: torch.Tensor, eos_ids: torch.Tensor, generated: torch.Tensor,
                 min_new_tokens: int) -> None:
    """In place, HF's MinNewTokensLengthLogitsProcessor: EOS logits are -inf while a row has
    generated fewer than min_new_tokens. logits: [B, V]; eos_ids: [E] int64; generated: [B]."""
    too_early = (generated < min_new_tokens).unsqueeze(1)  # [B, 1]
    eos_logits = logits[:, eos_ids]  # [B, E]
    logits[:, eos_ids] = torch.where(too_early, torch.full_like(eos_logits, -float("inf")), eos_logits)
