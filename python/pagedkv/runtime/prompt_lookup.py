"""Prompt-lookup speculative decoding for generate()'s fixed batch (HF's
``prompt_lookup_num_tokens`` / ``max_matching_ngram_size``): several tokens per forward where a
row repeats text it already holds, with the tokens of non-speculative greedy decoding, or with
do_sample=True the distribution of non-speculative sampling (runtime/speculative_sampling.py:
the acceptance rule for a point-mass draft, not the same draws).

Each round, every unfinished row proposes up to k tokens (``propose``: the tokens that followed
the first earlier occurrence of its last n..1 tokens, as HF's PromptLookupCandidateGenerator),
never more than its remaining max_new_tokens allow, and one step of the runner computes its last
token and the proposal together (k_i + 1 query tokens over the paged cache, prefill attention). The greedy
token at each position is taken exactly as the sampler takes it in a decode step (min_new_tokens'
EOS suppression counted per position); the longest prefix of the proposal equal to them is
accepted and the row emits it plus the next greedy token (sampling: each proposed token is
accepted with its target probability, the next token drawn from the residual or the last
target). The rejected tokens' slots are given back (KVCache.truncate), so the cache holds
exactly the row's fed tokens. EOS and max_new_tokens end a row inside a round as they end it
in a decode step. One host read-back per round; on CUDA each round's step is padded to one
width a row and replayed as a CUDA graph (runner.run_rows_of). generate() runs these rounds for
draft models (runtime/draft_model.py); its n-gram lookup, greedy or sampled, keeps every round on
the device (runtime/lookup_rounds.py).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Callable, Protocol, Sequence

import torch

from pagedkv.runtime.decode_read_back import StopSettings
from pagedkv.runtime.model import PreparedModel
from pagedkv.runtime.runner import ModelRunner, StepInput, bucket, graph_steps, to_device
from pagedkv.runtime.sampler import Sampler
from pagedkv.runtime.speculative_sampling import SpeculativeSampler

# (logits [T, V] of the fed positions, each row's proposal, new tokens before each position [T])
# -> (tokens of each row's proposal accepted, each row's next token): one host read-back
Verifier = Callable[[torch.Tensor, list[list[int]], list[int]], tuple[list[int], list[int]]]


class LookupSettings(StopSettings, Protocol):
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
    def temperature(self) -> float: ...
    @property
    def top_k(self) -> int: ...
    @property
    def top_p(self) -> float: ...


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


class Proposer(Protocol):
    """Where a round's proposals come from: the n-gram lookup here, a draft model
    (runtime/draft_model.py). Rows are indices into the batch, out[i] row i's new tokens so far."""

    max_tokens: int  # the most tokens one proposal holds
    runners: tuple[ModelRunner, ...]  # the runners whose steps it runs (graphs or not, per call)

    def propose(self, rows: list[int], out: list[list[int]], caps: list[int]) -> list[list[int]]:
        """Each row's proposal: at most caps[j] tokens (its remaining max_new_tokens - 1)."""
    def accepted(self, rows: list[int], counts: list[int]) -> None:
        """After the round's verification: how many leading tokens of each proposal were kept."""


class NgramIndex:
    """`propose` over a growing token list without scanning it: the first start of every n-gram
    (n <= max_ngram) seen, extended as tokens come. A round's lookup is then a few dict reads
    (a scan of a 700-token row costs ~0.1 ms of host time a round, most of what a round of a
    small model may spend on the host)."""

    def __init__(self, max_ngram: int):
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self.first: dict[tuple[int, ...], int] = {}

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self.tokens.append(token)
            end = len(self.tokens)
            for n in range(1, min(self.max_ngram, end) + 1):
                self.first.setdefault(tuple(self.tokens[end - n:]), end - n)

    def propose(self, k: int) -> list[int]:
        """propose(self.tokens, k, max_ngram): the first occurrence of the last n tokens is an
        earlier one iff it starts before the tail itself."""
        tokens, length = self.tokens, len(self.tokens)
        for n in range(min(self.max_ngram, length - 1), 0, -1):
            start = self.first[tuple(tokens[length - n:])]
            if start < length - n:
                return tokens[start + n:start + n + k]
        return []


class NgramProposer:
    """HF's prompt lookup: `propose` over each row's prompt and new tokens (an NgramIndex a row)."""

    runners = ()

    def __init__(self, prompts: list[list[int]], k: int, max_ngram: int):
        self.prompts, self.max_tokens, self.max_ngram = prompts, k, max_ngram
        self.indexes: list[NgramIndex | None] = [None] * len(prompts)  # built at a row's first round
        self.indexed = [0] * len(prompts)  # new tokens of each row in its index

    def propose(self, rows: list[int], out: list[list[int]], caps: list[int]) -> list[list[int]]:
        proposals = []
        for i, cap in zip(rows, caps):
            index = self.indexes[i]
            if index is None:
                index = self.indexes[i] = NgramIndex(self.max_ngram)
                index.extend(self.prompts[i])
            index.extend(out[i][self.indexed[i]:])
            self.indexed[i] = len(out[i])
            proposals.append(index.propose(min(self.max_tokens, cap)))
        return proposals

    def accepted(self, rows: list[int], counts: list[int]) -> None:
        pass


# Query widths a verification step is padded to when it runs as a CUDA graph (one graph per batch
# bucket and width, captured at its first use); wider feeds take their own width. Dense up to 8:
# a batch-1 step of up to 8 tokens stays on the decode GEMV (ops.linear's 1-8 row kernels).
VERIFY_WIDTHS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32)


def verification_width(longest_feed: int) -> int:
    """The padded width of a verification step whose longest row feeds `longest_feed` tokens."""
    return next((w for w in VERIFY_WIDTHS if w >= longest_feed), longest_feed)


def lookup_room(k: int, batch: int) -> tuple[int, int]:
    """(extra cache slots a row needs, tokens a step needs) for verification steps of up to k
    proposed tokens a row, padded (run_rows_of): a row fed its last token and k proposals is
    padded to verification_width(k + 1), which may run past its max_new_tokens by the padding;
    the padding rows of the batch bucket take that width too."""
    if not k:
        return 0, 0
    width = verification_width(k + 1)
    return width - 1, bucket(batch) * width


def check_lookup(model: PreparedModel) -> None:
    """Refuse what prompt lookup does not run with yet."""
    if model.rope is not None or model.tp is not None:
        raise ValueError("pagedkv.generate: prompt_lookup_num_tokens is not supported yet "
                         + ("with a length-dependent rope" if model.rope is not None else
                            "under tensor parallelism") + "; generate without it")


def run_prompt_lookup(runner: ModelRunner, seq_ids: list[int], prompts: list[list[int]],
                      settings: LookupSettings, streamer, input_ids: torch.Tensor,
                      proposer: Proposer | None = None, graphs: bool = False) -> tuple[torch.Tensor, LookupStats]:
    """The new tokens [B, N] (pad after a row's EOS, N <= max_new_tokens) of greedy decoding or
    sampling, and the call's LookupStats. input_ids [B, S]: the call's (for the streamer). The rows'
    sequences are added here and freed before returning (their full blocks stay in the prefix
    cache); on an error the caller frees them. graphs: the call's use_cuda_graphs resolved
    (runner.cuda_graphs_wanted): verification steps and a draft's decode steps replay as graphs."""
    proposer = proposer or NgramProposer(prompts, settings.prompt_lookup_num_tokens,
                                         settings.max_matching_ngram_size)
    with graph_steps((runner, *proposer.runners), graphs):
        return _run_rounds(runner, seq_ids, prompts, settings, streamer, input_ids, proposer)


def prefill_rows(runner: ModelRunner, seq_ids: list[int], prompts: list[list[int]]) -> torch.Tensor:
    """Add the rows' sequences to the cache and run their prompts (past any prefix-cache hit) as
    one step: the logits [B, V] of each prompt's last token."""
    cached = [runner.cache.add_sequence(sid, p) for sid, p in zip(seq_ids, prompts)]
    query = [len(p) - c for p, c in zip(prompts, cached)]  # [B]
    last = list(itertools.accumulate(query, initial=-1))[1:]
    tokens = list(itertools.chain.from_iterable(p[c:] for p, c in zip(prompts, cached)))
    return runner.run(StepInput(seq_ids, tokens, query, last))


def _run_rounds(runner: ModelRunner, seq_ids: list[int], prompts: list[list[int]], settings: LookupSettings,
                streamer, input_ids: torch.Tensor, proposer: Proposer) -> tuple[torch.Tensor, LookupStats]:
    k = proposer.max_tokens
    max_new, min_new = settings.max_new_tokens, settings.min_new_tokens
    eos_ids, pad = settings.eos_token_ids, settings.pad_token_id
    cache, device = runner.cache, runner.device
    batch = len(seq_ids)
    logits = prefill_rows(runner, seq_ids, prompts)  # [B, V]
    verifier: Verifier = (SpeculativeSampler(settings.temperature, settings.top_k, settings.top_p, min_new,
                                             eos_ids, device) if settings.do_sample else
                          _GreedyVerifier(batch * (k + 1), device, min_new, eos_ids))
    out: list[list[int]] = [[t] for t in verifier(logits, [[] for _ in seq_ids], [0] * batch)[1]]
    done = [row[0] in eos_ids or max_new == 1 for row in out]
    stats = LookupStats()
    stream = _Stream(streamer, input_ids, out, done, pad)
    try:  # the streamer gets end() however the loop ends, so that its reader is released
        while not all(done):
            _round(runner, seq_ids, prompts, out, done, verifier, stats, proposer=proposer,
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
           done: list[bool], verifier: Verifier, stats: LookupStats, *, proposer: Proposer,
           max_new: int, eos_ids: tuple[int, ...]) -> None:
    """One verification step of every unfinished row; appends each row's new tokens to out."""
    cache = runner.cache
    batch = len(seq_ids)
    rows = [i for i in range(batch) if not done[i]]
    sizes = [len(out[i]) for i in rows]
    proposals = proposer.propose(rows, out, [max_new - n - 1 for n in sizes])
    feeds = [[out[i][-1]] + p for i, p in zip(rows, proposals)]
    # As a CUDA graph, every row feeds one width: the padding repeats a row's last token, and its
    # positions' logits are not looked at (their slots are given back below with the rejected).
    width = verification_width(max(map(len, feeds))) if runner.verify_graphs else 0
    fed = [f + f[-1:] * (width - len(f)) for f in feeds] if width else feeds
    for i, feed in zip(rows, fed):
        cache.append_tokens(seq_ids[i], feed)
    step = StepInput([seq_ids[i] for i in rows], list(itertools.chain(*fed)), [len(f) for f in fed])
    if width:
        every = runner.run_rows_of(step, width)  # [rows * width, V]
        if len(feeds) == 1:  # one row: its real positions lead (no index to copy, no kernel)
            logits = every[:len(feeds[0])]  # [T, V]
        else:
            real = [r * width + j for r, f in enumerate(feeds) for j in range(len(f))]
            logits = every.index_select(0, to_device(real, every.device))  # [T, V]
    else:
        logits = runner.run(step)  # [T, V]
    counts = [len(out[i]) + j for i, f in zip(rows, feeds) for j in range(len(f))]  # [T]
    for i, feed, proposal, accepted, following in zip(rows, fed, proposals, *verifier(logits, proposals, counts)):
        cache.truncate(seq_ids[i], len(feed) - 1 - accepted)
        stats.proposed += len(proposal)
        stats.accepted += accepted
        for token in proposal[:accepted] + [following]:
            out[i].append(token)
            if token in eos_ids or len(out[i]) == max_new:
                done[i] = True
                break
    proposer.accepted(rows, [next((j for j, t in enumerate(p) if out[i][n + j:n + j + 1] != [t]), len(p))
                             for i, p, n in zip(rows, proposals, sizes)])
    stats.rounds += 1


class _GreedyVerifier:
    """The greedy Verifier: the token the sampler takes at each position in a decode step; the
    longest prefix of the proposal equal to them is accepted, the greedy token after it follows."""

    def __init__(self, rows: int, device: torch.device, min_new_tokens: int, eos_ids: tuple[int, ...]):
        self.sampler = Sampler(rows, device, min_new_tokens=min_new_tokens, eos_token_ids=eos_ids)
        self.sampler.fill(0.0, 0, 1.0)
        self.device = device

    def __call__(self, logits: torch.Tensor, proposals: list[list[int]], counts: list[int]
                 ) -> tuple[list[int], list[int]]:
        # counts from pinned memory: a copy from a Python list's pageable memory would wait for the step
        # the counts matter only to min_new_tokens' EOS suppression
        generated = to_device(counts, self.device).int() if self.sampler.min_new_tokens > 0 else None
        greedy = self.sampler(logits, generated).tolist()
        accepted, following, start = [], [], 0
        for proposal in proposals:
            best = greedy[start:start + len(proposal) + 1]
            start += len(proposal) + 1
            accepted.append(next((j for j, t in enumerate(proposal) if t != best[j]), len(proposal)))
            following.append(best[accepted[-1]])
        return accepted, following


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
