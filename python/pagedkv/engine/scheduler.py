"""Which sequences run in the next step, and how many new tokens each computes.

Policy (one step, budget = max_num_batched_tokens new tokens, at most max_num_seqs sequences):
0. A model whose every layer has a sliding window (models/windows.py every_layer_window): each
   running sequence first gives back its leading blocks that no later token attends to, so the
   steps below, admissions included, find them free.
1. Decodes first: every running decoding sequence feeds its last token (one slot each, reserved
   in one all-or-nothing append). If the cache lacks blocks, the newest running sequence is
   preempted (its blocks freed; it goes back to the front of the waiting queue and is recomputed
   later from prompt + generated tokens) until the rest fit.
2. Running prefills continue, oldest first, with chunks of what is left of the budget; one that
   does not fit preempts newer sequences, or (when it is the newest) shrinks or waits.
3. Waiting sequences are admitted in FIFO order while the budget, the sequence limit and the free
   blocks allow (none in a step that preempted). A prompt's leading blocks found in the prefix
   cache are not computed again. A prompt longer than the left budget is chunked: its first
   chunk is added now, the rest is appended by later steps, so every block the cache can hand
   to another prompt as a prefix hit has its K/V written by the step that reserved it.
With speculative decoding (engine/speculation.py), step 1 is followed by the decode rows'
proposals: `propose(decodes, budget)` gives each speculating row its tokens, their slots are
reserved (a proposal shrinks to what fits, never preempting), and they count against the budget.

Scheduled while the step before still runs (the engine overlaps the two), a sequence that sampled
in that step is `pending`: its token is not known on the host yet. It decodes as usual, its slot
reserved with PENDING_TOKEN (the runner reads the token on the device, the engine names it to the
cache once read back), unless that token is its last (max_len): then it is left out. A pending
sequence that waits (preempted) is not admitted again before its token is read back.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable

from pagedkv.cache import PENDING_TOKEN, CacheFull, KVCache
from pagedkv.engine.request import Sequence, Status


@dataclasses.dataclass(slots=True)
class ScheduledRow:
    seq: Sequence
    num_new: int  # tokens computed this step: seq.token_ids[num_computed : num_computed + num_new]

    @property
    def samples(self) -> bool:
        """The row reaches the end of its tokens: its last logits give the next token."""
        return self.seq.num_computed + self.num_new == len(self.seq.token_ids)


@dataclasses.dataclass(slots=True)
class SchedulerOutput:
    # Decode rows as plain lists (no row object per sequence: a 256-sequence decode step would
    # spend ~100 us making them); the ids and last tokens are the ones append_batch reserved.
    decodes: list[Sequence]  # one new token each (their last), in running order
    decode_ids: list[int]  # [s.seq_id for s in decodes]
    decode_tokens: list[int]  # [s.token_ids[-1] for s in decodes]; PENDING_TOKEN where s.pending
    prefills: list[ScheduledRow]  # prefill chunks, after the decode rows
    preempted: list[Sequence]
    num_cached_tokens: int  # prompt tokens found in the prefix cache by this step's admissions
    # decode rows that verify proposed tokens (speculative decoding): their slots are reserved
    proposals: dict[Sequence, list[int]] = dataclasses.field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(map(len, self.proposals.values())) + sum(r.num_new for r in self.prefills)


class Scheduler:
    def __init__(self, cache: KVCache, max_num_seqs: int, max_num_batched_tokens: int,
                 propose: Callable[[list[Sequence], int], dict[Sequence, list[int]]] | None = None,
                 window: int = 0):
        self.cache = cache
        # Every layer of the model attends through a window of at most `window` tokens (0: some
        # layer sees the whole context): each step first gives back the blocks that fell out of it.
        self.window = window
        self.propose = propose  # speculative decoding's proposals (engine/speculation.py), or None
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []  # admission order: the last one is preempted first
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _seq_slots(self) -> int:
        return sum(1 + s.pending_forks for s in self.running)

    # -- one step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        if self.window:  # every slot in the cache is a launched step's: later steps start past it
            self.cache.release_out_of_window([s.seq_id for s in self.running if s.in_cache], self.window)
        preempted: list[Sequence] = []
        decodes: list[Sequence] = []
        prefilling: list[Sequence] = []
        any_pending = False
        for s in self.running:  # s.is_decoding, inlined: this loop runs over every sequence
            if s.pending:
                if len(s.token_ids) + 1 < s.request.max_len:  # else the read-back finishes it
                    decodes.append(s)
                    any_pending = True
                continue
            (decodes if s.in_cache and len(s.token_ids) - s.num_computed == 1 else prefilling).append(s)
        decode_ids = [s.seq_id for s in decodes]
        if any_pending:
            decode_tokens = [PENDING_TOKEN if s.pending else s.token_ids[-1] for s in decodes]
        else:
            decode_tokens = [s.token_ids[-1] for s in decodes]
        while decodes:
            try:  # all or nothing: CacheFull changes nothing
                self.cache.append_batch(decode_ids, decode_tokens)
                if any_pending:
                    for s in decodes:
                        if s.pending:
                            s.pending_in_cache = True
                break
            except CacheFull:
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                self._drop_decode(victim, decodes, decode_ids, decode_tokens)
        proposals = self._reserve(self.propose(decodes, self.max_num_batched_tokens - len(decodes))
                                  ) if self.propose is not None and decodes else {}
        budget = self.max_num_batched_tokens - len(decodes) - sum(map(len, proposals.values()))

        prefills: list[ScheduledRow] = []
        for seq in prefilling:
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:  # preempted by an older one of this loop
                continue
            chunk = min(seq.num_left, budget)
            while not self.cache.can_allocate(self.cache.blocks_needed_to_append([seq.seq_id], chunk)):
                victim = self.running[-1]
                if victim is seq:  # the newest: take what fits, or wait
                    chunk = self._fitting_chunk(seq, chunk)
                    break
                self._preempt(victim)
                preempted.append(victim)
                self._drop_decode(victim, decodes, decode_ids, decode_tokens)
                proposals.pop(victim, None)
                prefills = [r for r in prefills if r.seq is not victim]
                budget = (self.max_num_batched_tokens - len(decodes) - sum(map(len, proposals.values()))
                          - sum(r.num_new for r in prefills))
                chunk = min(seq.num_left, budget)
            if chunk == 0:
                continue
            start = seq.num_computed
            self.cache.append_tokens(seq.seq_id, seq.token_ids[start:start + chunk])
            prefills.append(ScheduledRow(seq, chunk))
            budget -= chunk
        budget = (self.max_num_batched_tokens - len(decodes) - sum(map(len, proposals.values()))
                  - sum(r.num_new for r in prefills))

        cached = 0
        slots = self._seq_slots() if self.waiting else 0
        while self.waiting and budget > 0 and not preempted:
            seq = self.waiting[0]
            if seq.pending or slots + 1 + seq.pending_forks > self.max_num_seqs:
                break
            admitted = self._admit(seq, budget)
            if admitted is None:
                break
            num_new, hits = admitted
            self.waiting.popleft()
            self.running.append(seq)
            slots += 1 + seq.pending_forks
            prefills.append(ScheduledRow(seq, num_new))
            budget -= num_new
            cached += hits
        return SchedulerOutput(decodes, decode_ids, decode_tokens, prefills, preempted, cached, proposals)

    def _reserve(self, proposals: dict[Sequence, list[int]]) -> dict[Sequence, list[int]]:
        """Reserve the proposals' slots after their rows' last tokens, each shrunk (halved) to what
        the free blocks allow; those that keep a token."""
        kept = {}
        for seq, proposal in proposals.items():
            n = len(proposal)
            while n and not self.cache.can_allocate(self.cache.blocks_needed_to_append([seq.seq_id], n)):
                n //= 2
            if n:
                self.cache.append_tokens(seq.seq_id, proposal[:n])
                kept[seq] = proposal[:n]
        return kept

    @staticmethod
    def _drop_decode(victim: Sequence, decodes: list[Sequence], ids: list[int], tokens: list[int]) -> None:
        """A preempted sequence leaves this step's decode rows (its slot went with its blocks)."""
        for i, s in enumerate(decodes):
            if s is victim:
                del decodes[i], ids[i], tokens[i]
                return

    def _admit(self, seq: Sequence, budget: int) -> tuple[int, int] | None:
        """Add the sequence's first chunk to the cache; (tokens to compute, prefix-cache hits),
        or None when its blocks do not fit now."""
        tokens = seq.token_ids
        end = min(len(tokens), budget)
        try:
            hits = self.cache.add_sequence(seq.seq_id, tokens[:end])
        except CacheFull:
            return None
        if hits and end < len(tokens):  # the budget the hits saved takes more of the prompt
            extra = min(len(tokens) - end, hits)
            try:
                self.cache.append_tokens(seq.seq_id, tokens[end:end + extra])
                end += extra
            except CacheFull:
                pass
        seq.in_cache = True
        seq.num_computed = hits
        seq.status = Status.RUNNING
        metrics = seq.request.metrics
        if metrics.first_scheduled_time is None:
            metrics.first_scheduled_time = time.perf_counter()
            seq.request.num_cached_prompt_tokens = hits
        return end - hits, hits

    def _fitting_chunk(self, seq: Sequence, chunk: int) -> int:
        while chunk > 0 and not self.cache.can_allocate(
                self.cache.blocks_needed_to_append([seq.seq_id], chunk)):
            chunk //= 2
        return chunk

    def _preempt(self, seq: Sequence) -> None:
        """Free the sequence's blocks; it is recomputed from its tokens when admitted again."""
        self.running.remove(seq)
        self.cache.free(seq.seq_id)
        seq.in_cache = False
        seq.pending_in_cache = False
        seq.num_computed = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    # -- after a step ------------------------------------------------------------------------
    def fork(self, parent: Sequence, seq_ids: list[int]) -> list[Sequence]:
        """The parent's pending samples (n > 1) as new sequences seq_ids sharing its blocks; they
        run right after it (same admission rank)."""
        request = parent.request
        children = []
        for index, seq_id in enumerate(seq_ids, 1):
            children.append(Sequence(seq_id, request, index, list(parent.token_ids), parent.prompt_len,
                                     status=Status.RUNNING, num_computed=parent.num_computed, in_cache=True))
            self.cache.fork(parent.seq_id, seq_id)
        request.sequences += children
        parent.pending_forks = 0
        at = self.running.index(parent) + 1
        self.running[at:at] = children
        return children

    def reset(self, waiting: list[Sequence]) -> None:
        """Start over (engine/repair.py): nothing runs, `waiting` waits in this order. Every
        sequence the cache holds is freed, its blocks dropped from the prefix cache unless another
        sequence holds them (their K/V may never have been written)."""
        self.cache.free_all(keep_cached=False)
        self.running = []
        self.waiting = collections.deque(waiting)

    def finish(self, seq: Sequence, reason: str) -> None:
        """The sequence ended (running, or waiting after a preemption while its token came back)."""
        seq.finish_reason = reason  # first: a sequence with a reason counts as finished (repair.py)
        self.abort(seq)

    def abort(self, seq: Sequence) -> None:
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        if seq.in_cache:
            self.cache.free(seq.seq_id)
            seq.in_cache = False
            seq.pending_in_cache = False
        seq.status = Status.FINISHED
