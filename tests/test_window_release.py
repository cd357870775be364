"""The cache manager's release_out_of_window (sliding windows): a sequence gives back its leading
blocks whose every token lies before position seq_len - window, keeping its length, positions and
the ids of its other blocks; the blocks go back as free() gives them (a cached full block stays
findable); truncate, fork, free, the prefix cache and the step metadata stay consistent; refusals
change nothing. Then the attention kernels on both devices: a step after a release reads no
released block (they are poisoned with NaN and their table entries point at a poisoned block)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import pagedkv
from conftest import DEVICES
from pagedkv import ops
from pagedkv._ext import _C
from pagedkv.cache import KVCache

BLOCK_SIZES = [1, 4, 16]
WINDOWS = [1, 5, 16, 40]


def check_consistent(m) -> None:
    """Ref counts equal owners (released entries, 0, own nothing); free + used = total."""
    owners = Counter()
    for seq_id in m.sequence_ids():
        table, released = m.block_table(seq_id), m.released_blocks(seq_id)
        assert len(table) == -(-m.seq_len(seq_id) // m.block_size)
        assert table[:released] == [0] * released
        owners.update(table[released:])
    refs = [m.ref_count(b) for b in range(m.num_blocks)]
    assert refs == [owners[b] for b in range(m.num_blocks)], "ref count != owners"
    assert m.num_free_blocks + sum(r > 0 for r in refs) == m.num_blocks


def step_slots(m, seq_id: int, query_len: int) -> tuple[list[int], list[int]]:
    """(positions, slots) build_step writes for the sequence's last query_len tokens."""
    layout = _C.StepLayout(1, m.max_seq_len, m.max_blocks_per_seq)
    buffer = torch.full((layout.size,), -7, dtype=torch.int32)
    num_tokens, _, _ = m.build_step(layout, buffer, [seq_id], [query_len], 1)
    buf = buffer.tolist()
    return (buf[layout.positions:layout.positions + num_tokens],
            buf[layout.slot_mapping:layout.slot_mapping + num_tokens])


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("length", [1, 17, 64, 100])
def test_release_gives_back_whole_blocks_before_the_window(block_size, window, length):
    m = _C.CacheManager(256, block_size, 512, True)
    m.add_sequence(1, list(range(length)))
    before = m.block_table(1)
    expected = max(0, length - window) // block_size
    assert m.release_out_of_window([1], window) == expected
    assert m.released_blocks(1) == expected and m.seq_len(1) == length
    assert m.block_table(1) == [0] * expected + before[expected:]  # the kept blocks keep their ids
    assert all(m.ref_count(b) == 0 for b in before[:expected])
    assert m.num_free_blocks == 256 - len(before) + expected
    assert m.release_out_of_window([1], window) == 0  # nothing more until the sequence grows
    # A later step's positions and slots follow the kept table: nothing moved.
    m.append_batch([1], [3])
    positions, slots = step_slots(m, 1, 1)
    table = m.block_table(1)
    assert positions == [length] and slots == [table[length // block_size] * block_size + length % block_size]
    assert table[:len(before)] == [0] * expected + before[expected:]
    check_consistent(m)
    m.free(1)
    assert m.num_free_blocks == 256 and len(m) == 0


def test_released_blocks_are_reused_without_corrupting_either_sequence():
    m = _C.CacheManager(8, 4, 64, False)
    m.add_sequence(1, list(range(20)))  # blocks 0..4
    assert m.release_out_of_window([1], 6) == 3  # positions 0..11 < 14
    m.add_sequence(2, list(range(9)))  # 3 blocks: the released ones and one never used
    assert set(m.block_table(2)) >= {1, 2} and len(set(m.block_table(2))) == 3
    kept = m.block_table(1)[3:]
    for t in range(20, 30):  # both grow; each keeps its own blocks
        m.append_batch([1, 2], [t, t])
        if t % 3 == 0:
            m.release_out_of_window([1, 2], 6)
        check_consistent(m)
    assert not set(m.block_table(1)[m.released_blocks(1):]) & set(m.block_table(2)[m.released_blocks(2):])
    assert m.block_table(1)[3:5] == kept or m.released_blocks(1) > 3
    for seq_id in (1, 2):
        positions, slots = step_slots(m, seq_id, 1)
        n, table = m.seq_len(seq_id), m.block_table(seq_id)
        assert positions == [n - 1] and slots == [table[(n - 1) // 4] * 4 + (n - 1) % 4]
    m.free(1)
    m.free(2)
    assert m.num_free_blocks == 8


def test_truncate_after_a_release_keeps_the_window_or_is_refused():
    m = _C.CacheManager(32, 4, 128, True)
    m.add_sequence(1, list(range(30)))
    assert m.release_out_of_window([1], 10) == 5  # positions < 20
    m.append_tokens(1, [7, 8, 9])  # 33 tokens: speculative slots, say
    m.truncate(1, 3)  # back to 30: its next token's window starts at 21
    check_consistent(m)
    with pytest.raises(ValueError, match="keep at least 30 tokens"):
        m.truncate(1, 1)  # 29 kept: position 29's window would start at 20, released
    assert m.seq_len(1) == 30 and m.released_blocks(1) == 5
    check_consistent(m)
    m.free(1)
    assert m.num_free_blocks == 32


def test_a_step_that_would_attend_to_released_blocks_is_refused():
    m = _C.CacheManager(32, 4, 128, False)
    m.add_sequence(1, list(range(30)))
    m.release_out_of_window([1], 10)  # positions < 20 (blocks 0..4)
    assert step_slots(m, 1, 1)[0] == [29]  # position 29 sees keys 20..29
    with pytest.raises(ValueError, match="would attend to them"):
        step_slots(m, 1, 2)  # position 28 would see key 19
    m.append_tokens(1, list(range(5)))  # a chunk after the release: its first row sees 21..30
    assert step_slots(m, 1, 5)[0] == list(range(30, 35))


def test_released_cached_blocks_stay_findable_as_free_leaves_them():
    m = _C.CacheManager(16, 4, 64, True)
    prompt = list(range(100, 124))  # 6 full blocks, all registered
    m.add_sequence(1, prompt)
    first = m.block_table(1)
    assert m.release_out_of_window([1], 8) == 4  # positions < 16
    assert m.evictable_blocks() == first[3::-1]  # cached, no owner: free, findable, last first
    assert m.num_free_blocks == 16 - 2
    assert m.add_sequence(2, prompt + [5]) == 24  # the released blocks are prefix hits again
    assert m.block_table(2)[:6] == first
    check_consistent(m)
    m.release_out_of_window([2], 8)  # 25 tokens: positions < 17, four blocks again
    assert [m.ref_count(b) for b in first[:4]] == [0] * 4 and m.ref_count(first[4]) == 2
    m.free(1)
    m.free(2)
    assert m.num_free_blocks == 16
    m.drop_cached()
    assert m.num_evictable_blocks == 0 and m.num_free_blocks == 16


def test_fork_after_a_release_shares_only_the_kept_blocks():
    m = _C.CacheManager(16, 4, 64, True)
    m.add_sequence(1, list(range(22)))
    m.release_out_of_window([1], 5)  # positions < 17: 4 blocks
    m.fork(1, 2)
    assert m.released_blocks(2) == 4 and m.block_table(2) == m.block_table(1)
    check_consistent(m)
    m.append_batch([1, 2], [1, 2])  # the shared partly filled last block is copied for one of them
    check_consistent(m)
    with pytest.raises(ValueError, match="cannot truncate"):
        m.truncate(2, 3)  # 20 kept: fewer than the released 16 tokens + the window of 5
    m.free(1)
    check_consistent(m)
    m.free(2)
    assert m.num_free_blocks == 16


def test_refusals_change_nothing():
    m = _C.CacheManager(16, 4, 64, True)
    m.add_sequence(1, list(range(30)))
    m.add_sequence(2, list(range(3)))
    m.reserve(2, 20)  # generate()'s way: slots whose steps have not run
    free = m.num_free_blocks
    for args, error, match in [(([1], 0), ValueError, "must be >= 1"), (([1], -3), ValueError, "must be >= 1"),
                               (([1, 1], 4), ValueError, "appears twice"), (([1, 9], 4), KeyError, "not in the cache"),
                               (([1, 2], 4), ValueError, "reserved without token ids")]:
        with pytest.raises(error, match=match):
            m.release_out_of_window(*args)
        assert m.num_free_blocks == free and m.released_blocks(1) == 0 and m.released_blocks(2) == 0
    assert m.release_out_of_window([], 4) == 0
    assert m.release_out_of_window([1], 64) == 0  # the whole sequence is in its window
    assert m.release_out_of_window([1], 4) == 6
    check_consistent(m)
    pagedkv_cache = KVCache(1, 1, 16, dtype=torch.float32, block_size=4, num_blocks=8, device="cpu")
    pagedkv_cache.add_sequence(5, list(range(20)))
    assert pagedkv_cache.release_out_of_window([5], 3) == 4 and pagedkv_cache.released_blocks(5) == 4
    pagedkv_cache.free_all()
    assert pagedkv_cache.num_free_blocks == 8


# -- the kernels never read a released block ----------------------------------------------------
DTYPES = [torch.float32, torch.bfloat16]
HEAD_DIMS = [64, 128]


def filled_cache(device: str, dtype: torch.dtype, head_dim: int, block_size: int) -> KVCache:
    cache = KVCache(1, 2, head_dim, dtype=dtype, block_size=block_size, num_blocks=96, device=device,
                    max_seq_len=96 * block_size, max_batch_size=4)
    cache.kv.normal_()
    return cache


def poison_released(cache: KVCache, seq_ids: list[int]) -> None:
    """NaN into every block no sequence holds (the released ones among them) and into block 0,
    where a released entry of a table points."""
    owned = {b for s in seq_ids for b in cache.block_table(s)[cache.released_blocks(s):]}
    assert 0 not in owned  # block 0 went to the first sequence, which released it
    assert any(cache.released_blocks(s) for s in seq_ids)
    for b in range(cache.num_blocks):
        if b not in owned:
            cache.kv[:, :, b] = float("nan")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("window", [7, 64, 200])
def test_decode_attention_after_a_release_reads_no_released_block(device, dtype, head_dim, window):
    cache = filled_cache(device, dtype, head_dim, 16)
    lens = [700, 300, 65]  # several splits on CUDA; the window's first key mid-block
    for seq_id, n in enumerate(lens):
        cache.add_sequence(seq_id, list(range(1000 * seq_id, 1000 * seq_id + n)))  # no shared prefix
    q = torch.randn(len(lens), 4, head_dim, device=device).to(dtype)

    def attend():
        meta = cache.build_metadata(list(range(len(lens))))
        return ops.paged_decode_attention(q, cache.k_caches[0], cache.v_caches[0], meta.block_tables,
                                          meta.context_lens, head_dim ** -0.5, sliding_window=window)

    expected = attend().clone()
    assert cache.release_out_of_window(list(range(len(lens))), window) > 0
    poison_released(cache, list(range(len(lens))))
    got = attend()
    assert got.isfinite().all()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("window", [7, 64])
def test_prefill_attention_after_a_release_reads_no_released_block(device, dtype, head_dim, window):
    cache = filled_cache(device, dtype, head_dim, 16)
    lens, chunks = [600, 200, 80], [90, 1, 37]  # released at the length before each chunk
    ids = list(range(len(lens)))
    for seq_id, n in zip(ids, lens):
        cache.add_sequence(seq_id, list(range(1000 * seq_id, 1000 * seq_id + n)))
    assert cache.release_out_of_window(ids, window) > 0
    for seq_id, c in zip(ids, chunks):
        cache.append_tokens(seq_id, list(range(c)))
    q = torch.randn(sum(chunks), 4, head_dim, device=device).to(dtype)

    def attend():
        meta = cache.build_metadata(ids, chunks)
        return ops.paged_prefill_attention(q, cache.k_caches[0], cache.v_caches[0], meta.block_tables,
                                           meta.context_lens, meta.query_start_loc, head_dim ** -0.5,
                                           max(chunks), sliding_window=window)

    expected = attend().clone()
    poison_released(cache, ids)
    got = attend()
    assert got.isfinite().all()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
