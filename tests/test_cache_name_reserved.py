"""KVCache.name_reserved (the ids of slots reserve() took without them, named once known: their
full blocks enter the prefix cache) and drop_prefix_cache (unheld cached blocks forgotten), the
two calls generate() keeps earlier calls' K/V with (runtime/prefix_reuse.py)."""

from __future__ import annotations

import pytest
import torch

from pagedkv import KVCache


def make_cache(num_blocks: int = 16, prefix_caching: bool = True) -> KVCache:
    return KVCache(2, 2, 8, dtype=torch.float32, block_size=4, num_blocks=num_blocks, device="cpu",
                   max_seq_len=64, max_batch_size=8, enable_prefix_caching=prefix_caching)


def state(cache: KVCache):
    m = cache.manager
    tables = {s: (m.seq_len(s), m.block_table(s)) for s in m.sequence_ids()}
    return tables, [m.ref_count(b) for b in range(m.num_blocks)], m.evictable_blocks(), m.num_free_blocks


def test_named_reserved_slots_key_their_full_blocks():
    cache = make_cache()
    cache.add_sequence(0, [1, 2, 3, 4, 5, 6])  # block 0 keyed, block 1 holds 5, 6
    cache.reserve(0, 7)  # 13 slots: blocks 1..3 hold unknown ids
    cache.name_reserved(0, [7, 8, 9])  # block 1 = 5 6 7 8 full; 9 starts block 2
    assert cache.add_sequence(1, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]) == 8
    assert cache.block_table(1)[:2] == cache.block_table(0)[:2]
    cache.name_reserved(0, [10, 11, 12])  # block 2 = 9 10 11 12; one slot stays unnamed
    cache.free(0)
    assert cache.add_sequence(2, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]) == 12
    assert cache.add_sequence(3, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 99, 13]) == 8  # diverges in block 2


def test_naming_every_reserved_slot_makes_the_sequence_keyable_again():
    cache = make_cache()
    cache.add_sequence(0, [1, 2])
    cache.reserve(0, 3)
    cache.name_reserved(0, [3, 4, 5])
    cache.append_tokens(0, [6, 7, 8])  # block 1 = 5 6 7 8, keyed as an append keys it
    assert cache.add_sequence(1, [1, 2, 3, 4, 5, 6, 7, 8, 9]) == 8


def test_appended_slots_after_a_reserve_stay_unnamed_until_named():
    cache = make_cache()
    cache.add_sequence(0, [1, 2, 3])
    cache.reserve(0, 1)
    cache.append_tokens(0, [5, 6, 7, 8])  # the manager keys none of these: a slot before is unnamed
    assert cache.add_sequence(1, [1, 2, 3, 4, 5, 6, 7, 8, 9]) == 0
    cache.name_reserved(0, [4, 5, 6, 7, 8])
    assert cache.add_sequence(2, [1, 2, 3, 4, 5, 6, 7, 8, 9]) == 8


@pytest.mark.parametrize("call, error, message", [
    (lambda c: c.name_reserved(0, [1, 2, 3, 4]), ValueError, "has 3 slots without token ids"),
    (lambda c: c.name_reserved(0, [1, -1]), ValueError, "name_reserved got token -1"),
    (lambda c: c.name_reserved(0, [1, -5]), ValueError, r"token_ids\[1\] = -5"),
    (lambda c: c.name_reserved(7, [1]), KeyError, "7"),
])
def test_bad_names_change_nothing(call, error, message):
    cache = make_cache()
    cache.add_sequence(0, [1, 2, 3, 4, 5])
    cache.reserve(0, 3)
    before = state(cache)
    with pytest.raises(error, match=message):
        call(cache)
    assert state(cache) == before
    cache.name_reserved(0, [6, 7, 8])  # still all three to name
    assert cache.add_sequence(1, [1, 2, 3, 4, 5, 6, 7, 8, 9]) == 8


def test_without_prefix_caching_names_are_counted_and_nothing_is_keyed():
    cache = make_cache(prefix_caching=False)
    cache.add_sequence(0, [1, 2])
    cache.reserve(0, 6)
    cache.name_reserved(0, [3, 4, 5, 6, 7, 8])
    with pytest.raises(ValueError, match="has 0 slots without token ids"):
        cache.name_reserved(0, [9])
    cache.free(0)
    assert cache.add_sequence(1, [1, 2, 3, 4, 5, 6, 7, 8, 9]) == 0


def test_drop_prefix_cache_forgets_unheld_blocks_only():
    cache = make_cache(num_blocks=8)
    cache.add_sequence(0, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    cache.add_sequence(1, [11, 12, 13, 14, 15])
    cache.free(0)
    assert cache.manager.num_evictable_blocks == 2 and cache.num_free_blocks == 6
    cache.drop_prefix_cache()
    assert cache.manager.num_evictable_blocks == 0 and cache.num_free_blocks == 6
    assert cache.add_sequence(2, [1, 2, 3, 4, 5, 6, 7, 8, 9]) == 0
    assert cache.add_sequence(3, [11, 12, 13, 14, 15]) == 4  # held by sequence 1: still keyed
