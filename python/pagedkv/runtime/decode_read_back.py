"""generate()'s decode steps, one queued ahead of the host: it reads back step t's tokens (the
only sync) while step t+1 runs, so finished rows are seen one step late and that spare step is
discarded. runtime/fixed_batch.py hands it the replay of its captured step."""

from __future__ import annotations

from typing import Protocol

import torch


class StopSettings(Protocol):
    """What this loop reads of fixed_batch.GenerationSettings (that module imports this one)."""

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...
    @property
    def pad_token_id(self) -> int | None: ...
    @property
    def do_sample(self) -> bool: ...


def read_back(replay, first: torch.Tensor, next_tokens: torch.Tensor, rows: int, batch: int,
               max_new: int, settings: StopSettings, streamer, input_ids: torch.Tensor,
               device: torch.device) -> torch.Tensor:
    """Runs the decode steps, one queued ahead of the host's read-back; returns [B, N]."""
    pinned = device.type == "cuda"
    tokens_host = torch.empty(max_new, rows, dtype=torch.int64, pin_memory=pinned)
    ready: list[torch.cuda.Event | None] = []

    def fetch(step: int, tokens: torch.Tensor) -> None:
        tokens_host[step].copy_(tokens, non_blocking=pinned)
        event = torch.cuda.Event() if pinned else None
        if event is not None:
            event.record()
        ready.append(event)

    fetch(0, first)
    eos = torch.tensor(settings.eos_token_ids, dtype=torch.int64)
    pad = settings.pad_token_id
    finished = torch.zeros(batch, dtype=torch.bool)
    produced: list[torch.Tensor] = []
    launched = 1
    try:  # the streamer gets end() however the loop ends, so that its reader is released
        if streamer is not None:
            streamer.put(input_ids.cpu())
        while len(produced) < launched:
            if launched < max_new:  # keep one step queued while the host reads the last
                replay()
                fetch(launched, next_tokens)
                launched += 1
            step = len(produced)
            if ready[step] is not None:
                ready[step].synchronize()
            tokens = tokens_host[step, :batch].clone()
            if settings.do_sample and bool((tokens < 0).any()):  # -1: NaN/inf logits (ops.sample)
                raise RuntimeError(f"pagedkv.generate: row(s) {(tokens < 0).nonzero().flatten().tolist()} "
                                   f"of the batch have NaN or infinite logits at new token {step + 1}, so "
                                   "do_sample=True has no distribution to draw from (HF's generate raises "
                                   "too: probability tensor contains either inf, nan or element < 0)")
            if pad is not None:
                tokens = torch.where(finished, torch.full_like(tokens, pad), tokens)
            if len(eos):
                finished |= torch.isin(tokens, eos)
            produced.append(tokens)
            if streamer is not None:
                streamer.put(tokens)
            if bool(finished.all()):
                break
    finally:
        if streamer is not None:
            streamer.end()
        if pinned:
            torch.cuda.current_stream().synchronize()  # no step left writing the cache
    return torch.stack(produced, dim=1).to(device)
