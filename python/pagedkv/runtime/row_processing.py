"""Per-row logits processing of pagedkv.LLM's sampler, for the rows of requests that ask for it:
repetition, frequency and presence penalties and min_p (vLLM's semantics and order), and the
logprobs of the raw distribution. Rows that ask for nothing are not touched, and a step with no
such row never reaches this file (Sampler.processing is None).

The penalties need each sequence's token counts on the device. They live in slots [slots, V]
(allocated on first use, grown by doubling), written from the host tokens when a sequence first
samples with a slot, then kept by the device itself: each step adds its sampled tokens (which
the host may not know yet: the engine launches a step before it reads the last one back).
"""

from __future__ import annotations

import dataclasses

import torch

from pagedkv.runtime.fast_processors import apply_min_p


@dataclasses.dataclass(slots=True)
class PenaltyRow:
    row: int  # the sampler row
    key: int  # the sequence (its slot is kept while later steps name the same key)
    token_ids: list[int]  # prompt, then the output tokens the host knows
    prompt_len: int
    pending: int  # sampled tokens not on the host yet (already in the slot's counts)
    repetition: float
    presence: float
    frequency: float


class RowProcessing:
    """Set the rows of a step (set_rows), then per sampling call: before_sampling(logits) ->
    processed logits, after_sampling(tokens) -> counts and logprobs."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)  # [slots, V] output counts
        self.in_prompt = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)  # [slots, V]
        self._slots: dict[int, list[int]] = {}  # key -> [slot, output tokens its counts hold]
        self.set_rows([], [], [])

    def clear(self) -> None:
        """Forget every slot (after a fault their counts may hold tokens that were dropped)."""
        self._slots.clear()

    def _tensor(self, values, dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

    def set_rows(self, penalties: list[PenaltyRow], min_p: list[tuple[int, float, float]],
                 logprobs: list[tuple[int, int]]) -> None:
        """The rows of the next sampling calls: penalties; min_p as (row, min_p, temperature) of
        rows that sample (min_p keeps the top token, so greedy rows need none); logprobs as
        (row, k). Slots of keys not named here are freed."""
        self._pen_keys = [p.key for p in penalties]
        self._pen = None
        if penalties:
            slots = self._slots_for(penalties)
            self._pen = (self._tensor([p.row for p in penalties], torch.int64), self._tensor(slots, torch.int64),
                         self._tensor([p.repetition for p in penalties], torch.float32)[:, None],
                         self._tensor([p.presence for p in penalties], torch.float32)[:, None],
                         self._tensor([p.frequency for p in penalties], torch.float32)[:, None])
        else:
            self._slots.clear()
        self._min_p = None
        if min_p:
            self._min_p = tuple(self._tensor(col, dtype) for col, dtype in zip(
                zip(*min_p), (torch.int64, torch.float32, torch.float32)))
        self._lp_rows = self._tensor([r for r, _ in logprobs], torch.int64) if logprobs else None
        self._lp_k = max((k for _, k in logprobs), default=0)
        self.active = bool(penalties or min_p or logprobs)
        self.step_logprobs: torch.Tensor | None = None

    def _slots_for(self, rows: list[PenaltyRow]) -> list[int]:
        """Each row's slot: kept when its counts hold the row's output (those on the host and the
        pending ones), else written from the host tokens."""
        keep = {}
        fresh = []
        for p in rows:
            output = len(p.token_ids) - p.prompt_len + p.pending
            entry = self._slots.get(p.key)
            if entry is not None and entry[1] == output:
                keep[p.key] = entry
            elif p.pending:
                raise RuntimeError(f"pagedkv.LLM: sequence {p.key}'s token counts are behind its "
                                   "tokens while one is pending (a bug)")
            else:
                fresh.append(p)
        used = {entry[0] for entry in keep.values()}
        free = iter(s for s in range(len(self.counts) + len(fresh)) if s not in used)
        for p in fresh:
            keep[p.key] = [next(free), len(p.token_ids) - p.prompt_len]
        self._slots = keep
        if fresh:
            self._write(fresh)
        return [keep[p.key][0] for p in rows]

    def _write(self, fresh: list[PenaltyRow]) -> None:
        need = 1 + max(self._slots[p.key][0] for p in fresh)
        if need > len(self.counts):
            grown = max(need, 2 * len(self.counts))
            self.counts = torch.cat([self.counts, self.counts.new_zeros(grown - len(self.counts), self.vocab_size)])
            self.in_prompt = torch.cat([self.in_prompt,
                                        self.in_prompt.new_zeros(grown - len(self.in_prompt), self.vocab_size)])
        slots = [self._slots[p.key][0] for p in fresh]
        rows = self._tensor(slots, torch.int64)
        self.counts[rows] = 0
        self.in_prompt[rows] = False
        out_slots = [s for s, p in zip(slots, fresh) for _ in range(len(p.token_ids) - p.prompt_len)]
        out_ids = [t for p in fresh for t in p.token_ids[p.prompt_len:]]
        if out_ids:
            self.counts.index_put_((self._tensor(out_slots, torch.int64), self._tensor(out_ids, torch.int64)),
                                   torch.ones(len(out_ids), dtype=torch.int32, device=self.device), accumulate=True)
        in_slots = [s for s, p in zip(slots, fresh) for _ in range(p.prompt_len)]
        in_ids = [t for p in fresh for t in p.token_ids[:p.prompt_len]]
        self.in_prompt[self._tensor(in_slots, torch.int64), self._tensor(in_ids, torch.int64)] = True

    def before_sampling(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [n, V] -> [n, V] float32 with the penalties and min_p applied to their rows (a
        copy: the runner's output is never written). Logprob rows are read first: raw."""
        if self._lp_rows is not None:
            self._logprobs = torch.log_softmax(logits[self._lp_rows].float(), dim=-1)  # [m, V]
        if self._pen is None and self._min_p is None:
            return logits
        raw = logits
        logits = logits.float()
        if logits is raw:
            logits = logits.clone()
        if self._pen is not None:
            rows, slots, repetition, presence, frequency = self._pen
            x = logits[rows]  # [m, V]
            counts = self.counts[slots]  # [m, V]
            in_output = counts > 0
            seen = in_output | self.in_prompt[slots]
            x = torch.where(seen, torch.where(x < 0, x * repetition, x / repetition), x)
            logits[rows] = x - frequency * counts - presence * in_output
        if self._min_p is not None:
            rows, min_p, temperature = self._min_p
            x = logits[rows]  # [m, V]
            apply_min_p(x, temperature, min_p)
            logits[rows] = x
        return logits

    def after_sampling(self, tokens: torch.Tensor) -> None:
        """tokens [n] int64 (-1 for a row without a distribution): counted into the penalty slots;
        the logprob rows' table becomes step_logprobs [m, 3 + 2k] float64: (token, its logprob,
        its rank, k top ids, k top logprobs)."""
        if self._pen is not None:
            rows, slots = self._pen[:2]
            sampled = tokens[rows].clamp(min=0)
            self.counts.index_put_((slots, sampled), torch.ones_like(sampled, dtype=torch.int32), accumulate=True)
            for key in self._pen_keys:
                self._slots[key][1] += 1
        if self._lp_rows is not None:
            logprobs = self._logprobs
            sampled = tokens[self._lp_rows].clamp(min=0)[:, None]  # [m, 1]
            chosen = logprobs.gather(1, sampled)  # [m, 1]
            rank = (logprobs >= chosen).sum(dim=1, keepdim=True)  # vLLM's rank: 1 + tokens above
            top, top_ids = logprobs.topk(self._lp_k, dim=-1)  # [m, k]
            self.step_logprobs = torch.cat([t.double() for t in (sampled, chosen, rank, top_ids, top)], dim=1)
