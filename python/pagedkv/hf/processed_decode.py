"""generate()'s processed decode path: HF's _sample loop around pagedkv's forward.

Each step's forward runs on pagedkv's runner and cache (a CUDA graph of advance + forward on
CUDA: runtime/logits_step.py); then, on the host's side of each step and in HF's order, the raw
logits are copied to fp32, HF's logits processors run on the growing input_ids [B, S + t],
the token is chosen (argmax, or softmax + torch.multinomial from torch's global RNG with
do_sample, as HF draws), finished rows get pad_token_id when an EOS criterion is present, and
HF's stopping criteria decide which rows are done. Finished rows keep running, as in HF, so
their scores are HF's. Each step reads its tokens back (one sync a step, as HF's loop).

The processors run outside inference mode (under no_grad, as in HF): the scores and logits it
returns, and any tensor a user's processor keeps, are ordinary tensors.
"""

from __future__ import annotations

from typing import Callable

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList


class ProcessedDecode:
    """decode(first_logits [B, V], step) -> new tokens [B, N]; step(tokens [B]) -> logits [B, V].
    After it, `scores` and `logits` hold HF's per-step tuples of [B, V] fp32 (None unless asked)."""

    def __init__(self, input_ids: torch.Tensor, processors: LogitsProcessorList,
                 criteria: StoppingCriteriaList, *, do_sample: bool, pad_token_id: torch.Tensor | None,
                 max_new_tokens: int, output_scores: bool, output_logits: bool, streamer=None) -> None:
        self.input_ids = input_ids  # [B, S]: the call's, left padding included, as HF feeds them
        self.processors = processors
        self.criteria = criteria
        self.do_sample = do_sample
        self.pad_token_id = pad_token_id  # 0-d int64 tensor on the device, or None
        self.max_new_tokens = max_new_tokens
        self.streamer = streamer
        self.scores: tuple[torch.Tensor, ...] | None = () if output_scores else None
        self.logits: tuple[torch.Tensor, ...] | None = () if output_logits else None
        # HF pads finished rows only when a criterion stops on EOS (it checks the attribute).
        self.pads_finished = any(hasattr(c, "eos_token_id") for c in criteria)

    def _select(self, ids: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
        """One step of HF's _sample on the host side: raw logits [B, V] fp32 -> tokens [B]."""
        scores = self.processors(ids, raw)  # [B, V]
        if self.scores is not None:
            self.scores += (scores,)
        if self.logits is not None:
            self.logits += (raw,)
        if self.do_sample:
            probs = torch.nn.functional.softmax(scores, dim=-1)
            return torch.multinomial(probs, num_samples=1).squeeze(1)
        return torch.argmax(scores, dim=-1)

    def __call__(self, first_logits: torch.Tensor, step: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        streamer = self.streamer
        start = self.input_ids.shape[1]
        logits = first_logits  # [B, V] of the prompts' last tokens
        try:
            with torch.inference_mode(False), torch.no_grad():
                ids = self.input_ids.long()  # [B, S + t]
                unfinished = torch.ones(ids.shape[0], dtype=torch.long, device=ids.device)  # [B]
                if streamer is not None:
                    streamer.put(self.input_ids.cpu())
                for t in range(self.max_new_tokens):
                    raw = logits.to(copy=True, dtype=torch.float32)  # [B, V]
                    tokens = self._select(ids, raw)  # [B]
                    if self.pads_finished:
                        tokens = tokens * unfinished + self.pad_token_id * (1 - unfinished)
                    ids = torch.cat([ids, tokens[:, None]], dim=-1)
                    unfinished = unfinished & ~self.criteria(ids, self.scores)
                    if streamer is not None:
                        streamer.put(tokens.cpu())
                    if bool(unfinished.max() == 0) or t + 1 == self.max_new_tokens:
                        break
                    with torch.inference_mode():
                        logits = step(tokens)
            return ids[:, start:]
        finally:
            if streamer is not None:
                streamer.end()
