"""A draft model (HF's ``assistant_model``) with every round on the device: generate()'s path for
num_assistant_tokens_schedule="constant", greedy or sampled. The "heuristic" schedules change k
per row and round and keep runtime/prompt_lookup.py's host-read rounds (runtime/draft_model.py).

A round is one fixed sequence of device work, replayed as one CUDA graph on CUDA (the draft's
forwards are captured with the target's, in the target runner's graph pool). A live row holds
history[:L] (prompt and emitted tokens; the last not yet in either cache):
  1. the draft catches up: the row's last two tokens are fed as two decode rows of the draft's
     cache (positions L - 2, L - 1); the argmax at the second is d_1. The older token's K/V is
     there already unless the last round accepted the whole proposal, whose last token the draft
     proposed but never fed; where it is there, writing it again writes the same values;
  2. k - 1 draft decode steps, one row per live row each: d_j at position L - 1 + j gives d_{j+1};
  3. proposal_lens = min(k, max_new - generated - 1), 0 for done rows: ops.lookup_propose's cap
     (csrc/kernels/lookup_round_rule.h proposal_cap, width k + 1);
  4. the target's forward over [last token, d_1 .. d_k] as decode rows, its token at every
     position and ops.lookup_accept: runtime/lookup_rounds.py's verify_and_accept (greedy argmax,
     or with do_sample each position's own decode-step draw, the speculative rule for a
     point-mass draft, which a greedy draft is).
The metadata of every forward is computed on the device from the round's buffers. Only positions
that a later forward reads write K/V: the draft's d_j for j < proposal_lens, the target's
positions up to proposal_lens; the others, and all of a done row's, get slot -1 and context 0
(their outputs are never looked at). The draft proposes k tokens even past an EOS it proposed
(HF's assistant stops there); lookup_accept ends the row at the EOS, so that changes only the
work a round does, never the tokens.

The draft's cache stays right: at a round's start it holds positions < L - 2 of the row's
history. A round writes L - 2 and L - 1, then d_1 .. d_{m-1} (m = proposal_lens); accepting a <= m
of them makes the new history length L' <= L + a + 1, and the draft's positions L .. L + a - 2
hold the accepted tokens, so it holds positions < L' - 2 again (in fact all but the last token
of the history, so the finished rows' full blocks enter its prefix cache as the target's do).

Routing (runtime/fixed_batch.py): every constant-k draft call takes these rounds, on the CPU and
on CUDA; the "heuristic" schedules take the host-read rounds.
"""

from __future__ import annotations

import weakref

import torch

from pagedkv.layers.attention import ForwardMetadata
from pagedkv.runtime.lookup_rounds import (RoundKey, RoundState, first_tokens, replay_rounds, round_outputs,
                                           round_sampler, verify_and_accept)
from pagedkv.runtime.prefix_reuse import keep_rows
from pagedkv.runtime.prompt_lookup import LookupSettings, LookupStats, prefill_rows
from pagedkv.runtime.runner import ModelRunner, bucket, capture_step
from pagedkv.runtime.sampler import Sampler

class DraftState(RoundState):
    """RoundState and the draft's side of a round: its block tables (MBd wide)."""

    def __init__(self, key: RoundKey, block_size: int, device: torch.device):
        super().__init__(key, block_size, device)
        i32, i64 = dict(dtype=torch.int32, device=device), dict(dtype=torch.int64, device=device)
        self.draft_tables = torch.zeros(key.rows, key.draft_blocks, **i32)  # [R, MBd]
        self.pair_tables = torch.zeros(key.rows * 2, key.draft_blocks, **i32)  # [R * 2, MBd]: a row's per token
        self.pair_steps = torch.tensor([-1, 0], **i64)  # [2]: the catch-up tokens' offsets from the last
        self.pair_last = torch.arange(1, 2 * key.rows, 2, **i64)  # [R]: the second of each row's pair

    def start_draft(self, tables: list[list[int]]) -> None:
        """The draft sequences' block tables, in place (a captured round reads the buffers)."""
        table = torch.zeros(len(tables), self.draft_tables.shape[1], dtype=torch.int32)
        for b, blocks in enumerate(tables):
            table[b, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        self.draft_tables.zero_()
        self.draft_tables[:len(tables)].copy_(table)
        self.pair_tables.copy_(self.draft_tables.repeat_interleave(2, dim=0))


def decode_rows(positions: torch.Tensor, writes: torch.Tensor, tables: torch.Tensor,
                block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(positions, slot_mapping, context_lens), each [R * N] int32, of N tokens a row run as decode
    rows: positions [R, N] int64; writes [R, N] bool, the tokens whose K/V are kept (the others
    get position 0, slot -1 and context 0: attention skips them); tables [R, MB] int32."""
    positions = torch.where(writes, positions, 0)  # [R, N]
    block = (positions // block_size).clamp_(max=tables.shape[1] - 1)  # [R, N]
    slots = tables.gather(1, block) * block_size + positions % block_size  # [R, N]
    slots = torch.where(writes, slots, -1)
    context = torch.where(writes, positions + 1, 0)
    return positions.int().view(-1), slots.int().view(-1), context.int().view(-1)


def draft_round(target: ModelRunner, draft: ModelRunner, state: DraftState, sampler: Sampler,
                key: RoundKey) -> None:
    """One round (device ops only: captured as one graph on CUDA)."""
    live = ~state.done  # [R]
    last = (state.lengths - 1).clamp(min=0)  # [R]: each row's last token's position
    room = (state.max_new - state.generated - 1).clamp(0, key.k)  # [R]: lookup_propose's cap
    state.proposal_lens.copy_(torch.where(live, room, 0))
    # 1. the catch-up pair; its second token is the target's first fed one
    pair = (last.unsqueeze(1) + state.pair_steps).clamp(min=0)  # [R, 2]
    # done rows feed 0: a row that drew from NaN/inf logits ends its history with -1
    tokens = torch.where(live.unsqueeze(1), state.history.gather(1, pair), 0)  # [R, 2]
    state.feed[:, 0].copy_(tokens[:, 1])
    draft_size = draft.cache.block_size
    meta = decode_rows(pair, live.unsqueeze(1).expand(-1, 2), state.draft_tables, draft_size)
    logits = draft.decoder.forward(tokens.view(-1), ForwardMetadata(meta[0], meta[1], state.pair_tables, meta[2]),
                                   logits_rows=state.pair_last)  # [R, V]
    state.feed[:, 1].copy_(logits.argmax(-1))
    # 2. d_j fed at L - 1 + j; its K/V kept only where d_{j+1} is proposed
    for j in range(1, key.k):
        writes = (live & (j < state.proposal_lens)).unsqueeze(1)  # [R, 1]
        meta = decode_rows((last + j).unsqueeze(1), writes, state.draft_tables, draft_size)
        fed = state.feed[:, j].contiguous()  # [R]
        logits = draft.decoder.forward(fed, ForwardMetadata(meta[0], meta[1], state.draft_tables, meta[2]))  # [R, V]
        state.feed[:, j + 1].copy_(logits.argmax(-1))
    # 3-4. the target's verification rows, up to each row's proposal
    writes = live.unsqueeze(1) & (state.steps <= state.proposal_lens.unsqueeze(1))  # [R, W]
    meta = decode_rows(last.unsqueeze(1) + state.steps, writes, state.block_tables, target.cache.block_size)
    for buffer, values in zip((state.positions, state.slot_mapping, state.context_lens), meta):
        buffer.copy_(values)
    verify_and_accept(target, state, sampler, key)


class DeviceDraft:
    """generate()'s draft rounds on one FixedBatch's runner: rounds captured per RoundKey, each
    with its buffers and the draft runner whose cache it baked in (replayed only with both)."""

    def __init__(self) -> None:
        self._rounds: dict[RoundKey, tuple[object, DraftState, Sampler, weakref.ref]] = {}

    def clear(self) -> None:
        self._rounds.clear()

    def run(self, runner: ModelRunner, draft: ModelRunner, k: int, seq_ids: list[int],
            prompts: list[list[int]], settings: LookupSettings, streamer, input_ids: torch.Tensor,
            graphs: bool) -> tuple[torch.Tensor, LookupStats]:
        """The new tokens [B, N] (pad after a row's EOS) and the call's LookupStats, k tokens
        proposed a round by `draft` (the draft's runner; its cache holds no sequence). The rows'
        sequences are added to both caches here, their generation's slots reserved; the draft's
        are freed here on success, the target's by the caller; on an error the callers free both."""
        max_new, eos_ids = settings.max_new_tokens, settings.eos_token_ids
        longest = max(map(len, prompts)) + max_new
        if longest > draft.model.max_positions:
            raise ValueError(f"pagedkv.generate: sequences reach {longest} tokens but assistant_model's "
                             f"max_position_embeddings is {draft.model.max_positions}; prompt + "
                             f"max_new_tokens must be <= {draft.model.max_positions}")
        logits = prefill_rows(runner, seq_ids, prompts)  # [B, V]
        prefill_rows(draft, seq_ids, prompts)  # the draft's K/V of the prompts (its logits unused)
        tables = []
        for cache in (runner.cache, draft.cache):
            for sid in seq_ids:
                cache.reserve(sid, max_new)
            tables.append([cache.block_table(sid) for sid in seq_ids])
        # table widths rounded up: calls of similar lengths share a graph
        widths = [1 << (max(map(len, t)) - 1).bit_length() for t in tables]
        batch = len(seq_ids)
        key = RoundKey(bucket(batch) if graphs else batch, k + 1, widths[0], k, 0, settings.min_new_tokens,
                       eos_ids, settings.do_sample, draft_blocks=widths[1])
        replay, state, sampler = self._round(runner, draft, key, graphs)
        first = first_tokens(sampler, logits, settings, key.width)  # one read-back
        state.start(prompts, first, tables[0], max_new, eos_ids)
        state.start_draft(tables[1])
        replay_rounds(replay, state, batch, runner.device, streamer, input_ids, prompts,
                      settings.pad_token_id, settings.do_sample)
        new_tokens, stats = round_outputs(state, prompts, settings.pad_token_id)
        keep_rows(draft.cache, seq_ids, new_tokens, eos_ids)
        return new_tokens, stats

    def _round(self, runner: ModelRunner, draft: ModelRunner, key: RoundKey, graphs: bool):
        """(replay, state, sampler) for key; replay() runs one round on the device."""
        held = self._rounds.get(key) if graphs else None
        if held is not None and held[3]() is draft:
            return held[:3]
        state = DraftState(key, runner.cache.block_size, runner.device)
        sampler = round_sampler(key, runner.device)

        def one_round() -> None:
            draft_round(runner, draft, state, sampler, key)

        if not graphs:
            return one_round, state, sampler
        # Captured with every row done (the state's start): the warm-up run writes no K/V in
        # either cache and changes no row, only scratch buffers.
        captured = capture_step(runner, ("draft", key), one_round)
        if captured is None:  # a fallback target's step that cannot be captured: eager
            return one_round, state, sampler
        self._rounds[key] = (captured.replay, state, sampler, weakref.ref(draft))
        return captured.replay, state, sampler
