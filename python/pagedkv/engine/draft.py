"""pagedkv.LLM's shared draft model (``assistant_model``): one draft sequence per running target
sequence, under the same id, in the draft's own paged KV cache.

A draft sequence holds the K/V of its target's tokens but the last ones it has not seen. Each
step, every speculating decode row feeds those (at its first proposal: its whole prompt and
output, over the draft's prefix cache) as one draft step, then decodes greedily one token per
draft step, up to its cap, stopping after a stop id (HF's assistant stops at EOS too). After the
target verified the proposal, the draft sequence is truncated to the accepted prefix. A draft
sequence whose blocks do not fit is dropped (fed again later): the row proposes nothing then.
Draft sequences of target sequences that stopped running (finished, preempted, aborted) are freed
after each step (`keep`).
"""

from __future__ import annotations

from pagedkv.cache import CacheFull, KVCache, KVCacheSpec, num_blocks_for
from pagedkv.engine.request import Sequence
from pagedkv.runtime.model import prepared
from pagedkv.runtime.draft_model import check_draft, greedy_step
from pagedkv.runtime.runner import ModelRunner


def shared_with_draft(model, draft, state, block_size: int, sizing: dict) -> dict:
    """The target cache's sizing (cache_sizing's keyword) when a draft model's cache, a block for
    each of the target's, shares the memory budget (kv_cache_memory): the target's blocks from
    the budget over both blocks' bytes. A block count given (num_kv_blocks) stays as it is."""
    if draft is None or "num_blocks" in sizing:
        return sizing
    check_draft(model, draft)  # DraftRefused, a ValueError naming why, before prepared(draft)
    specs = [KVCacheSpec(len(s.weights.layers), s.weights.num_kv_heads, s.weights.head_dim, s.dtype, block_size)
             for s in (state, prepared(draft))]
    both = sum(spec.bytes_per_block for spec in specs)
    return {"num_blocks": num_blocks_for(specs[0], state.device, **sizing) * specs[0].bytes_per_block // both}


class EngineDraft:
    def __init__(self, draft, target_cache: KVCache, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, graphs: bool) -> None:
        state = prepared(draft)  # check_draft refused what it cannot run
        w = state.weights
        self.limit = min(state.max_positions, max_model_len)
        self.step_tokens = max(max_num_batched_tokens, self.limit)  # a first feed is one sequence
        # As many blocks as the target's cache: a draft sequence never holds more tokens than its target.
        self.cache = KVCache(len(w.layers), w.num_kv_heads, w.head_dim, dtype=state.dtype,
                             block_size=target_cache.block_size, num_blocks=target_cache.num_blocks,
                             device=state.device, max_seq_len=self.limit, max_batch_size=max_num_seqs,
                             max_step_tokens=self.step_tokens)
        self.runner = ModelRunner(state, self.cache, graphs, max_batch=max_num_seqs)
        self.fed: dict[int, int] = {}  # seq_id -> target tokens whose K/V the draft sequence holds
        self.proposed: dict[int, int] = {}  # seq_id -> tokens of its last proposal

    def propose(self, rows: list[tuple[Sequence, int]]) -> dict[Sequence, list[int]]:
        """Up to cap greedy draft tokens after each (sequence, cap) row's tokens."""
        feeds: list[tuple[Sequence, list[int]]] = []
        for seq, cap in rows:
            sid, tokens = seq.seq_id, seq.token_ids
            if len(tokens) + cap > self.limit:
                continue
            try:
                if sid not in self.fed:
                    feed = tokens[self.cache.add_sequence(sid, tokens):]
                else:
                    feed = tokens[self.fed[sid]:]
                    self.cache.append_tokens(sid, feed)
            except CacheFull:
                self.drop(sid)
                continue
            self.fed[sid] = len(tokens)
            feeds.append((seq, feed))
        out: dict[Sequence, list[int]] = {seq: [] for seq, _ in feeds}
        limit = {seq: cap for seq, cap in rows}
        group: list[tuple[Sequence, list[int]]] = []
        firsts: list[int] = []
        for item in feeds:  # first draft steps of at most step_tokens tokens
            if group and sum(len(f) for _, f in group) + len(item[1]) > self.step_tokens:
                firsts += self._greedy(group)
                group = []
            group.append(item)
        firsts += self._greedy(group) if group else []
        stepped = [seq for seq, _ in feeds]
        while stepped:
            feeds = []
            for seq, token in zip(stepped, firsts):
                out[seq].append(token)
                if len(out[seq]) < limit[seq] and token not in seq.request.stop_ids:
                    try:
                        self.cache.append_tokens(seq.seq_id, [token])
                    except CacheFull:
                        continue
                    feeds.append((seq, [token]))
            stepped = [seq for seq, _ in feeds]
            firsts = self._greedy(feeds) if feeds else []
        for seq, tokens in out.items():
            self.proposed[seq.seq_id] = len(tokens)
        return out

    def _greedy(self, feeds: list[tuple[Sequence, list[int]]]) -> list[int]:
        """One draft step over the rows' fed tokens: each row's argmax token after them."""
        return greedy_step(self.runner, [s.seq_id for s, _ in feeds], [f for _, f in feeds])

    def accepted(self, sid: int, count: int) -> None:
        """The target kept `count` leading tokens of the row's last proposal: the draft keeps as
        many of those it fed (all but its proposal's last)."""
        proposed = self.proposed.pop(sid, 0)
        if proposed and sid in self.fed:
            kept = min(count, proposed - 1)
            self.cache.truncate(sid, proposed - 1 - kept)
            self.fed[sid] += kept

    def keep(self, running: list[Sequence]) -> None:
        """After a step: proposals the target did not verify (the scheduler found no room for
        them) are taken back, and the draft sequences of target sequences no longer running freed."""
        for sid in list(self.proposed):
            self.accepted(sid, 0)
        live = {s.seq_id for s in running}
        for sid in [sid for sid in self.fed if sid not in live]:
            self.drop(sid)

    def drop(self, sid: int) -> None:
        if sid in self.fed:
            self.cache.free(sid)
        self.fed.pop(sid, None)
        self.proposed.pop(sid, None)

    def reset(self) -> None:
        """After a fault (engine/repair.py): nothing held, nothing left in the prefix cache."""
        self.cache.free_all(keep_cached=False)
        self.fed.clear()
        self.proposed.clear()
