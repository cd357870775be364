"""Interrupts anywhere in the engine (issue 29): a KeyboardInterrupt at any line of the step path
(pagedkv's engine/, runtime/ and cache/ Python code; tests/interrupts.py injects it with
sys.settrace) leaves pagedkv.LLM and pagedkv.generate consistent. After it, stepping on (or a new
call) gives exactly the tokens of an uninterrupted run, greedy and seeded sampling alike; every
request finishes and reports its output once; no cache block stays held; and a later identical
prompt (a prefix-cache hit) gets the same tokens, never K/V that were reserved but not written.

Each scenario runs once to count its line events, then once per interrupt point: the first and
the last event of every distinct line plus a seeded random sample (PAGEDKV_INTERRUPT_ALL=1: every
event; about 15 minutes), each in a thread of its own (tests/interrupts.py in_thread says why).
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch

import pagedkv
import pagedkv.runtime.model
from conftest import DEVICES
from pagedkv import LLM, RequestOutput, SamplingParams
from interrupts import Interrupter, in_thread, interrupt_points
from models import tiny_model
from test_engine import assert_no_leaks, hf_greedy, random_prompts

MAX_NEW = 5
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)


@functools.lru_cache(maxsize=None)
def workload() -> list[tuple[str, list[int], SamplingParams]]:
    """(request id, prompt, params): a shared opening (prefix hits), prompts longer than the step
    budget (chunks), n = 2 (a fork), a stop token, seeded sampling; with new_llm()'s small cache
    the engine preempts."""
    shared = random_prompts([20], seed=60)[0]
    a, b, c, d = (shared + t for t in random_prompts([13, 2, 24, 7], seed=61))
    stop = hf_greedy("llama", tuple(c), MAX_NEW)[2]
    return [
        ("a", a, GREEDY),
        ("b", b, SamplingParams(n=2, max_tokens=MAX_NEW, temperature=0, ignore_eos=True)),
        ("c", c, SamplingParams(max_tokens=MAX_NEW, temperature=0, stop_token_ids=[stop], ignore_eos=True)),
        ("d", d, SamplingParams(max_tokens=MAX_NEW, temperature=0.9, top_k=20, seed=7, ignore_eos=True)),
        ("e", random_prompts([9], seed=62)[0], GREEDY),
    ]


@functools.lru_cache(maxsize=None)
def model(device: str = "cpu"):
    return tiny_model("llama", device=device)  # test_engine's model, on its own copy per device


def new_llm(device: str = "cpu") -> LLM:
    # On CUDA: CUDA graphs (the default), so interrupts also hit their capture.
    return LLM(model(device), num_kv_blocks=8, block_size=8, max_num_seqs=4, max_num_batched_tokens=24)


def tokens_of(out) -> list[list[int]]:
    return [c.token_ids for c in out.outputs]


def step_loop(llm: LLM, tracer: Interrupter | None = None) -> dict[str, list[list[int]]]:
    """Add the workload's requests and step until none is left, going on after an interrupt as a
    caller would. Each finished output must arrive exactly once. (Its tokens are read after the
    tracer stops: an interrupt while the caller reads an output it holds is the caller's.)"""
    added: set[str] = set()
    done: dict[str, RequestOutput] = {}
    while True:
        try:
            with tracer or contextlib.nullcontext():
                for rid, prompt, params in workload():
                    if rid not in added:
                        try:
                            llm.add_request(prompt, params, request_id=rid)
                        except ValueError as error:  # interrupted after it was queued
                            assert "already in use" in str(error)
                        added.add(rid)
                while llm.has_unfinished_requests():
                    for out in llm.step():
                        if out.finished:
                            assert out.request_id not in done, "a finished output came twice"
                            done[out.request_id] = out
            return {rid: tokens_of(out) for rid, out in done.items()}
        except KeyboardInterrupt:
            assert tracer is not None and tracer.fired


def batch(llm: LLM, api: str) -> list[RequestOutput]:
    """The workload through generate() or stream() (finished outputs)."""
    prompts = [p for _, p, _ in workload()]
    params = [sp for _, _, sp in workload()]
    if api == "generate":
        return llm.generate(prompts, params, use_tqdm=False)
    return [o for o in llm.stream(prompts, params) if o.finished]


def by_id(outputs: list[RequestOutput]) -> dict[str, list[list[int]]]:
    """batch()'s outputs keyed by the workload's request ids, as step_loop's are."""
    rid_of = {tuple(p): rid for rid, p, _ in workload()}
    return {rid_of[tuple(o.prompt_token_ids)]: tokens_of(o) for o in outputs}


@functools.lru_cache(maxsize=None)
def expected(overlap: bool, device: str = "cpu") -> dict[str, list[list[int]]]:
    """The uninterrupted run's tokens (greedy ones checked against HF on the CPU)."""
    llm = new_llm(device)
    done = step_loop(llm)
    for rid, prompt, params in workload():
        if params.temperature == 0 and not params.stop_token_ids and device == "cpu":
            assert done[rid] == [hf_greedy("llama", tuple(prompt), MAX_NEW)] * params.n
    assert llm.stats.num_preemptions > 0 and llm.stats.num_cached_prompt_tokens > 0
    return done


def check_after(llm: LLM, done: dict[str, list[list[int]]], overlap: bool, where) -> None:
    want = expected(overlap, llm.device.type)
    assert done == want, f"interrupted at {where}"
    assert_no_leaks(llm)
    # A later identical prompt reads the prefix cache: its blocks must hold the K/V of their tokens.
    rid, prompt, params = workload()[0]
    again = llm.generate(prompt, params, use_tqdm=False)[0]
    assert tokens_of(again) == want[rid], f"prefix hit after an interrupt at {where}"
    assert_no_leaks(llm)


def count_events(run) -> list[tuple[str, int]]:
    tracer = Interrupter()
    with tracer:
        run()
    return tracer.sites


@pytest.fixture(autouse=True)
def _one_thread():
    # Hundreds of short runs of a tiny model: more threads only add overhead.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("api", ["step", "generate", "stream"])
def test_interrupt_at_every_line_of_the_engine(api, engine_overlap, device):
    """The workload through step() (stepping on after the interrupt), generate() or stream()
    (called again), with the engine stepping serially and overlapped (conftest.engine_overlap)."""
    overlap = engine_overlap
    llm = new_llm(device)
    sites = count_events(lambda: step_loop(llm) if api == "step" else batch(llm, api))
    failures = []
    # On CUDA every run captures its graphs again: each line once, no random extra.
    for at in interrupt_points(sites, sample=40 if device == "cpu" else 0):
        llm = new_llm(device)
        tracer = Interrupter(at)
        try:  # in a thread of its own: an interrupt may leave an exception handled there for good
            in_thread(functools.partial(run_interrupted, llm, api, tracer, overlap), timeout=30)
        except Exception as error:  # noqa: BLE001 - every broken point is reported
            failures.append(f"{tracer.where}: {type(error).__name__}: {str(error).splitlines()[0][:160]}")
    assert not failures, f"{len(failures)} interrupt points broke the engine:\n" + "\n".join(failures[:30])


def run_interrupted(llm: LLM, api: str, tracer: Interrupter, overlap: bool) -> None:
    """The workload with an interrupt (step_loop goes on stepping; generate and stream are
    called again), then check_after."""
    if api == "step":
        done = step_loop(llm, tracer)
    else:
        try:
            with tracer:
                outputs = batch(llm, api)
        except KeyboardInterrupt:
            outputs = batch(llm, api)
        done = by_id(outputs)
    check_after(llm, done, overlap, tracer.where)


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fresh", [False, True], ids=["warm", "fresh"])
@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampled"])
def test_interrupt_at_every_line_of_pagedkv_generate(do_sample, fresh, device):
    """pagedkv.generate (runtime/fixed_batch.py): after an interrupt anywhere, the cache holds no
    row (unless the interrupt hit the cleanup itself: then the next call frees them) and the next
    call gives the same tokens. fresh: each call starts without generate's cache and runner (on
    CUDA: without its graphs)."""
    m = model(device)
    ids, mask = (t.to(device) for t in left_padded(random_prompts([7, 19, 12], seed=63)))

    def call() -> torch.Tensor:
        if fresh:
            pagedkv.runtime.model.prepared(m).fixed_batch = None
        torch.manual_seed(5)  # do_sample draws the rows' seeds from torch's generator
        return pagedkv.generate(m, ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=do_sample,
                                top_k=20, pad_token_id=0)

    want = call()
    if not do_sample and device == "cpu":
        assert want[:, ids.shape[1]:].tolist() == [hf_greedy("llama", tuple(p), MAX_NEW)
                                                    for p in random_prompts([7, 19, 12], seed=63)]
    call()  # the first call with the earlier call's prefix-cache hits makes its step views once
    sites = count_events(call)
    failures = []

    def interrupted(tracer: Interrupter) -> None:
        try:
            with tracer:
                call()
        except KeyboardInterrupt:
            pass
        cache = pagedkv.kv_cache_of(m)
        # Only an interrupt of the clean-up itself may leave rows, for the next call to free.
        if cache is not None and "free_all" not in tracer.stack[:3] and tracer.where[1] != "generate":
            assert len(cache.manager) == 0, "rows left in generate's cache"
        assert torch.equal(call(), want), "the next call's tokens differ"
        cache = pagedkv.kv_cache_of(m)
        assert len(cache.manager) == 0 and cache.num_free_blocks == cache.num_blocks

    for at in interrupt_points(sites, sample=40 if device == "cpu" else 0):
        tracer = Interrupter(at)
        try:  # in a thread of its own, as in test_interrupt_at_every_line_of_the_engine
            in_thread(functools.partial(interrupted, tracer), timeout=30)
        except Exception as error:  # noqa: BLE001 - every broken point is reported
            failures.append(f"{tracer.where}: {type(error).__name__}: {str(error).splitlines()[0][:160]}")
    assert not failures, f"{len(failures)} interrupt points broke generate:\n" + "\n".join(failures[:30])
