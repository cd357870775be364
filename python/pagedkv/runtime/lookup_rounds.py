"""Prompt lookup with every round on the device: generate()'s path for prompt_lookup_num_tokens,
greedy or sampled. Draft models with a constant k share steps 2-4 and the host loop here
(runtime/draft_rounds.py); their "heuristic" schedules take runtime/prompt_lookup.py's rounds,
which read each round's tokens back to the host.

A round is one fixed sequence of device work, replayed as one CUDA graph on CUDA:
  1. ops.lookup_propose: each live row's feed of `width` tokens (its last token, up to k tokens
     that followed the first earlier occurrence of its last n tokens, filler) and the metadata of
     one decode row per fed token (positions, slots, context = position + 1);
  2. the model's forward over those rows (each token attends to its row's cache up to itself:
     runner.tokens_as_decode_rows' layout, the block tables expanded once per call);
  3. the decode step's token at every position: greedy, argmax (what the decode step's Sampler
     takes; with min_new_tokens the Sampler itself, EOS suppression counted per position); sampled,
     the Sampler's draw with the row's seed at offset = the index of the token drawn there, which
     is exactly what a decode step draws for that token given the same tokens before it;
  4. ops.lookup_accept: the longest agreeing prefix of the proposal plus the next token appended
     to the row's history, cut at EOS and max_new_tokens; done rows stop.
The tokens are therefore those of non-speculative greedy decoding, or with do_sample=True those of
non-speculative sampling with the same seeds (the same draws up to the logits' rounding). Drawing
x_j from p_j at every position and accepting the proposal while x_j = d_{j+1} is the standard
speculative-sampling rule for a point-mass draft (runtime/speculative_sampling.py) itself: d_{j+1}
is accepted with probability p_j(d_{j+1}); at the first rejection x_j is p_j's draw given x_j !=
d_{j+1}, i.e. from the residual (p_j without d_{j+1}, renormalised); with all m accepted, x_m is the
bonus token from p_m; positions after the first rejection are not looked at. The draws are
counter-based (ops.sample: seed, offset), so a captured round needs no generator state, and a seed
drawn from torch's global RNG per row reproduces a call (torch.manual_seed), captured or not.
A sampled row whose drawn position has NaN/inf logits gets ops.sample's -1: the round marks it
bad and done, and the host raises on reading the flags back. Rejected positions' K/V stay
in the reserved slots and are written again by the next round before anything reads them (a
round starts at the row's last emitted token; attention reads up to each token's own position).

The host only replays rounds and reads back each round's done flags, one round behind (the device
always has the next round queued): when every row is done it stops, so at most one round past the
end runs (all rows done: it writes nothing). Every row's blocks are reserved up front, as for
generate()'s decode steps.
"""

from __future__ import annotations

import dataclasses
import itertools
import os

import torch

from pagedkv import ops
from pagedkv.layers.attention import ForwardMetadata
from pagedkv.models.fallback import FallbackWeights
from pagedkv.runtime.graph_branches import branches_supported
from pagedkv.runtime.prompt_lookup import LookupSettings, LookupStats, prefill_rows
from pagedkv.runtime.runner import ModelRunner, bucket, capture_step
from pagedkv.runtime.sampler import Sampler
from pagedkv.runtime.speculative_sampling import nan_logits_error


BRANCHES_SWITCH = "PAGEDKV_LOOKUP_BRANCHES"


@dataclasses.dataclass(frozen=True, slots=True)
class RoundKey:
    """What a captured round bakes in besides its buffers."""

    rows: int  # the batch bucket
    width: int  # fed tokens a row and round
    max_blocks: int  # block-table width; history holds max_blocks * block_size tokens
    k: int
    max_ngram: int
    min_new: int
    eos_ids: tuple[int, ...]
    do_sample: bool  # temperature, top-k and top-p are the sampler's buffers, filled per call
    draft_blocks: int = 0  # the draft's block-table width (runtime/draft_rounds.py); 0: n-gram lookup


class RoundState:
    """The device buffers one captured round reads and writes (R rows, W = width, L history)."""

    def __init__(self, key: RoundKey, block_size: int, device: torch.device):
        rows, width, length = key.rows, key.width, key.max_blocks * block_size
        i32, i64 = dict(dtype=torch.int32, device=device), dict(dtype=torch.int64, device=device)
        self.history = torch.zeros(rows, length, **i64)  # [R, L]: prompt, then emitted tokens
        self.lengths = torch.zeros(rows, **i64)  # [R]: tokens in history
        self.generated = torch.zeros(rows, **i64)  # [R]: emitted tokens
        self.max_new = torch.zeros(rows, **i64)  # [R]: the call's max_new_tokens
        self.done = torch.ones(rows, dtype=torch.bool, device=device)  # [R]: padding rows stay done
        self.bad = torch.zeros(rows, dtype=torch.bool, device=device)  # [R]: drew from NaN/inf logits
        self.stats = torch.zeros(rows, 3, **i64)  # [R, 3]: rounds, proposed, accepted
        self.block_tables = torch.zeros(rows, key.max_blocks, **i32)  # [R, MB]
        self.token_tables = torch.zeros(rows * width, key.max_blocks, **i32)  # [R * W, MB]: a row's per token
        self.feed = torch.zeros(rows, width, **i64)  # [R, W]
        self.proposal_lens = torch.zeros(rows, **i64)  # [R]
        self.positions = torch.zeros(rows * width, **i32)  # [R * W]
        self.slot_mapping = torch.full((rows * width,), -1, **i32)  # [R * W]
        self.context_lens = torch.zeros(rows * width, **i32)  # [R * W]
        self.steps = torch.arange(width, **i64)  # [W]: 0 .. W - 1
        self.eos_ids = torch.tensor(key.eos_ids, **i64)  # [E]
        self.decoded = torch.zeros(rows, width, **i64)  # [R, W]: a decode branch's tokens in column 0
        self.any_proposal = torch.zeros((), dtype=torch.bool, device=device)  # a branched round's flag

    def start(self, prompts: list[list[int]], first: list[int], tables: list[list[int]],
              max_new: int, eos_ids: tuple[int, ...]) -> None:
        """Rows after their prefill: history = prompt + its first token (fed by the first round).
        Written in place (a captured round reads these buffers)."""
        batch, length = len(prompts), self.history.shape[1]
        history = torch.zeros(batch, length, dtype=torch.int64)
        table = torch.zeros(batch, self.block_tables.shape[1], dtype=torch.int32)
        for b, (prompt, token, blocks) in enumerate(zip(prompts, first, tables)):
            history[b, :len(prompt) + 1] = torch.tensor(prompt + [token])
            table[b, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        self.history.zero_()
        self.history[:batch].copy_(history)
        self.block_tables.zero_()
        self.block_tables[:batch].copy_(table)
        width = self.feed.shape[1]
        self.token_tables.copy_(self.block_tables.repeat_interleave(width, dim=0))
        self.lengths.zero_()
        self.lengths[:batch].copy_(torch.tensor([len(p) + 1 for p in prompts]))
        self.generated.zero_()
        self.generated[:batch].fill_(1)
        self.max_new.fill_(max_new)
        self.done.fill_(True)
        self.done[:batch].copy_(torch.tensor([t in eos_ids or max_new == 1 for t in first]))
        self.bad.zero_()
        self.stats.zero_()

    def metadata(self) -> ForwardMetadata:
        return ForwardMetadata(positions=self.positions, slot_mapping=self.slot_mapping,
                               block_tables=self.token_tables, context_lens=self.context_lens)


class DeviceLookup:
    """generate()'s prompt lookup on one FixedBatch's runner: rounds captured per RoundKey,
    each with its buffers (a graph is replayed only with the buffers it captured)."""

    def __init__(self) -> None:
        # (key, whether the round branches to a decode step) -> (replay, state, sampler)
        self._rounds: dict[tuple[RoundKey, bool], tuple[object, RoundState, Sampler]] = {}

    def clear(self) -> None:
        self._rounds.clear()

    def run(self, runner: ModelRunner, seq_ids: list[int], prompts: list[list[int]],
            settings: LookupSettings, streamer, input_ids: torch.Tensor,
            graphs: bool) -> tuple[torch.Tensor, LookupStats]:
        """The new tokens [B, N] (pad after a row's EOS) and the call's LookupStats. The rows'
        sequences are added here, their generation's slots reserved; the caller frees them
        (prefix_reuse.keep_rows), also on an error."""
        cache, device = runner.cache, runner.device
        k, max_new = settings.prompt_lookup_num_tokens, settings.max_new_tokens
        eos_ids = settings.eos_token_ids
        batch = len(seq_ids)
        logits = prefill_rows(runner, seq_ids, prompts)  # [B, V]
        for sid in seq_ids:
            cache.reserve(sid, max_new)
        tables = [cache.block_table(sid) for sid in seq_ids]
        max_blocks = 1 << (max(map(len, tables)) - 1).bit_length()  # calls of similar lengths share a graph
        # k + 1 tokens a row: one graph per k, so no padding to runtime/prompt_lookup's widths
        key = RoundKey(bucket(batch) if graphs else batch, k + 1, max_blocks, k,
                       settings.max_matching_ngram_size, settings.min_new_tokens, eos_ids, settings.do_sample)
        replay, state, sampler = self._round(runner, key, graphs)
        first = first_tokens(sampler, logits, settings, key.width)  # one read-back
        state.start(prompts, first, tables, max_new, eos_ids)
        replay_rounds(replay, state, batch, device, streamer, input_ids, prompts, settings.pad_token_id,
                      settings.do_sample)
        return round_outputs(state, prompts, settings.pad_token_id)

    def _round(self, runner: ModelRunner, key: RoundKey, graphs: bool):
        """(replay, state, sampler) for key; replay() runs one round on the device."""
        branched = graphs and branched_rounds_wanted(key, runner.device, not isinstance(runner.model.weights, FallbackWeights))
        held = self._rounds.get((key, branched)) if graphs else None
        if held is not None:
            return held
        block_size = runner.cache.block_size
        state = RoundState(key, block_size, runner.device)
        sampler = round_sampler(key, runner.device)

        def propose() -> None:
            ops.lookup_propose(state.history, state.lengths, state.generated, state.done,
                               state.block_tables, state.feed, state.proposal_lens, state.positions,
                               state.slot_mapping, state.context_lens, state.max_new, key.k,
                               key.max_ngram, block_size)

        def one_round() -> None:
            propose()
            verify_and_accept(runner, state, sampler, key)

        def propose_and_flag() -> None:  # a branched round's head: does any row propose?
            propose()
            state.any_proposal.copy_((state.proposal_lens > 0).any())

        if not graphs:
            return one_round, state, sampler
        # Captured with every row done (the state's start): the warm-up run writes no K/V and
        # changes no row, only scratch buffers (a branched round's warm-up runs both branches).
        if branched:  # a round where no row proposes runs as a decode step
            captured = runner.graphs.capture_branched(
                ("lookup", key, True), propose_and_flag, lambda: verify_and_accept(runner, state, sampler, key),
                lambda: decode_and_accept(runner, state, key), state.any_proposal)
        else:
            captured = capture_step(runner, ("lookup", key, False), one_round)
        if captured is None:  # a fallback model's step that cannot be captured: eager
            return one_round, state, sampler
        self._rounds[key, branched] = (captured.replay, state, sampler)
        return captured.replay, state, sampler


def round_sampler(key: RoundKey, device: torch.device) -> Sampler:
    """The sampler of a round's R * W positions; the call's values come in first_tokens."""
    sampler = Sampler(key.rows * key.width, device, min_new_tokens=key.min_new, eos_token_ids=key.eos_ids)
    sampler.fill(1.0 if key.do_sample else 0.0, 0, 1.0)
    return sampler


def verify_and_accept(runner: ModelRunner, state: RoundState, sampler: Sampler, key: RoundKey) -> None:
    """Steps 2-4 of a round, after state.feed, proposal_lens and the fed rows' metadata were
    written: the target's forward, its token at every position, and ops.lookup_accept. Device
    ops only (captured into the round's graph)."""
    logits = runner.decoder.forward(state.feed.view(-1), state.metadata())  # [R * W, V]
    if key.do_sample or sampler.min_new_tokens > 0:  # min_new_tokens' EOS suppression is counted per position
        before = (state.generated.unsqueeze(1) + state.steps).view(-1)  # [R * W]: tokens emitted before each
        if key.do_sample:  # each position draws with its token's index, as that decode step would
            sampler.offsets.copy_(before)
        tokens = sampler(logits, before.int())  # [R * W]; sampled, -1 where NaN/inf logits
    else:  # the sampler's greedy token is exactly argmax; one reduction instead of its passes
        tokens = logits.argmax(-1)  # [R * W]
    accept(state, tokens)
    if key.do_sample:  # a -1 drawn is only ever emitted last (a proposal token is >= 0)
        last = state.history.gather(1, (state.lengths - 1).clamp(min=0).unsqueeze(1))  # [R, 1]
        state.bad.logical_or_(last.squeeze(1) < 0)
        state.done.logical_or_(state.bad)  # never fed: the host raises on the flag


def branched_rounds_wanted(key: RoundKey, device: torch.device, native: bool = True) -> bool:
    """Whether captured rounds branch to a decode step when no row proposes: CUDA, a build and
    torch that can (graph_branches.branches_supported), a native model (a fallback model's HF
    modules may not capture), greedy without min_new_tokens (the decode branch takes argmax;
    sampled rounds draw per position through the round's sampler), not switched off with
    PAGEDKV_LOOKUP_BRANCHES=0 (read per capture: benchmarks/bench_prompt_lookup.py's A/B)."""
    return (device.type == "cuda" and native and branches_supported() and not key.do_sample
            and key.min_new == 0 and os.environ.get(BRANCHES_SWITCH, "1") != "0")


def decode_and_accept(runner: ModelRunner, state: RoundState, key: RoundKey) -> None:
    """Steps 2-4 of a round in which no row proposed (every proposal_lens 0): each row's fed
    token alone, as a decode step runs it (its slot, position and context are column 0 of the
    round's metadata), its argmax put where ops.lookup_accept reads a row's first token (it reads
    nothing else of a row that proposed nothing). Device ops only."""
    first = slice(0, None, key.width)  # fed slot 0 of each row in the [R * W] buffers
    meta = ForwardMetadata(positions=state.positions[first].contiguous(),
                           slot_mapping=state.slot_mapping[first].contiguous(),
                           block_tables=state.block_tables, context_lens=state.context_lens[first].contiguous())
    logits = runner.decoder.forward(state.feed[:, 0].contiguous(), meta)  # [R, V]
    state.decoded[:, 0] = logits.argmax(-1)
    accept(state, state.decoded.view(-1))


def accept(state: RoundState, tokens: torch.Tensor) -> None:
    """ops.lookup_accept of the round's state, given the model's token at each fed position
    (tokens [R * W])."""
    ops.lookup_accept(tokens, state.feed, state.proposal_lens, state.eos_ids, state.history,
                      state.lengths, state.generated, state.done, state.stats, state.max_new)


def first_tokens(sampler: Sampler, logits: torch.Tensor, settings: LookupSettings, width: int) -> list[int]:
    """The prompts' next tokens (logits [B, V]) as a decode step takes them, the call's sampling
    settings filled in. Sampled: each row's seed drawn from torch's global RNG, as the decode
    path draws its rows' (torch.manual_seed reproduces a call), then laid out over the row's
    `width` positions for the rounds; NaN/inf logits raise."""
    batch = logits.shape[0]
    sampler.fill(settings.temperature if settings.do_sample else 0.0, settings.top_k, settings.top_p)
    zero = torch.zeros(batch, dtype=torch.int32, device=logits.device)  # [B]: tokens emitted so far
    if not settings.do_sample:
        return sampler(logits, zero).tolist()
    seeds = torch.randint(0, 2**62, (batch,))  # [B]
    sampler.seeds[:batch].copy_(seeds)
    sampler.offsets[:batch].zero_()  # the first token's index
    first = sampler(logits, zero).tolist()
    if min(first) < 0:  # ops.sample's -1: no distribution
        raise nan_logits_error([b for b, t in enumerate(first) if t < 0], "the batch")
    sampler.seeds.zero_()
    sampler.seeds[:batch * width].copy_(seeds.repeat_interleave(width))  # [B * W]: row b's at b * W ..
    return first


def replay_rounds(replay, state: RoundState, batch: int, device: torch.device, streamer,
                  input_ids: torch.Tensor, prompts: list[list[int]], pad: int | None, sampled: bool) -> None:
    """Replays rounds until every row is done, reading each round's done flags back one round
    behind (the only host sync; with a streamer, the rows' tokens too; sampled, the bad flags:
    raised on at once)."""
    cuda = device.type == "cuda"
    slots = [_Readback(batch, state.history.shape[1], cuda, streamer is not None, sampled) for _ in range(2)]
    stream = _Stream(streamer, input_ids, prompts, pad)
    try:  # the streamer gets end() however the loop ends, so that its reader is released
        for launched in itertools.count():
            if launched == 0 and bool(state.done[:batch].all()):
                break
            replay()
            slots[launched % 2].take(state, batch)
            if launched == 0:
                continue
            previous = slots[(launched - 1) % 2]  # the round before: the device runs this one meanwhile
            previous.wait()
            previous.raise_if_bad()
            stream.send(previous)
            if bool(previous.done.all()):
                break
        if streamer is not None:  # what the last rounds emitted
            if cuda:
                torch.cuda.current_stream().synchronize()
            last = _Readback(batch, state.history.shape[1], False, True, False)
            last.take(state, batch)
            stream.send(last)
    finally:
        if cuda:
            torch.cuda.current_stream().synchronize()  # no round left writing the cache
        if streamer is not None:
            streamer.end()


class _Readback:
    """Host copies of one round's done flags (and, for a streamer, emitted counts and histories),
    pinned on CUDA, and the event after them."""

    def __init__(self, batch: int, length: int, cuda: bool, tokens: bool, sampled: bool):
        self.done = torch.empty(batch, dtype=torch.bool, pin_memory=cuda)  # [B]
        self.bad = torch.empty(batch, dtype=torch.bool, pin_memory=cuda) if sampled else None  # [B]
        self.generated = torch.empty(batch, dtype=torch.int64, pin_memory=cuda) if tokens else None  # [B]
        self.history = torch.empty(batch, length, dtype=torch.int64, pin_memory=cuda) if tokens else None  # [B, L]
        self.event = torch.cuda.Event() if cuda else None

    def take(self, state: RoundState, batch: int) -> None:
        """Queue the copies behind the rounds launched so far."""
        cuda = self.event is not None
        self.done.copy_(state.done[:batch], non_blocking=cuda)
        if self.bad is not None:
            self.bad.copy_(state.bad[:batch], non_blocking=cuda)
        if self.history is not None:
            self.generated.copy_(state.generated[:batch], non_blocking=cuda)
            self.history.copy_(state.history[:batch], non_blocking=cuda)
        if cuda:
            self.event.record()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def raise_if_bad(self) -> None:
        """After wait(): a row that drew from NaN/inf logits raises (its history ends in -1)."""
        if self.bad is not None and bool(self.bad.any()):
            raise nan_logits_error(self.bad.nonzero().flatten().tolist(), "the batch")


def round_outputs(state: RoundState, prompts: list[list[int]], pad: int | None) -> tuple[torch.Tensor, LookupStats]:
    """The rows' new tokens [B, N] (N = the longest row's; pad after a shorter row's end) and
    the call's stats, from the state after its last round."""
    batch = len(prompts)
    generated = state.generated[:batch].tolist()
    width = max(generated)
    history = state.history[:batch].cpu()
    filler = 0 if pad is None else pad  # pad is None only without EOS ids: every row is full
    out = torch.full((batch, width), filler, dtype=torch.int64)
    for b, (prompt, n) in enumerate(zip(prompts, generated)):
        out[b, :n] = history[b, len(prompt):len(prompt) + n]
    rounds, proposed, accepted = state.stats[:batch].cpu().unbind(1)
    stats = LookupStats(int(rounds.max()), int(proposed.sum()), int(accepted.sum()))
    return out.to(state.history.device), stats


class _Stream:
    """A streamer gets what a decode step gives it: the prompts, then one column of the batch's
    tokens per new token (pad for rows already finished), each as soon as every row has it."""

    def __init__(self, streamer, input_ids: torch.Tensor, prompts: list[list[int]], pad: int | None):
        self.streamer, self.prompts, self.pad, self.sent = streamer, prompts, pad, 0
        if streamer is not None:
            streamer.put(input_ids.cpu())

    def send(self, copy: _Readback) -> None:
        if self.streamer is None:
            return
        counts, done = copy.generated.tolist(), copy.done.tolist()
        while self.sent < max(counts) and all(c > self.sent or d for c, d in zip(counts, done)):
            self.streamer.put(torch.tensor([int(copy.history[b, len(p) + self.sent]) if counts[b] > self.sent
                                            else self.pad for b, p in enumerate(self.prompts)]))
            self.sent += 1
