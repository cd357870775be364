"""Long random runs of add / append / reserve / append_batch / fork / truncate / free / step metadata against the
plain-Python model (cache_model.py), checking after every step that the C++ manager agrees with
the model exactly (block tables, reference counts, eviction order, prefix hits, copies) and
that its own state is consistent: ref counts equal the number of owners, a block is owned twice
only through sharing, free + used = total, and nothing leaks once everything is freed.

PAGEDKV_FUZZ_EXAMPLES scales the runs: this machine runs a twentieth of it (default 4000: 200
runs of 40 steps, a few seconds) and test_cache_fuzz.py all of it, each a fast seeded sequence."""

from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import cache_checks
from cache_checks import check_agrees, check_consistent, check_step, free_all_and_check
from cache_model import CacheModel
from pagedkv import _C

EXAMPLES = max(40, int(os.environ.get("PAGEDKV_FUZZ_EXAMPLES", "4000")) // 20)
MAX_SEQ_LEN = 40
# Few distinct tokens, so equal blocks after different prefixes are common (the chained keys
# must keep them apart), and a few shared openings, so prefix hits are common.
TOKENS = st.integers(0, 3)
OPENINGS = [[7] * 9, [7] * 4 + [1, 2, 3, 1, 2, 3, 1, 2], [5, 6] * 5]


def expect_same_outcome(model_call, real_call):
    return cache_checks.expect_same_outcome(model_call, real_call, event)


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
    @rule(data=st.data(), rest=st.lists(TOKENS, max_size=6))
    def add_after_a_live_prefix(self, data, rest):
        """A prompt opening with (part of) a live sequence's known tokens: prefix hits."""
        known = self.model.seqs[data.draw(st.sampled_from(self.live_ids()))].tokens
        known = known[:known.index(None)] if None in known else known
        tokens = known[:data.draw(st.integers(0, len(known)))] + rest
        seq_id, self.next_id = self.next_id, self.next_id + 1
        if expect_same_outcome(lambda: self.model.add(seq_id, tokens),
                               lambda: self.real.add_sequence(seq_id, tokens)):
            event("prefix hit on a live sequence")

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
    @rule(data=st.data(), keep_cached=st.booleans())
    def free(self, data, keep_cached):
        seq_id = data.draw(st.sampled_from(self.live_ids()))
        expect_same_outcome(lambda: self.model.free(seq_id, keep_cached),
                            lambda: self.real.free(seq_id, keep_cached))

    @precondition(lambda self: self.model.seqs)
    @rule(data=st.data())
    def truncate(self, data):
        """Speculative tokens a step rejected: the last n slots go (n out of range refused)."""
        seq_id = data.draw(st.sampled_from(self.live_ids()))
        n = data.draw(st.integers(-1, len(self.model.seqs[seq_id].tokens)))
        expect_same_outcome(lambda: self.model.truncate(seq_id, n), lambda: self.real.truncate(seq_id, n))

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
        check_step(self.real, self.model, self.layout, self.buffer, seq_ids, query_lens, padded)

    @invariant()
    def agrees_with_model(self):
        if hasattr(self, "real"):
            check_agrees(self.real, self.model)

    @invariant()
    def is_consistent(self):
        if hasattr(self, "real"):
            check_consistent(self.real)

    def teardown(self):
        if hasattr(self, "real"):
            free_all_and_check(self.real)


CacheMachine.TestCase.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestCacheManagerProperties = CacheMachine.TestCase
