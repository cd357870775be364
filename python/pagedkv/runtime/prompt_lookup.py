"""Greedy prompt-lookup speculative decoding for generate()'s fixed batch (HF's
``prompt_lookup_num_tokens`` / ``max_matching_ngram_size``): several tokens per forward where a
row repeats text it already holds, with the tokens of non-speculative greedy decoding.

Each round, every unfinished row proposes up to k tokens (``propose``: the tokens that followed
the first earlier occurrence of its last n..1 tokens, as HF's PromptLookupCandidateGenerator),
never more than its remaining max_new_tokens allow, and one step of the runner computes its last
token and the proposal together (k_i + 1 query tokens over the paged cache, prefill attention). The greedy
token at each position is taken exactly as the sampler takes it in a decode step (min_new_tokens'
EOS suppression counted per position); the longest prefix of the proposal equal to them is
accepted and the row emits it plus the next greedy token. The rejected tokens' slots are given
back (KVCache.truncate), so the cache holds exactly the row's fed tokens. EOS and max_new_tokens
end a row inside a round as they end it in a decode step. Steps run eagerly, one host read-back
per round.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Protocol, Sequence

import torch

from pagedkv.runtime.model import PreparedModel
from pagedkv.runtime.runner import ModelRunner, StepInput
from pagedkv.runtime.sampler import Sampler


class LookupSettings(Protocol):
    """What this module reads of fixed_batch.GenerationSettings (that module imports this one)."""

    @property
    def prompt_lookup_num_tokens(self) -> int: ...
    @property
    def max_matching_ngram_size(self) -> int: ...
    @property
    def max_new_tokens(self) -> int: ...
    @property
    def min_new_tokens(self) -> int: ...
    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...
    @property
    def pad_token_id(self) -> int | None: ...


@dataclasses.dataclass(slots=True)
class LookupStats:
    """One call's speculation: verification rounds, tokens proposed and accepted (all rows)."""

    rounds: int = 0
    proposed: int = 0
    accepted: int = 0


def propose(tokens: Sequence[int], k: int, max_ngram: int) -> list[int]:
    """Up to k tokens that followed the first earlier occurrence of the row's last n tokens, for
    n = max_ngram .. 1 (the first n with a match wins); [] when none matches. HF's
    PromptLookupCandidateGenerator for one row, without its EOS crop: a proposal running through
    EOS is verified like any other and the row ends at the EOS."""
    length = len(tokens)
    for n in range(min(max_ngram, length - 1), 0, -1):
        tail = list(tokens[length - n:])
        for start in range(length - n):  # a match at the tail itself has nothing after it
            if list(tokens[start:start + n]) == tail:
                return list(tokens[start + n:start + n + k])
    return []


def check_lookup(model: PreparedModel) -> None:
    """Refuse what prompt lookup does not run with yet."""
    if model.rope is not None or model.tp is not None:
        raise ValueError("pagedkv.generate: prompt_lookup_num_tokens is not supported yet "
                         + ("with a length-dependent rope" if model.rope is not None else
                            "under tensor parallelism") + "; generate without it")


def run_prompt_lookup(runner: ModelRunner, seq_ids: list[int], prompts: list[list[int]],
                      settings: LookupSettings, streamer, input_ids: torch.Tensor
                      ) -> tuple[torch.Tensor, LookupStats]:
    """The new tokens [B, N] (pad after a row's EOS, N <= max_new_tokens) of greedy decoding,
    and the call's LookupStats. input_ids [B, S]: the call's (for the streamer). The rows'
    sequences are added here and freed before returning (their full blocks stay in the prefix
    cache); on an error the caller frees them."""
    k, max_ngram = settings.prompt_lookup_num_tokens, settings.max_matching_ngram_size
    max_new, min_new = settings.max_new_tokens, settings.min_new_tokens
    eos_ids, pad = settings.eos_token_ids, settings.pad_token_id
    cache, device = runner.cache, runner.device
    batch = len(seq_ids)
    cached = [cache.add_sequence(sid, p) for sid, p in zip(seq_ids, prompts)]
    query = [len(p) - c for p, c in zip(prompts, cached)]  # [B]
    last = list(itertools.accumulate(query, initial=-1))[1:]
    tokens = list(itertools.chain.from_iterable(p[c:] for p, c in zip(prompts, cached)))
    logits = runner.run(StepInput(seq_ids, tokens, query, last))  # [B, V]
    sampler = Sampler(batch * (k + 1), device, min_new_tokens=min_new, eos_token_ids=eos_ids)
    sampler.fill(0.0, 0, 1.0)
    generated = torch.zeros(batch, dtype=torch.int32, device=device)
    out: list[list[int]] = [[t] for t in sampler(logits, generated).tolist()]
    done = [row[0] in eos_ids or max_new == 1 for row in out]
    stats = LookupStats()
    stream = _Stream(streamer, input_ids, out, done, pad)
    try:  # the streamer gets end() however the loop ends, so that its reader is released
        while not all(done):
            _round(runner, seq_ids, prompts, out, done, sampler, stats, k=k, max_ngram=max_ngram,
                   max_new=max_new, eos_ids=eos_ids)
            stream.flush()
    finally:
        stream.close()
    for sid in seq_ids:
        cache.free(sid)
    width = max(map(len, out))
    filler = 0 if pad is None else pad  # pad is None only without EOS ids: every row is full
    return torch.tensor([row + [filler] * (width - len(row)) for row in out], device=device), stats


def _round(runner: ModelRunner, seq_ids: list[int], prompts: list[list[int]], out: list[list[int]],
           done: list[bool], sampler: Sampler, stats: LookupStats, *, k: int, max_ngram: int,
           max_new: int, eos_ids: tuple[int, ...]) -> None:
    """One verification step of every unfinished row; appends each row's new tokens to out."""
    cache, device = runner.cache, runner.device
    batch = len(seq_ids)
    rows = [i for i in range(batch) if not done[i]]
    proposals = [propose(prompts[i] + out[i], min(k, max_new - len(out[i]) - 1), max_ngram)
                 for i in rows]
    feeds = [[out[i][-1]] + p for i, p in zip(rows, proposals)]
    for i, feed in zip(rows, feeds):
        cache.append_tokens(seq_ids[i], feed)
    logits = runner.run(StepInput([seq_ids[i] for i in rows], list(itertools.chain(*feeds)),
                                  [len(f) for f in feeds]))  # [T, V]
    counts = [len(out[i]) + j for i, f in zip(rows, feeds) for j in range(len(f))]  # [T]
    greedy = sampler(logits, torch.tensor(counts, dtype=torch.int32, device=device)).tolist()
    start = 0
    for i, proposal in zip(rows, proposals):
        best = greedy[start:start + len(proposal) + 1]
        start += len(proposal) + 1
        accepted = next((j for j, t in enumerate(proposal) if t != best[j]), len(proposal))
        cache.truncate(seq_ids[i], len(proposal) - accepted)
        stats.proposed += len(proposal)
        stats.accepted += accepted
        for token in best[:accepted + 1]:
            out[i].append(token)
            if token in eos_ids or len(out[i]) == max_new:
                done[i] = True
                break
    stats.rounds += 1


class _Stream:
    """A streamer gets what a decode step gives it: the prompts, then one column of the batch's
    tokens per new token (pad for finished rows), each as soon as every row has it."""

    def __init__(self, streamer, input_ids: torch.Tensor, out: list[list[int]],
                 done: list[bool], pad: int | None):
        self.streamer, self.out, self.done, self.pad, self.sent = streamer, out, done, pad, 0
        if streamer is not None:
            streamer.put(input_ids.cpu())
        self.flush()

    def flush(self) -> None:
        if self.streamer is None:
            return
        width = max(map(len, self.out))
        while self.sent < width and all(len(r) > self.sent or d for r, d in zip(self.out, self.done)):
            self.streamer.put(torch.tensor([r[self.sent] if len(r) > self.sent else self.pad
                                            for r in self.out]))
            self.sent += 1

    def close(self) -> None:
        if self.streamer is not None:
            self.streamer.end()
