"""Checks shared by the cache manager's property tests (test_cache_properties.py, a Hypothesis
state machine) and its seeded fuzz runs (test_cache_fuzz.py): the C++ manager against the Python
model (cache_model.py) after every operation, and its own consistency."""

from __future__ import annotations

from collections import Counter
from typing import Callable

import pagedkv
from cache_model import CacheModel, ModelCacheFull


def expect_same_outcome(model_call: Callable, real_call: Callable, note: Callable[[str], None] = lambda _: None):
    """Run the model, then the real call; both must succeed with equal results or fail alike.
    note(...) is told which way it went (Hypothesis's event() in the state machine)."""
    try:
        expected = model_call()
    except ModelCacheFull:
        note("cache full")
        try:
            real_call()
        except pagedkv.CacheFull:
            return None
        raise AssertionError("model ran out of blocks but the manager did not")
    except (KeyError, ValueError) as model_error:
        note(f"refused: {type(model_error).__name__}")
        try:
            real_call()
        except type(model_error):
            return None
        raise AssertionError(f"model raised {type(model_error).__name__} but the manager did not")
    assert real_call() == expected
    note("done")
    return expected


def check_agrees(real, model: CacheModel) -> None:
    """Same sequences, block tables, lengths, ref counts, eviction order and free count."""
    assert sorted(real.sequence_ids()) == sorted(model.seqs)
    for seq_id, seq in model.seqs.items():
        assert real.block_table(seq_id) == seq.blocks
        assert real.seq_len(seq_id) == len(seq.tokens)
    assert [real.ref_count(b) for b in range(real.num_blocks)] == model.ref
    assert real.evictable_blocks() == model.lru
    assert real.num_free_blocks == model.num_free


def check_consistent(real) -> None:
    """Ref counts equal owners, a block is owned twice only through sharing, free + used = total."""
    owners = Counter()
    for seq_id in real.sequence_ids():
        table = real.block_table(seq_id)
        assert len(table) == -(-real.seq_len(seq_id) // real.block_size)
        assert len(set(table)) == len(table), "a sequence holds one block twice"
        owners.update(table)
    refs = [real.ref_count(b) for b in range(real.num_blocks)]
    assert all(refs[b] == owners[b] for b in range(real.num_blocks)), "ref count != owners"
    used = sum(r > 0 for r in refs)
    assert real.num_free_blocks + used == real.num_blocks
    assert all(refs[b] == 0 for b in real.evictable_blocks())
    if not real.enable_prefix_caching:
        assert real.num_evictable_blocks == 0


def check_step(real, model: CacheModel, layout, buffer, seq_ids: list[int], query_lens: list[int],
               padded: int) -> None:
    """build_step's metadata equals what the model's block tables say."""
    num_tokens, _, max_context_len = real.build_step(layout, buffer, seq_ids, query_lens, padded)
    buf, bs = buffer.tolist(), model.bs
    slots, positions = [], []
    for s, q in zip(seq_ids, query_lens):
        seq = model.seqs[s]
        n = len(seq.tokens)
        positions += list(range(n - q, n))
        slots += [seq.blocks[p // bs] * bs + p % bs for p in range(n - q, n)]
    pad = padded - len(seq_ids)
    assert num_tokens == len(slots) + pad
    assert buf[layout.slot_mapping: layout.slot_mapping + num_tokens] == slots + [-1] * pad
    assert buf[layout.positions: layout.positions + num_tokens] == positions + [0] * pad
    lens = [len(model.seqs[s].tokens) for s in seq_ids]
    assert buf[layout.context_lens: layout.context_lens + padded] == lens + [0] * pad
    assert max_context_len == max(lens)
    for row, s in enumerate(seq_ids):
        start = layout.block_tables + row * layout.max_blocks_per_seq
        blocks = model.seqs[s].blocks
        assert buf[start: start + len(blocks)] == blocks


def free_all_and_check(real) -> None:
    """Nothing leaks once every sequence is freed."""
    for seq_id in real.sequence_ids():
        real.free(seq_id)
    assert real.num_free_blocks == real.num_blocks, "blocks leaked"
    assert all(real.ref_count(b) == 0 for b in range(real.num_blocks))
