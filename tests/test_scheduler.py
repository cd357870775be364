"""Scheduler policy on a CPU cache, without a model: budgets, chunking, decode-first,
preemption of the newest, FIFO admission, prefix hits."""

from __future__ import annotations

import torch

from pagedkv import KVCache, SamplingParams
from pagedkv.engine.outputs import RequestMetrics
from pagedkv.engine.request import Request, Sequence, Status
from pagedkv.engine.scheduler import ScheduledRow, Scheduler

BLOCK = 16


def make(num_blocks=16, max_num_seqs=4, budget=64):
    cache = KVCache(1, 1, 8, dtype=torch.float32, device="cpu", num_blocks=num_blocks,
                    block_size=BLOCK, max_seq_len=num_blocks * BLOCK, max_batch_size=max_num_seqs,
                    max_step_tokens=budget)
    return Scheduler(cache, max_num_seqs, budget)


_ids = iter(range(10**6))


def seq(n_tokens, start=3):
    ids = list(range(start, start + n_tokens))
    request = Request(str(next(_ids)), None, ids, SamplingParams(), 0, RequestMetrics(0.0))
    s = Sequence(next(_ids), request, 0, list(ids), len(ids))
    request.sequences.append(s)
    return s


def all_rows(step):
    """Every row of the step as ScheduledRow: decode rows first, then prefill chunks."""
    return [ScheduledRow(s, 1) for s in step.decodes] + step.prefills


def run(step, sampled_token=1):
    """What the engine does after a forward: advance, append a token to rows that sampled."""
    for row in all_rows(step):
        samples = row.samples
        row.seq.num_computed += row.num_new
        if samples:
            row.seq.token_ids.append(sampled_token)


def rows(step):
    return [(r.seq, r.num_new) for r in all_rows(step)]


def test_budget_chunks_a_long_prompt_and_decodes_go_first():
    sched = make(budget=16)
    a, b = seq(40), seq(5, start=100)
    sched.add(a)
    sched.add(b)
    step = sched.schedule()
    assert rows(step) == [(a, 16)]  # the budget is spent on a's first chunk
    run(step)
    step = sched.schedule()
    assert rows(step) == [(a, 16)]
    run(step)
    step = sched.schedule()
    assert rows(step) == [(a, 8), (b, 5)]  # a's last chunk samples; b admitted in the rest
    assert all_rows(step)[0].samples and all_rows(step)[1].samples
    run(step)
    step = sched.schedule()
    assert rows(step) == [(a, 1), (b, 1)] and len(step.decodes) == 2
    assert sched.cache.seq_len(a.seq_id) == 41


def test_max_num_seqs_limits_admission():
    sched = make(max_num_seqs=2)
    seqs = [seq(4, start=10 * i) for i in range(3)]
    for s in seqs:
        sched.add(s)
    step = sched.schedule()
    assert [r.seq for r in all_rows(step)] == seqs[:2]
    assert list(sched.waiting) == seqs[2:]


def test_out_of_blocks_preempts_the_newest_and_requeues_it_first():
    sched = make(num_blocks=4, budget=64)
    old, new = seq(31), seq(32, start=200)  # 2 blocks each; the cache is then full
    sched.add(old)
    sched.add(new)
    run(sched.schedule())
    assert sched.cache.num_free_blocks == 0
    step = sched.schedule()  # new's decode token needs a 5th block: the newest (new) goes
    assert step.preempted == [new] and rows(step) == [(old, 1)]
    assert new.status is Status.WAITING and not new.in_cache and new.num_computed == 0
    assert list(sched.waiting) == [new] and sched.running == [old]
    assert not sched.cache.has_sequence(new.seq_id)


def test_waiting_blocked_by_blocks_stays_fifo():
    sched = make(num_blocks=3, budget=64)
    big, small = seq(40), seq(3, start=300)
    sched.add(seq(20, start=500))
    sched.add(big)
    sched.add(small)
    step = sched.schedule()
    assert len(all_rows(step)) == 1  # big needs 3 blocks, 1 is left; small waits behind it
    assert list(sched.waiting) == [big, small]


def test_prefix_hits_are_not_scheduled_again():
    sched = make(budget=64)
    a = seq(40)
    sched.add(a)
    run(sched.schedule())
    b = seq(40)  # the same 40 tokens: 32 are cached (two full blocks)
    sched.add(b)
    step = sched.schedule()
    assert (b, 8) in rows(step) and step.num_cached_tokens == 32
    assert b.request.num_cached_prompt_tokens == 32
