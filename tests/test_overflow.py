"""Counts, ids and token ids at the C++/Python boundary (issue 29, item 5): negative, huge, past
int32/int64, bools. Every call on the cache manager and KVCache either works or raises a Python
exception naming the argument, and leaves the manager consistent; nothing wraps, nothing
crashes. SamplingParams refuses what its kernels cannot take; test_sampling_faults.py has the
engine's side (a failed step leaves no stale sampling state)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache_checks import check_consistent
from pagedkv import _C, CacheFull, KVCache, KVCacheSpec, SamplingParams
from pagedkv.cache.spec import num_blocks_for

I32, I64 = 2**31, 2**63
# The edges where a wrap hides: each side of int32 and int64, and the sum-overflow points.
EXTREME = [0, 1, -1, -2, 3, 31, 32, 33, I32 - 1, I32, -I32, -I32 - 1, 2**32, 2**62, I64 - 3, I64 - 1,
           I64, -I64, -I64 - 1, 2**64, 10**30]
INTS = st.one_of(st.sampled_from(EXTREME), st.integers(-3, 40), st.integers())
TOKENS = st.lists(st.one_of(st.integers(0, 5), st.sampled_from(EXTREME)), max_size=5)
# What a bad count or id may raise; never OverflowError, a pybind11 TypeError or a crash.
REFUSALS = (ValueError, KeyError, IndexError, CacheFull)
MAX_SEQ_LEN, NUM_BLOCKS, BLOCK_SIZE = 32, 8, 4


def manager(prefix_caching: bool = True):
    m = _C.CacheManager(NUM_BLOCKS, BLOCK_SIZE, MAX_SEQ_LEN, prefix_caching)
    m.add_sequence(0, [1, 2, 3])
    m.add_sequence(1, [1, 2, 3, 4, 5])
    m.fork(1, 2)
    return m


def snapshot(m):
    ids = sorted(m.sequence_ids())
    return ([(s, m.seq_len(s), m.block_table(s)) for s in ids],
            [m.ref_count(b) for b in range(m.num_blocks)], m.evictable_blocks(), m.num_free_blocks)


# -- the reproductions ------------------------------------------------------------------------
@pytest.mark.parametrize("n", [I64 - 3, I64 - 1, 2**62, I32, MAX_SEQ_LEN - 2])
def test_huge_reserve_is_refused_not_wrapped(n):
    m = manager()
    before = snapshot(m)
    with pytest.raises(ValueError, match=rf"{n} more would pass max_seq_len {MAX_SEQ_LEN}"):
        m.reserve(0, n)
    assert snapshot(m) == before
    check_consistent(m)


@pytest.mark.parametrize("n", [I64, 2**64, -I64 - 1])
def test_counts_past_int64_name_the_argument(n):
    m = manager()
    before = snapshot(m)
    for call in (lambda: m.reserve(0, n), lambda: m.blocks_needed_to_append([0], n),
                 lambda: m.can_allocate(n)):
        with pytest.raises(ValueError, match=rf"= {n} does not fit in int64"):
            call()
    assert snapshot(m) == before


def test_blocks_needed_and_can_allocate_refuse_bad_counts():
    m = manager()
    for n in (I64 - 1, MAX_SEQ_LEN):
        with pytest.raises(ValueError, match=f"{n} more would pass max_seq_len"):
            m.blocks_needed_to_append([0], n)
    with pytest.raises(ValueError, match=r"num_tokens = 33 .* \[0, 32\]"):
        m.blocks_needed_to_append([], 33)  # no sequence named: the count is still checked
    with pytest.raises(ValueError, match="cannot append -1 tokens"):
        m.blocks_needed_to_append([0], -1)
    with pytest.raises(ValueError, match="num_blocks = -1 must be >= 0"):
        m.can_allocate(-1)
    assert m.can_allocate(0) and m.can_allocate(m.num_free_blocks)
    assert not m.can_allocate(m.num_free_blocks + 1) and not m.can_allocate(I64 - 1)


def test_ids_past_int64_are_value_errors_and_never_members():
    m = manager()
    before = snapshot(m)
    for bad in (I64, -I64 - 1, 2**64):
        assert bad not in m
        for call in (lambda: m.add_sequence(bad, [1]), lambda: m.reserve(bad, 1), lambda: m.free(bad),
                     lambda: m.fork(0, bad), lambda: m.fork(bad, 9), lambda: m.seq_len(bad),
                     lambda: m.block_table(bad), lambda: m.append_tokens(bad, [1])):
            with pytest.raises(ValueError, match=rf"_id = {bad} does not fit in int64"):
                call()
        for call in (lambda: m.append_batch([bad], [1]), lambda: m.set_pending_tokens([bad], [1]),
                     lambda: m.blocks_needed_to_append([0, bad])):
            with pytest.raises(ValueError, match=rf"seq_ids\[\d\] = {bad} does not fit in int64"):
                call()
    assert snapshot(m) == before
    m.add_sequence(I64 - 1, [1])  # the int64 edges themselves are ids like any other
    m.fork(I64 - 1, -I64)
    assert m.seq_len(-I64) == 1 and -I64 in m


@pytest.mark.parametrize("call, message", [
    (lambda m: m.add_sequence(5, [1, -2]), r"token_ids\[1\] = -2 .* \[0, 2\^31 - 1\]"),
    (lambda m: m.add_sequence(5, [I32]), r"token_ids\[0\] = 2147483648 does not fit in int32"),
    (lambda m: m.append_tokens(0, [-5]), r"token_ids\[0\] = -5"),
    (lambda m: m.append_batch([0], [-2]), r"token_ids\[0\] = -2 .* -1 \(a pending token\)"),
    (lambda m: m.blocks_needed_to_add([4, -3]), r"token_ids\[1\] = -3"),
    (lambda m: m.ref_count(2**40), r"block 1099511627776 is not in \[0, 8\)"),
    (lambda m: m.ref_count(2**64), r"block = 18446744073709551616 does not fit in int64; allowed: \[0, num_blocks\)"),
    (lambda m: m.ref_count(-1), r"block -1 is not in \[0, 8\)"),
])
def test_bad_token_ids_and_blocks_name_the_value_and_range(call, message):
    m = manager()
    before = snapshot(m)
    with pytest.raises(ValueError, match=message):
        call(m)
    assert snapshot(m) == before


def test_bools_are_not_counts_or_ids():
    m = manager()
    before = snapshot(m)
    for call in (lambda: m.reserve(0, True), lambda: m.can_allocate(False), lambda: m.fork(True, 7),
                 lambda: m.blocks_needed_to_append([0], True), lambda: m.append_batch([True], [1]),
                 lambda: m.add_sequence(7, [True, 2]), lambda: _C.CacheManager(True, 4, 32)):
        with pytest.raises(TypeError, match="bool"):
            call()
    assert snapshot(m) == before


@pytest.mark.parametrize("args, message", [
    ((I32, 4, 32), "num_blocks = 2147483648 does not fit in int32"),
    ((8, 2**40, 32), "block_size = 1099511627776 does not fit in int32"),
    ((8, 4, I64), "max_seq_len = 9223372036854775808 does not fit in int64"),
    ((2**29, 8, 32), r"num_blocks \* block_size must be < 2\^31"),
    ((-1, 4, 32), "num_blocks must be >= 1"),
])
def test_constructor_sizes_that_do_not_fit(args, message):
    with pytest.raises(ValueError, match=message):
        _C.CacheManager(*args)


def test_step_layout_and_build_step_at_the_edges():
    with pytest.raises(ValueError, match="max_batch = 2147483648 does not fit in int32"):
        _C.StepLayout(I32, I32, 4)
    layout = _C.StepLayout(4, 16, 8)
    for bad in (-1, 5, I32):
        with pytest.raises(ValueError, match=f"padded_batch = {bad}"):
            layout.used_size(bad)
    m = manager()
    buffer = torch.zeros(layout.size, dtype=torch.int32)
    before = snapshot(m)
    for padded in (I32, I64, -I32 - 1):
        with pytest.raises(ValueError, match=f"padded_batch = {padded}"):
            m.build_step(layout, buffer, [0], None, padded)
    with pytest.raises(ValueError, match=r"query_lens\[0\] = 2147483647 .* must be in \[1, 3\]"):
        m.build_step(layout, buffer, [0], [I32 - 1], 1)
    with pytest.raises(ValueError, match="more than 4 rows"):
        m.build_step(layout, buffer, [0, 1, 2, 0, 1], None, 4)
    assert snapshot(m) == before


# -- every count and id, any int: works or raises, and the manager stays consistent ------------
def ops(target):
    """(name, strategy of args, call) for every method of a CacheManager or KVCache taking a count
    or an id; `target` is either."""
    m = target.manager if isinstance(target, KVCache) else target
    seq = st.one_of(st.sampled_from([0, 1, 2]), INTS)
    ids = st.lists(seq, max_size=4)
    if isinstance(target, KVCache):
        build = ("build_metadata", st.tuples(ids, st.one_of(st.none(), st.lists(INTS, max_size=4)),
                                             st.one_of(st.none(), INTS)),
                 lambda a: target.build_metadata(*a))
        extra = [("has_sequence", seq, target.has_sequence),
                 ("step_capacity_fits", st.tuples(INTS, INTS), lambda a: target.step_capacity_fits(*a))]
    else:
        layout = _C.StepLayout(4, 16, m.max_blocks_per_seq)
        buffer = torch.zeros(layout.size, dtype=torch.int32)
        build = ("build_step", st.tuples(ids, st.one_of(st.none(), st.lists(INTS, max_size=4)), INTS),
                 lambda a: m.build_step(layout, buffer, *a))
        extra = [("contains", seq, lambda s: s in m), ("ref_count", INTS, m.ref_count),
                 ("used_size", INTS, layout.used_size)]
    return [
        ("add_sequence", st.tuples(seq, TOKENS), lambda a: target.add_sequence(*a)),
        ("append_tokens", st.tuples(seq, TOKENS), lambda a: target.append_tokens(*a)),
        ("reserve", st.tuples(seq, INTS), lambda a: target.reserve(*a)),
        ("append_batch", st.tuples(ids, TOKENS), lambda a: target.append_batch(*a)),
        ("set_pending_tokens", st.tuples(ids, TOKENS), lambda a: target.set_pending_tokens(*a)),
        ("fork", st.tuples(seq, seq), lambda a: target.fork(*a)),
        ("free", seq, target.free),
        ("seq_len", seq, target.seq_len),
        ("block_table", seq, target.block_table),
        ("can_allocate", INTS, target.can_allocate),
        ("blocks_needed_to_add", TOKENS, target.blocks_needed_to_add),
        ("blocks_needed_to_append", st.tuples(ids, INTS), lambda a: target.blocks_needed_to_append(*a)),
        build, *extra,
    ]


def check_result(name, args, result, m, before) -> None:
    """What a call that worked returned is the unwrapped truth."""
    lens = {s: n for s, n, _ in before[0]}
    if name == "reserve":
        assert 0 <= args[1] and m.seq_len(args[0]) == lens[args[0]] + args[1] <= MAX_SEQ_LEN
    elif name == "can_allocate":
        assert result == (args <= m.num_free_blocks) and args >= 0
    elif name == "blocks_needed_to_append":
        assert 0 <= args[1] and all(lens[s] + args[1] <= MAX_SEQ_LEN for s in args[0])
        assert 0 <= result <= len(args[0]) * (m.max_blocks_per_seq + 1)
    elif name in ("add_sequence", "append_tokens", "blocks_needed_to_add"):
        assert all(0 <= t < I32 for t in (args if name == "blocks_needed_to_add" else args[1]))


@pytest.mark.parametrize("kind", ["manager", "kv_cache"])
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), prefix_caching=st.booleans())
def test_extreme_ints_work_or_raise_and_keep_the_manager_consistent(kind, data, prefix_caching):
    if kind == "manager":
        target = m = manager(prefix_caching)
    else:
        target = KVCache(1, 1, 8, dtype=torch.float32, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS,
                         device="cpu", max_seq_len=MAX_SEQ_LEN, max_batch_size=4, max_step_tokens=16,
                         enable_prefix_caching=prefix_caching)
        m = target.manager
        m.add_sequence(0, [1, 2, 3])
        m.add_sequence(1, [1, 2, 3, 4, 5])
        m.fork(1, 2)
    table = ops(target)
    for _ in range(data.draw(st.integers(1, 12))):
        name, args_strategy, call = data.draw(st.sampled_from(table))
        args = data.draw(args_strategy, label=name)
        before = snapshot(m)
        try:
            result = call(args)
        except REFUSALS:
            assert snapshot(m) == before, f"{name}{args} failed but changed the cache"
        else:
            check_result(name, args, result, m, before)
        check_consistent(m)


@given(num_blocks=INTS, block_size=INTS, max_seq_len=st.one_of(st.none(), INTS),
       max_batch_size=INTS, max_step_tokens=st.one_of(st.none(), INTS))
@settings(max_examples=200, deadline=None)
def test_kv_cache_sizes_work_or_raise(num_blocks, block_size, max_seq_len, max_batch_size,
                                      max_step_tokens):
    # Valid but large caches would allocate gigabytes here: only small valid ones are made.
    if 0 < num_blocks and 0 < block_size and 4096 < num_blocks * block_size < I32:
        return
    try:
        cache = KVCache(1, 1, 8, dtype=torch.float32, block_size=block_size, num_blocks=num_blocks,
                        device="cpu", max_seq_len=max_seq_len, max_batch_size=max_batch_size,
                        max_step_tokens=max_step_tokens)
    except ValueError:
        return
    assert 1 <= num_blocks and 1 <= block_size and num_blocks * block_size < I32
    seq_len = max_seq_len if max_seq_len is not None else num_blocks * block_size
    assert cache.manager.max_seq_len == seq_len
    step_tokens = max_step_tokens if max_step_tokens is not None else max(seq_len, max_batch_size)
    assert 1 <= max_batch_size <= step_tokens < I32
    if step_tokens <= 4096 and max_batch_size * cache.manager.max_blocks_per_seq <= 4096:
        cache.add_sequence(0, [1])
        cache.build_metadata([0])


def test_a_memory_budget_past_int32_slots_is_capped_not_refused():
    spec = KVCacheSpec(1, 1, 8, torch.float32, 16)
    assert num_blocks_for(spec, torch.device("cpu"), memory_bytes=2**70) == (I32 - 1) // 16
    assert num_blocks_for(spec, torch.device("cpu"), memory_bytes=5 * spec.bytes_per_block) == 5


# -- SamplingParams ---------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=True), "max_tokens must be an int >= 1, got True"),
    (dict(n=True), "n must be an int >= 1, got True"),
    (dict(top_k=True), "top_k must be an int >= -1"),
    (dict(top_k=-2), "top_k must be an int >= -1"),
    (dict(top_k=5.0), "top_k must be an int >= -1"),
    (dict(seed=True), "seed must be None or an int"),
    (dict(seed=2**62), r"seed must be None or an int in \[0, 2\*\*62\)"),
    (dict(seed=-1), "seed must be None or an int"),
    (dict(stop_token_ids=[1.5]), "stop_token_ids must be ints"),
    (dict(stop_token_ids=["3"]), "stop_token_ids must be ints"),
    (dict(stop_token_ids="12"), "stop_token_ids must be ints"),
    (dict(stop_token_ids=[True]), "stop_token_ids must be ints"),
    (dict(stop_token_ids=[I32]), r"stop_token_ids must be ints in \[0, 2\*\*31\)"),
    (dict(stop_token_ids=[-1]), r"stop_token_ids must be ints in \[0, 2\*\*31\)"),
    (dict(temperature=float("inf")), "temperature must be finite"),
    (dict(temperature=1e39), "temperature must be finite"),
])
def test_sampling_params_refuse_what_the_kernel_cannot_take(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_accept_ints_of_any_kind_and_huge_top_k():
    p = SamplingParams(stop_token_ids=[torch.tensor(3), 4], top_k=2**40, max_tokens=2**70, seed=2**62 - 1)
    assert p.stop_token_ids == (3, 4) and type(p.stop_token_ids[0]) is int
