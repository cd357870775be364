"""Long random runs of add / append / reserve / append_batch / fork / free / step metadata against the
plain-Python model (cache_model.py), checking after every step that the C++ manager agrees with
the model exactly (block tables, reference counts, eviction order, prefix hits, copies) and
that its own state is consistent: ref counts equal the number of owners, a block is owned twice
only through sharing, free + used = total, and nothing leaks once everything is freed.

PAGEDKV_HYPOTHESIS_EXAMPLES raises the number of runs (default 40, a few seconds)."""

from __future__ import annotations

import os
from collections import Counter

import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import pagedkv
from cache_model import CacheModel, ModelCacheFull
from pagedkv import _C

EXAMPLES = int(os.environ.get("PAGEDKV_HYPOTHESIS_EXAMPLES", "40"))
MAX_SEQ_LEN = 40
# Few distinct tokens, so equal blocks after different prefixes are common (the chained keys
# must keep them apart), and a few shared openings, so prefix hits are common.
TOKENS = st.integers(0, 3)
OPENINGS = [[7] * 9, [7] * 4 + [1, 2, 3, 1, 2, 3, 1, 2], [5, 6] * 5]


def expect_same_outcome(model_call, real_call):
    """Run the model, then the real call; both must succeed with equal results or fail alike."""
    try:
        expected = model_call()
    except ModelCacheFull:
        event("cache full")
        try:
            real_call()
        except pagedkv.CacheFull:
            return None
        raise AssertionError("model ran out of blocks but the manager did not")
    except (KeyError, ValueError) as model_error:
        event(f"refused: {type(model_error).__name__}")
        try:
            real_call()
        except type(model_error):
            return None
        raise AssertionError(f"model raised {type(model_error).__name__} but the manager did not")
    assert real_call() == expected
    return expected


class CacheMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(4, 24), block_size=st.sampled_from([1, 2, 4, 8]),
                prefix_caching=st.booleans())
    def setup(self, num_blocks, block_size, prefix_caching):
        self.real = _C.CacheManager(num_blocks, block_size, MAX_SEQ_LEN, prefix_caching)
        self.model = CacheModel(num_blocks, block_size, MAX_SEQ_LEN, prefix_caching)
        self.layout = _C.StepLayout(8, 8 * MAX_SEQ_LEN, self.real.max_blocks_per_seq)
        self.buffer = torch.zeros(self.layout.size, dtype=torch.int32)
        self.next_id = 0

    def live_ids(self) -> list[int]:
        return sorted(self.model.seqs)

    @rule(opening=st.sampled_from([[]] + OPENINGS), rest=st.lists(TOKENS, max_size=12))
    def add(self, opening, rest):
        tokens = opening + rest
        seq_id, self.next_id = self.next_id, self.next_id + 1
        cached = expect_same_outcome(lambda: self.model.add(seq_id, tokens),
                                     lambda: self.real.add_sequence(seq_id, tokens))
        if cached:
            event("prefix hit")

    @precondition(lambda self: self.model.seqs)
    @rule(data=st.data(), tokens=st.lists(TOKENS, max_size=9))
    def append_tokens(self, data, tokens):
        seq_id = data.draw(st.sampled_from(self.live_ids()))
        copies = expect_same_outcome(lambda: self.model.append([seq_id], [tokens]),
                                     lambda: [tuple(c) for c in self.real.append_tokens(seq_id, tokens)])
        if copies:
            event("copy-on-write")

    @precondition(lambda self: self.model.seqs)
    @rule(data=st.data(), n=st.integers(-1, 9))
    def reserve(self, data, n):
        seq_id = data.draw(st.sampled_from(self.live_ids()))
        expect_same_outcome(lambda: self.model.reserve(seq_id, n),
                            lambda: [tuple(c) for c in self.real.reserve(seq_id, n)])

    @precondition(lambda self: self.model.seqs)
    @rule(data=st.data())
    def append_batch(self, data):
        seq_ids = data.draw(st.lists(st.sampled_from(self.live_ids()), min_size=1, max_size=6, unique=True))
        tokens = data.draw(st.lists(TOKENS, min_size=len(seq_ids), max_size=len(seq_ids)))
        copies = expect_same_outcome(lambda: self.model.append(seq_ids, [[t] for t in tokens]),
                                     lambda: [tuple(c) for c in self.real.append_batch(seq_ids, tokens)])
        if copies:
            event("copy-on-write in a batch")

    @precondition(lambda self: self.model.seqs)
    @rule(data=st.data())
    def blocks_needed(self, data):
        seq_ids = data.draw(st.lists(st.sampled_from(self.live_ids()), min_size=1, max_size=4, unique=True))
        n = data.draw(st.integers(0, 9))
        expect_same_outcome(lambda: self.model.plan_append(seq_ids, n)[1],
                            lambda: self.real.blocks_needed_to_append(seq_ids, n))

    @rule(opening=st.sampled_from(OPENINGS), rest=st.lists(TOKENS, max_size=6))
    def blocks_needed_to_add(self, opening, rest):
        tokens = opening + rest
        expect_same_outcome(lambda: self.model.plan_add(tokens)[1],
                            lambda: self.real.blocks_needed_to_add(tokens))

    @precondition(lambda self: self.model.seqs)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.live_ids()))
        child, self.next_id = self.next_id, self.next_id + 1
        expect_same_outcome(lambda: self.model.fork(parent, child), lambda: self.real.fork(parent, child))

    @precondition(lambda self: self.model.seqs)
    @rule(data=st.data())
    def free(self, data):
        seq_id = data.draw(st.sampled_from(self.live_ids()))
        expect_same_outcome(lambda: self.model.free(seq_id), lambda: self.real.free(seq_id))

    @rule(seq_id=st.integers(-3, -1))
    def unknown_ids_are_refused(self, seq_id):
        expect_same_outcome(lambda: self.model.free(seq_id), lambda: self.real.free(seq_id))

    @precondition(lambda self: self.model.seqs)
    @rule(data=st.data())
    def step_metadata(self, data):
        ids = self.live_ids()
        seq_ids = data.draw(st.lists(st.sampled_from(ids), min_size=1, max_size=min(len(ids), 6), unique=True))
        query_lens = [data.draw(st.integers(1, len(self.model.seqs[s].tokens))) for s in seq_ids]
        padded = data.draw(st.integers(len(seq_ids), 8))
        num_tokens, _, max_context_len = self.real.build_step(self.layout, self.buffer, seq_ids, query_lens, padded)
        L, buf, bs = self.layout, self.buffer.tolist(), self.model.bs
        slots, positions = [], []
        for s, q in zip(seq_ids, query_lens):
            seq = self.model.seqs[s]
            n = len(seq.tokens)
            positions += list(range(n - q, n))
            slots += [seq.blocks[p // bs] * bs + p % bs for p in range(n - q, n)]
        pad = padded - len(seq_ids)
        assert num_tokens == len(slots) + pad
        assert buf[L.slot_mapping: L.slot_mapping + num_tokens] == slots + [-1] * pad
        assert buf[L.positions: L.positions + num_tokens] == positions + [0] * pad
        lens = [len(self.model.seqs[s].tokens) for s in seq_ids]
        assert buf[L.context_lens: L.context_lens + padded] == lens + [0] * pad
        assert max_context_len == max(lens)
        for row, s in enumerate(seq_ids):
            start = L.block_tables + row * L.max_blocks_per_seq
            blocks = self.model.seqs[s].blocks
            assert buf[start: start + len(blocks)] == blocks

    @invariant()
    def agrees_with_model(self):
        if not hasattr(self, "real"):
            return
        assert sorted(self.real.sequence_ids()) == self.live_ids()
        for seq_id, seq in self.model.seqs.items():
            assert self.real.block_table(seq_id) == seq.blocks
            assert self.real.seq_len(seq_id) == len(seq.tokens)
        assert [self.real.ref_count(b) for b in range(self.real.num_blocks)] == self.model.ref
        assert self.real.evictable_blocks() == self.model.lru
        assert self.real.num_free_blocks == self.model.num_free

    @invariant()
    def is_consistent(self):
        if not hasattr(self, "real"):
            return
        owners = Counter()
        for seq_id in self.real.sequence_ids():
            table = self.real.block_table(seq_id)
            assert len(table) == -(-self.real.seq_len(seq_id) // self.real.block_size)
            assert len(set(table)) == len(table), "a sequence holds one block twice"
            owners.update(table)
        refs = [self.real.ref_count(b) for b in range(self.real.num_blocks)]
        assert all(refs[b] == owners[b] for b in range(self.real.num_blocks)), "ref count != owners"
        used = sum(r > 0 for r in refs)
        assert self.real.num_free_blocks + used == self.real.num_blocks
        assert all(refs[b] == 0 for b in self.real.evictable_blocks())
        if not self.real.enable_prefix_caching:
            assert self.real.num_evictable_blocks == 0

    def teardown(self):
        if not hasattr(self, "real"):
            return
        for seq_id in self.real.sequence_ids():
            self.real.free(seq_id)
        assert self.real.num_free_blocks == self.real.num_blocks, "blocks leaked"
        assert all(self.real.ref_count(b) == 0 for b in range(self.real.num_blocks))


CacheMachine.TestCase.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestCacheManagerProperties = CacheMachine.TestCase
