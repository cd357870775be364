"""Every cache operation on its own: sizing, add / append / fork / free, copy-on-write, prefix
caching and its LRU, step metadata, and the errors (each leaving the cache as it was)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config

import pagedkv
from conftest import DEVICES
from pagedkv import CacheFull, KVCache, KVCacheSpec
from pagedkv.cache.spec import free_memory_bytes, num_blocks_for

BLOCK_SIZES = [1, 4, 16]


def make_cache(num_blocks=16, block_size=4, device="cpu", **kwargs) -> KVCache:
    kwargs.setdefault("max_seq_len", 64)
    kwargs.setdefault("max_batch_size", 8)
    return KVCache(2, 2, 8, dtype=torch.float32, block_size=block_size, num_blocks=num_blocks, device=device,
                   **kwargs)


def state(cache: KVCache):
    """Everything observable about the bookkeeping, to show a failed call changed nothing."""
    m = cache.manager
    tables = {s: (m.seq_len(s), m.block_table(s)) for s in m.sequence_ids()}
    return tables, [m.ref_count(b) for b in range(m.num_blocks)], m.evictable_blocks(), m.num_free_blocks


# -- sizing ---------------------------------------------------------------------------------------
def test_spec_bytes_and_capacity():
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16, block_size=16)
    assert spec.bytes_per_token == 2 * 3 * 2 * 8 * 2
    assert spec.bytes_per_block == 16 * spec.bytes_per_token
    cache = KVCache(3, 2, 8, dtype=torch.bfloat16, memory_bytes=5 * spec.bytes_per_block + 7, device="cpu")
    assert cache.spec == spec
    assert cache.num_blocks == 5 and cache.capacity_tokens == 80
    assert cache.manager.max_seq_len == 80  # by default one sequence may fill the cache
    # kv: [layers, 2, num_blocks, block_size, kv_heads, head_dim]
    assert cache.kv.shape == (3, 2, 5, 16, 2, 8) and cache.kv.dtype == torch.bfloat16
    assert len(cache.k_caches) == 3 and cache.k_caches[1].shape == (5, 16, 2, 8)
    assert cache.k_caches[1].is_contiguous() and cache.v_caches[2].data_ptr() == cache.kv[2, 1].data_ptr()


def test_spec_from_hf_config():
    qwen = Qwen2Config(num_hidden_layers=4, hidden_size=256, num_attention_heads=8, num_key_value_heads=2)
    spec = KVCacheSpec.from_hf_config(qwen, dtype=torch.float16, block_size=8)
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype, spec.block_size) == (
        4, 2, 32, torch.float16, 8)
    llama = LlamaConfig(num_hidden_layers=2, hidden_size=256, num_attention_heads=4, head_dim=128,
                        dtype="bfloat16")
    spec = KVCacheSpec.from_hf_config(llama)
    assert (spec.num_kv_heads, spec.head_dim, spec.dtype, spec.block_size) == (4, 128, torch.bfloat16, 16)
    cache = KVCache.from_hf_config(llama, num_blocks=3, device="cpu")
    assert cache.kv.shape == (2, 2, 3, 16, 4, 128) and cache.kv.dtype == torch.bfloat16


@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one of"),
    ({"num_blocks": 4, "memory_bytes": 1 << 20}, "exactly one of"),
    ({"memory_fraction": 0.5}, "on it pass num_blocks= or memory_bytes="),
    ({"memory_bytes": 10}, "hold no cache block"),
])
def test_sizing_errors_say_what_is_allowed(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KVCache(1, 1, 8, device="cpu", **kwargs)


@pytest.mark.cuda
def test_memory_fraction_of_available_cuda_memory():
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=64)
    available = free_memory_bytes(torch.device("cuda"))
    cache = KVCache(2, 2, 64, memory_fraction=0.01, device="cuda")
    assert cache.num_blocks == int(available * 0.01) // spec.bytes_per_block


@pytest.mark.cuda
def test_a_larger_cache_after_a_freed_one_fits():
    """The budget counts memory torch's allocator holds unused; a freed cache's segment is
    smaller than a cache sized later from more free memory, so it must be handed back first
    (else: out of memory with the memory counted as available)."""
    first = KVCache(2, 2, 64, memory_fraction=0.5, device="cuda")
    del first
    second = KVCache(2, 2, 64, memory_fraction=0.9, device="cuda")
    assert second.num_blocks > 0
    del second
    torch.cuda.empty_cache()


def test_memory_fraction_counts_memory_torch_holds_unused(monkeypatch):
    # No GPU needed: the sizing reads only these three numbers. 1 GiB free on the device, and
    # torch's allocator holds 3 GiB of which 1 GiB is in use: 3 GiB are available to a cache.
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 3 << 30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 1 << 30)
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=64)
    blocks = num_blocks_for(spec, torch.device("cuda"), memory_fraction=0.5)
    assert blocks == (3 << 30) // 2 // spec.bytes_per_block


def test_block_size_must_be_a_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, block_size=12)
    with pytest.raises(ValueError, match="power of two"):
        pagedkv._C.CacheManager(8, 6, 64)


# -- sequences ------------------------------------------------------------------------------------
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_add_takes_ceil_n_over_block_size_blocks(block_size):
    cache = make_cache(num_blocks=64, block_size=block_size)
    assert cache.add_sequence(0, list(range(9))) == 0
    assert cache.seq_len(0) == 9
    assert len(cache.block_table(0)) == -(-9 // block_size)
    assert cache.num_free_blocks == 64 - -(-9 // block_size)


def test_append_allocates_only_on_a_block_boundary():
    cache = make_cache(block_size=4)
    cache.add_sequence(0, [1, 2, 3])
    cache.append_batch([0], [4])  # fills block 0
    assert cache.block_table(0) == [0] and cache.num_free_blocks == 15
    cache.append_batch([0], [5])  # token 4 starts block 1
    assert cache.block_table(0) == [0, 1] and cache.seq_len(0) == 5
    cache.append_tokens(0, [6, 7, 8, 9, 10])  # 10 tokens: 3 blocks
    assert cache.block_table(0) == [0, 1, 2] and cache.seq_len(0) == 10


def test_reserve_takes_slots_for_unknown_tokens_which_never_enter_the_prefix_cache():
    cache = make_cache(block_size=4)
    cache.add_sequence(0, [1, 2, 3, 4, 5, 6])
    cache.reserve(0, 7)  # 13 tokens: 4 blocks
    assert cache.seq_len(0) == 13 and len(cache.block_table(0)) == 4
    cache.append_tokens(0, [9, 9, 9])  # fills block 3, but its tokens 12.. are partly unknown
    assert cache.add_sequence(1, [1, 2, 3, 4, 5, 6, 7, 8, 9]) == 4  # only the prompt's full block


def test_a_pending_token_keys_its_block_only_once_named():
    # The engine reserves the slot of a token it sampled but has not read back (PENDING_TOKEN);
    # the block that token fills must not be found by a prefix until the token is known.
    cache = make_cache(block_size=4)
    cache.add_sequence(0, [1, 2, 3])
    cache.append_batch([0], [pagedkv.cache.PENDING_TOKEN])  # fills block 0 with an unknown token
    assert cache.seq_len(0) == 4 and cache.block_table(0) == [0]
    assert cache.add_sequence(1, [1, 2, 3, 4, 5]) == 0  # not findable yet
    cache.free(1)
    cache.set_pending_tokens([0], [4])
    assert cache.add_sequence(2, [1, 2, 3, 4, 5]) == 4  # now it is, under the named token
    assert cache.add_sequence(3, [1, 2, 3, 7, 5]) == 0  # and under no other
    cache.append_batch([0], [5])  # appends go on once named
    assert cache.seq_len(0) == 5


def test_a_pending_token_in_a_partial_block_is_keyed_when_the_block_fills():
    cache = make_cache(block_size=4)
    cache.add_sequence(0, [1, 2])
    cache.append_batch([0], [pagedkv.cache.PENDING_TOKEN])
    cache.set_pending_tokens([0], [3])
    cache.append_batch([0], [4])
    assert cache.add_sequence(1, [1, 2, 3, 4, 5]) == 4


def test_pending_token_errors_change_nothing():
    cache = make_cache(block_size=4)
    cache.add_sequence(0, [1, 2, 3])
    cache.add_sequence(1, [1, 2])
    cache.append_batch([0], [-1])
    before = state(cache)
    with pytest.raises(ValueError, match="not known yet"):
        cache.append_batch([1, 0], [5, 6])  # sequence 0 still waits for its token
    with pytest.raises(ValueError, match="not known yet"):
        cache.append_tokens(0, [5])
    with pytest.raises(ValueError, match="append_tokens got token -1"):
        cache.append_tokens(1, [-1])
    with pytest.raises(ValueError, match="cannot hold token -1"):
        cache.add_sequence(2, [1, -1])
    with pytest.raises(ValueError, match="no slot waiting"):
        cache.set_pending_tokens([0, 1], [4, 4])  # sequence 1 has none: all or nothing
    with pytest.raises(ValueError, match="token ids are >= 0"):
        cache.set_pending_tokens([0], [-1])
    with pytest.raises(ValueError, match="one token per sequence"):
        cache.set_pending_tokens([0], [4, 4])
    with pytest.raises(KeyError):
        cache.set_pending_tokens([7], [4])
    assert state(cache) == before
    cache.set_pending_tokens([0], [4])
    with pytest.raises(ValueError, match="no slot waiting"):
        cache.set_pending_tokens([0], [4])  # once only
    cache.append_batch([1], [-1])
    cache.free(1)  # a sequence may be dropped with its token pending
    assert not cache.has_sequence(1)


def test_tokens_may_come_as_a_cpu_tensor():
    cache = make_cache(block_size=4)
    cache.add_sequence(0, torch.tensor([1, 2, 3]))
    cache.add_sequence(1, torch.tensor([4, 5], dtype=torch.int32))
    cache.append_batch(torch.tensor([0, 1]), torch.tensor([7, 8], dtype=torch.int32))
    assert (cache.seq_len(0), cache.seq_len(1)) == (4, 3)
    with pytest.raises(RuntimeError, match="1-D CPU int32/int64 tensor"):
        cache.append_batch([0], torch.tensor([[1]]))
    with pytest.raises(TypeError):
        cache.append_batch([0], [1.5])


def test_free_returns_every_block():
    cache = make_cache()
    cache.add_sequence(0, list(range(10)))
    cache.add_sequence(1, list(range(100, 105)))
    cache.free(0)
    cache.free(1)
    assert cache.num_free_blocks == cache.num_blocks and not cache.has_sequence(0) and len(cache.manager) == 0


def test_fork_shares_blocks_by_reference_count():
    cache = make_cache()
    cache.add_sequence(0, list(range(10)))
    cache.fork(0, 1)
    assert cache.block_table(1) == cache.block_table(0) and cache.seq_len(1) == 10
    assert [cache.manager.ref_count(b) for b in cache.block_table(0)] == [2, 2, 2]
    cache.free(0)
    assert [cache.manager.ref_count(b) for b in cache.block_table(1)] == [1, 1, 1]


@pytest.mark.parametrize("device", DEVICES)
def test_first_write_into_shared_partial_block_copies_it_on_the_device(device):
    cache = make_cache(device=device)
    cache.add_sequence(0, list(range(6)))  # blocks [0, 1], block 1 half full
    cache.kv.copy_(torch.randn_like(cache.kv))
    cache.fork(0, 1)
    shared = cache.block_table(0)[1]
    before = cache.kv[:, :, shared].clone()

    cache.append_batch([1], [42])  # the child writes first: it gets the copy
    copy = cache.block_table(1)[1]
    assert copy != shared and cache.block_table(1)[0] == cache.block_table(0)[0]
    assert cache.block_table(0)[1] == shared
    assert torch.equal(cache.kv[:, :, copy], before)  # every layer, K and V
    assert cache.manager.ref_count(shared) == 1 and cache.manager.ref_count(copy) == 1

    free_before = cache.num_free_blocks
    cache.append_batch([0], [7])  # the parent owns its block alone now: no copy
    assert cache.block_table(0)[1] == shared and cache.num_free_blocks == free_before


def test_no_copy_when_the_shared_last_block_is_full():
    cache = make_cache(block_size=4)
    cache.add_sequence(0, list(range(8)))
    cache.fork(0, 1)
    cache.append_batch([0, 1], [1, 2])
    assert cache.block_table(0)[:2] == cache.block_table(1)[:2]
    assert cache.block_table(0)[2] != cache.block_table(1)[2]


def test_batch_counts_one_copy_per_extra_owner():
    cache = make_cache(num_blocks=4, block_size=4)
    cache.add_sequence(0, [1, 2])
    cache.fork(0, 1)
    cache.fork(0, 2)  # block 0 has three owners
    assert cache.blocks_needed_to_append([0, 1, 2]) == 2  # the last writer keeps the original
    cache.append_batch([0, 1, 2], [3, 4, 5])
    tables = [cache.block_table(s)[0] for s in (0, 1, 2)]
    assert len(set(tables)) == 3 and tables[2] == 0
    assert cache.num_free_blocks == 1


# -- prefix caching -------------------------------------------------------------------------------
def test_prompt_reuses_cached_full_blocks_and_says_how_many_tokens():
    cache = make_cache(block_size=4)
    prompt = list(range(10))
    cache.add_sequence(0, prompt)
    assert cache.add_sequence(1, prompt[:8] + [99, 98, 97]) == 8
    assert cache.block_table(1)[:2] == cache.block_table(0)[:2]
    assert cache.block_table(1)[2] != cache.block_table(0)[2]
    assert cache.manager.ref_count(cache.block_table(0)[0]) == 2


def test_whole_prompt_hit_still_leaves_the_last_token_to_compute():
    cache = make_cache(block_size=4)
    cache.add_sequence(0, list(range(8)))
    assert cache.add_sequence(1, list(range(8))) == 4  # the last block is recomputed for its logits
    assert cache.block_table(1)[0] == cache.block_table(0)[0]
    assert cache.block_table(1)[1] != cache.block_table(0)[1]


def test_equal_blocks_after_different_prefixes_are_not_shared():
    cache = make_cache(block_size=2)
    cache.add_sequence(0, [1, 1, 5, 5, 0])
    assert cache.add_sequence(1, [2, 2, 5, 5, 0]) == 0  # block [5, 5] follows another prefix


def test_blocks_filled_by_appends_become_reusable():
    cache = make_cache(block_size=4)
    cache.add_sequence(0, [1, 2])
    cache.append_tokens(0, [3, 4, 5])
    cache.append_batch([0], [6])
    assert cache.add_sequence(1, [1, 2, 3, 4, 5, 6, 7]) == 4


def test_freed_blocks_stay_cached_until_their_space_is_needed():
    cache = make_cache(num_blocks=4, block_size=4)
    cache.add_sequence(0, list(range(12)))  # 3 full blocks, all keyed
    table = cache.block_table(0)
    cache.free(0)
    assert cache.num_free_blocks == 4 and cache.manager.num_evictable_blocks == 3
    assert cache.manager.evictable_blocks() == table[::-1]  # the prompt's end is evicted first
    assert cache.add_sequence(1, list(range(12)) + [50]) == 12
    assert cache.block_table(1)[:3] == table
    cache.free(1)
    cache.add_sequence(2, [90, 91, 92, 93, 94, 95, 96, 97, 98])  # needs 3: the free one, then LRU
    assert cache.manager.evictable_blocks() == table[:1]  # the prompt's start survived
    cache.free(2)
    assert cache.add_sequence(3, list(range(12)) + [50]) == 4


def test_reviving_a_cached_block_counts_against_free_blocks():
    cache = make_cache(num_blocks=3, block_size=4)
    cache.add_sequence(0, list(range(8)))
    cache.free(0)  # both blocks cached, 3 free
    assert cache.blocks_needed_to_add(list(range(8)) + [1]) == 3  # 2 cached blocks revived + 1 new
    cache.add_sequence(1, [7, 7, 7, 7, 7, 7, 7, 7, 7, 7])  # 3 blocks: evicts both cached ones
    assert cache.manager.num_evictable_blocks == 0


def test_prefix_caching_can_be_switched_off():
    cache = make_cache(block_size=4, enable_prefix_caching=False)
    cache.add_sequence(0, list(range(10)))
    assert cache.add_sequence(1, list(range(10))) == 0
    cache.free(0)
    assert cache.manager.num_evictable_blocks == 0 and not cache.manager.enable_prefix_caching


# -- errors ---------------------------------------------------------------------------------------
def test_cache_full_is_a_runtime_error_exported_by_pagedkv():
    assert issubclass(CacheFull, RuntimeError) and pagedkv.CacheFull is CacheFull


def test_cache_full_on_add_changes_nothing():
    cache = make_cache(num_blocks=4, block_size=4)
    cache.add_sequence(0, list(range(10)))
    before = state(cache)
    assert not cache.can_allocate(cache.blocks_needed_to_add(list(range(100, 108))))
    with pytest.raises(CacheFull, match="needs 2 free blocks but only 1 of 4 are free"):
        cache.add_sequence(1, list(range(100, 108)))
    assert state(cache) == before and not cache.has_sequence(1)


def test_cache_full_on_a_batch_append_changes_nothing():
    cache = make_cache(num_blocks=4, block_size=2)
    cache.add_sequence(0, [1, 2])
    cache.add_sequence(1, [3])
    cache.fork(1, 2)
    cache.add_sequence(3, [4, 5])  # 3 used, 1 free; the batch below needs 3
    before = state(cache)
    assert cache.blocks_needed_to_append([0, 2, 3]) == 3 and not cache.can_allocate(3)
    with pytest.raises(CacheFull):
        cache.append_batch([0, 2, 3], [9, 9, 9])
    assert state(cache) == before
    cache.append_batch([0], [9])  # one fits


def test_cache_full_on_a_copy_on_write_append_changes_nothing():
    cache = make_cache(num_blocks=2, block_size=4)
    cache.add_sequence(0, [1, 2, 3, 4, 5])
    cache.fork(0, 1)
    before = state(cache)
    with pytest.raises(CacheFull):
        cache.append_tokens(1, [6])  # needs a copy of the shared block: none free
    assert state(cache) == before


@pytest.mark.parametrize("call, error, message", [
    (lambda c: c.free(5), KeyError, "sequence 5 is not in the cache"),
    (lambda c: c.append_batch([0, 5], [1, 1]), KeyError, "sequence 5"),
    (lambda c: c.seq_len(5), KeyError, "sequence 5"),
    (lambda c: c.fork(5, 6), KeyError, "sequence 5"),
    (lambda c: c.add_sequence(0, [1]), ValueError, "already in the cache"),
    (lambda c: c.fork(0, 0), ValueError, "already in the cache"),
    (lambda c: c.add_sequence(1, []), ValueError, "at least one token"),
    (lambda c: c.add_sequence(1, list(range(65))), ValueError, "longer than max_seq_len 64"),
    (lambda c: c.append_tokens(0, list(range(62))), ValueError, "would pass max_seq_len 64"),
    (lambda c: c.append_batch([0, 0], [1, 1]), ValueError, "appears twice in one batch"),
    (lambda c: c.append_batch([0], [1, 2]), ValueError, "one token per sequence"),
    (lambda c: c.append_tokens(0, [1 << 40]), ValueError, r"token_ids\[0\] = 1099511627776 does not fit in int32"),
    (lambda c: c.reserve(0, -1), ValueError, "cannot append -1 tokens"),
    (lambda c: c.build_metadata([0], [4]), ValueError, r"query_lens\[0\] = 4 .* must be in \[1, 3\]"),
    (lambda c: c.build_metadata([0], padded_batch=9), ValueError, "max_batch 8"),
])
def test_bad_calls_name_what_was_wrong_and_change_nothing(call, error, message):
    cache = make_cache()
    cache.add_sequence(0, [1, 2, 3])
    before = state(cache)
    with pytest.raises(error, match=message):
        call(cache)
    assert state(cache) == before


def test_double_free_is_refused():
    cache = make_cache()
    cache.add_sequence(0, [1, 2, 3])
    cache.free(0)
    with pytest.raises(KeyError, match="already freed"):
        cache.free(0)


def test_prompt_larger_than_the_whole_cache_is_a_value_error():
    cache = make_cache(num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match="needs 3 blocks but the whole cache has 2"):
        cache.add_sequence(0, list(range(9)))


# -- step metadata --------------------------------------------------------------------------------
def test_decode_metadata():
    cache = make_cache(block_size=4)
    cache.add_sequence(0, list(range(6)))
    cache.add_sequence(1, list(range(20, 29)))
    cache.append_batch([0, 1], [6, 29])  # lengths 7 and 10
    m = cache.build_metadata([1, 0])
    t0, t1 = cache.block_table(0), cache.block_table(1)
    assert (m.num_seqs, m.num_tokens, m.max_query_len, m.max_context_len) == (2, 2, 1, 10)
    assert m.context_lens.tolist() == [10, 7]
    assert m.positions.tolist() == [9, 6]
    assert m.slot_mapping.tolist() == [t1[2] * 4 + 1, t0[1] * 4 + 2]
    assert m.query_start_loc.tolist() == [0, 1, 2]
    assert m.block_tables.shape == (2, 16) and m.block_tables.dtype == torch.int32
    assert m.block_tables[0, :3].tolist() == t1 and m.block_tables[1, :2].tolist() == t0


def test_prefill_metadata_covers_only_uncached_tokens():
    cache = make_cache(block_size=4)
    cache.add_sequence(0, list(range(10)))
    cached = cache.add_sequence(1, list(range(8)) + [50, 51, 52])
    m = cache.build_metadata([0, 1], query_lens=[10, 11 - cached])
    assert m.query_start_loc.tolist() == [0, 10, 13]
    assert m.positions.tolist() == list(range(10)) + [8, 9, 10]
    assert m.context_lens.tolist() == [10, 11] and m.max_query_len == 10
    t1 = cache.block_table(1)
    assert m.slot_mapping[10:].tolist() == [t1[2] * 4, t1[2] * 4 + 1, t1[2] * 4 + 2]


def test_padded_batch_rows_see_nothing_and_write_nothing():
    cache = make_cache(num_blocks=32, block_size=4)
    cache.add_sequence(0, list(range(5)))
    cache.add_sequence(1, list(range(50, 53)))
    m = cache.build_metadata([0, 1], padded_batch=4)
    assert m.block_tables.shape == (4, 16) and m.num_tokens == 4 and m.num_seqs == 2
    assert m.context_lens.tolist() == [5, 3, 0, 0]
    assert m.slot_mapping.tolist()[2:] == [-1, -1] and m.positions.tolist()[2:] == [0, 0]
    assert m.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert ((m.block_tables >= 0) & (m.block_tables < cache.num_blocks)).all()


def test_metadata_views_keep_their_addresses_across_steps():
    cache = make_cache()
    cache.add_sequence(0, [1, 2, 3])
    first = cache.build_metadata([0], padded_batch=2)
    cache.append_batch([0], [4])
    second = cache.build_metadata([0], padded_batch=2)
    for name in ("block_tables", "context_lens", "query_start_loc", "slot_mapping", "positions"):
        assert getattr(first, name).data_ptr() == getattr(second, name).data_ptr()
    assert second.context_lens.tolist() == [4, 0]


def test_step_with_more_tokens_than_the_buffers_hold_is_refused():
    cache = make_cache(max_step_tokens=8)
    cache.add_sequence(0, list(range(10)))
    with pytest.raises(ValueError, match="chunk the prefill or raise max_tokens"):
        cache.build_metadata([0], query_lens=[10])


@pytest.mark.cuda
def test_metadata_reaches_the_device():
    cache = make_cache(device="cuda")
    cache.add_sequence(0, list(range(7)))
    m = cache.build_metadata([0], query_lens=[7], padded_batch=2)
    assert m.slot_mapping.is_cuda and m.positions.tolist() == list(range(7)) + [0]
    assert m.context_lens.tolist() == [7, 0]
