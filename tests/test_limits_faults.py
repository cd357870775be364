"""docs/limits.md's rows about faults while running (test_limits.py has the bad
inputs): out of cache blocks, a request cancelled mid-run, a streamer or stream consumer that
raises. After each: the exception arrived unchanged, no cache block is held, and the next valid
call equals HF's greedy tokens."""

from __future__ import annotations

import pytest
import torch

import pagedkv
import pagedkv.runtime.fixed_batch
from pagedkv import SamplingParams
from pagedkv.models.llama import PagedDecoder
from limits import (GREEDY, MAX_NEW, assert_generate_works, assert_llm_works, gen,
                    hf_greedy, model, new_llm, prompt)


class Boom(Exception):
    pass


class RaisingStreamer:
    """An HF-style streamer (put/end) whose put raises on its call number `at` (1 = the prompt)."""

    def __init__(self, at: int, error: BaseException):
        self.at, self.error, self.puts, self.ended = at, error, 0, False

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == self.at:
            raise self.error

    def end(self) -> None:
        self.ended = True


# -- out of cache blocks --------------------------------------------------------------------------
def test_out_of_blocks_generate_refused_before_any_work(gen, monkeypatch):
    """generate reserves every row's blocks up front: a batch whose cache does not fit the device
    is refused before the first forward."""
    cache = pagedkv.kv_cache_of(model())
    rows = (cache.num_blocks if cache is not None else 0) // 32 + 1  # more blocks than the cache has
    forwards = []
    original = PagedDecoder.forward
    monkeypatch.setattr(PagedDecoder, "forward", lambda self, *a, **k: forwards.append(1) or original(self, *a, **k))
    monkeypatch.setattr(pagedkv.runtime.fixed_batch, "free_memory_bytes", lambda device: 0)
    streamer = RaisingStreamer(at=0, error=Boom())
    with pytest.raises(pagedkv.CacheFull, match=rf"the batch needs {32 * rows} KV-cache blocks \(.* MiB: "
                                                rf"{rows} rows of up to 512 tokens, prompt \+ max_new_tokens\) "
                                                r"but cpu has .* MiB free; generate fewer rows or fewer new "
                                                r"tokens per call. Nothing was run."):
        gen(torch.tensor([prompt(8)] * rows), max_new_tokens=504, do_sample=False, streamer=streamer)
    assert forwards == [] and streamer.puts == 0
    assert isinstance(pagedkv.CacheFull("x"), RuntimeError)
    monkeypatch.undo()
    assert_generate_works(gen)


def test_out_of_blocks_llm_preempts():
    """The engine runs out of blocks in the middle of decoding: it preempts the newest sequence
    and recomputes it later, with the same tokens."""
    llm = new_llm(num_kv_blocks=6, max_num_batched_tokens=64)
    prompts = [prompt(n, seed=n) for n in (30, 21, 40, 17)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.stats.num_preemptions > 0
    assert [o.token_ids for o in outs] == [hf_greedy(p, 12) for p in prompts]
    assert_llm_works(llm)


def test_out_of_blocks_llm_request_filling_the_whole_cache():
    llm = new_llm(num_kv_blocks=4)  # 64 tokens: the longest request fills the cache alone
    prompts = [prompt(60, seed=1), prompt(30, seed=2), prompt(30, seed=3)]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert outs[0].finish_reason == "length" and outs[0].token_ids == hf_greedy(prompts[0], 4)
    assert [o.token_ids for o in outs[1:]] == [hf_greedy(p) for p in prompts[1:]]
    assert_llm_works(llm)


# -- a request cancelled mid-run ------------------------------------------------------------------
def test_abort_mid_run_llm():
    """Abort while running (after its fork into n samples), while waiting, and while preempted;
    the other requests' tokens are unchanged and nothing is held afterwards."""
    llm = new_llm(num_kv_blocks=6, max_num_seqs=4, max_num_batched_tokens=64)
    prompts = {f"r{i}": prompt(n, seed=10 + i) for i, n in enumerate((15, 20, 14, 30, 13, 12))}
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    n2 = SamplingParams(n=2, max_tokens=16, temperature=0, ignore_eos=True)
    for rid, p in prompts.items():
        llm.add_request(p, n2 if rid == "r1" else greedy, request_id=rid)
    aborted, finished, steps = {"r5"}, {}, 0
    llm.abort_request("r5")  # still waiting
    while llm.has_unfinished_requests():
        outs = llm.step()
        steps += 1
        assert not aborted & {o.request_id for o in outs}
        if steps == 2:
            assert len(llm._requests["r1"].sequences) == 2  # forked
            llm.abort_request("r1")
            aborted.add("r1")
        preempted = [s.request.request_id for s in llm.scheduler.waiting
                     if s.request.metrics.first_scheduled_time is not None]
        if preempted and len(aborted) < 3:
            llm.abort_request(preempted[0])
            aborted.add(preempted[0])
        finished.update({o.request_id: o for o in outs if o.finished})
        assert steps < 200
    assert llm.stats.num_preemptions > 0 and len(aborted) == 3, "no sequence was preempted"
    assert finished.keys() == prompts.keys() - aborted
    assert all(o.token_ids == hf_greedy(prompts[r], 16) for r, o in finished.items())
    llm.abort_request("r0")  # finished, and unknown ids: nothing happens
    llm.abort_request("nope")
    assert_llm_works(llm)


def test_stream_closed_early_or_aborted_inside_llm(monkeypatch):
    llm = new_llm()
    prompts = [prompt(9, seed=20), prompt(14, seed=21)]
    stream = llm.stream(prompts, GREEDY)
    next(stream)
    stream.close()  # the consumer leaves: its requests are aborted
    assert_llm_works(llm)
    steps = []
    original = llm._step

    def counted(partial, **kwargs):
        steps.append(1)
        assert len(steps) < 100, "the stream waits for a request that was aborted"
        return original(partial, **kwargs)

    monkeypatch.setattr(llm, "_step", counted)
    last = {}
    for out in llm.stream(prompts, GREEDY):  # aborting one of its own requests ends its stream
        last[out.request_id] = out
        if len(last) == 2 and not out.finished and "gone" not in last:
            llm.abort_request(out.request_id)
            last["gone"] = out.request_id
    gone = last.pop("gone")
    (rid, kept), = [(r, o) for r, o in last.items() if r != gone]
    assert kept.finished and kept.token_ids == hf_greedy(kept.prompt_token_ids)
    assert_llm_works(llm)


# -- a streamer (or stream consumer) that raises ---------------------------------------------------
@pytest.mark.parametrize("at", [1, 2, 4])
@pytest.mark.parametrize("error", [Boom("streamer failed"), KeyboardInterrupt()])
def test_streamer_raises_generate(gen, at, error):
    streamer = RaisingStreamer(at, error)
    with pytest.raises(type(error)) as raised:
        gen(torch.tensor([prompt(6)]), max_new_tokens=MAX_NEW, do_sample=False, streamer=streamer)
    assert raised.value is error and streamer.puts == at
    assert streamer.ended  # a TextIteratorStreamer's reader is released
    assert_generate_works(gen)


@pytest.mark.parametrize("error", [Boom("consumer failed"), KeyboardInterrupt()])
def test_stream_consumer_raises_llm(error):
    llm = new_llm()
    with pytest.raises(type(error)) as raised:
        for out in llm.stream([prompt(9, seed=30), prompt(3, seed=31)], GREEDY):
            if len(out.token_ids) == 2:
                raise error
    assert raised.value is error
    assert_llm_works(llm)


def test_step_fault_inside_generate_llm(monkeypatch):
    """A fault inside a step of LLM.generate (here an interrupt in the forward) reaches the
    caller unchanged, and generate aborts its requests."""
    llm = new_llm()
    calls = []
    original = llm._run

    def faulty(sched):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return original(sched)

    monkeypatch.setattr(llm, "_run", faulty)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([prompt(9, seed=40), prompt(30, seed=41)], GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert_llm_works(llm)


def test_step_fault_then_more_steps_llm(monkeypatch):
    """A step that fails after its slots were reserved (here the forward raises) must not leave
    them reserved: the caller may go on stepping, and every request still gets HF's tokens."""
    llm = new_llm(max_num_batched_tokens=16)  # chunked prefills and decodes in the failing steps
    prompts = [prompt(n, seed=50 + n) for n in (9, 30, 3)]
    ids = [llm.add_request(p, GREEDY) for p in prompts]
    original, calls = llm._run, []

    def faulty(sched):
        calls.append(1)
        if len(calls) in (2, 5):
            raise RuntimeError("device fault")
        return original(sched)

    monkeypatch.setattr(llm, "_run", faulty)
    finished, faults = {}, 0
    while llm.has_unfinished_requests():
        try:
            finished.update({o.request_id: o for o in llm.step() if o.finished})
        except RuntimeError as error:
            assert str(error) == "device fault"
            faults += 1
    assert faults == 2
    assert [finished[i].token_ids for i in ids] == [hf_greedy(p) for p in prompts]
    monkeypatch.undo()
    assert_llm_works(llm)
