"""Callers on several threads (issue 29, threads): generate() on one model and one pagedkv.LLM
shared by threads give each caller the tokens it gets alone (calls on one model or engine run one
at a time), and leave nothing behind (tiny random models, CPU)."""

from __future__ import annotations

import threading

import pytest
import torch

import pagedkv
from conftest import DEVICES
from pagedkv import LLM, SamplingParams
from test_engine import assert_no_leaks, hf_greedy, model, random_prompts

THREADS = 4


def run_threads(target, args_per_thread):
    """Start one thread per args tuple at once; returns their results (re-raises the first error)."""
    results: list = [None] * len(args_per_thread)
    errors: list = []
    start = threading.Barrier(len(args_per_thread))

    def work(i, args):
        try:
            start.wait()
            results[i] = target(*args)
        except BaseException as error:  # noqa: BLE001 - handed to the main thread
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i, a)) for i, a in enumerate(args_per_thread)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("device", DEVICES)
def test_generate_from_several_threads_on_one_model(device):
    # On CUDA each call captures and replays decode graphs: one call at a time per model.
    m = model().to(device)
    prompts = random_prompts([9, 23, 14, 31], seed=41)

    def call(prompt):
        ids = torch.tensor([prompt], device=device)
        for _ in range(3):
            out = pagedkv.generate(m, ids, max_new_tokens=10, do_sample=False)
        return out[0, len(prompt):].tolist()

    alone = [call(p) for p in prompts]
    if device == "cpu":
        assert alone == [hf_greedy("llama", tuple(p), 10) for p in prompts]
    assert run_threads(call, [(p,) for p in prompts]) == alone
    cache = pagedkv.kv_cache_of(m)
    assert cache.num_free_blocks == cache.num_blocks


@pytest.mark.parametrize("device", DEVICES)
def test_one_engine_shared_by_threads(device):
    llm = LLM(model().to(device), max_num_seqs=8, **({"kv_cache_memory": 64 << 20} if device == "cuda" else {}))
    prompts = random_prompts([9, 23, 14, 31, 6, 17, 28, 11], seed=42)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)

    def batch(pair):
        return [o.token_ids for o in llm.generate(pair, params, use_tqdm=False)]

    def streamed(pair):
        done = {o.request_id: o.token_ids for o in llm.stream(pair, params) if o.finished}
        return list(done.values())

    pairs = [prompts[i:i + 2] for i in range(0, 8, 2)]
    alone = [sorted(batch(pair)) for pair in pairs]
    if device == "cpu":
        assert alone == [sorted(hf_greedy("llama", tuple(p), 10) for p in pair) for pair in pairs]
    results = run_threads(lambda i, pair: (batch if i % 2 else streamed)(pair),
                          [(i, pair) for i, pair in enumerate(pairs)])
    assert [sorted(got) for got in results] == alone
    assert_no_leaks(llm)


def test_requests_added_by_one_thread_while_another_steps():
    llm = LLM(model(), max_num_seqs=4)
    prompts = random_prompts([9, 23, 14, 31, 6, 17], seed=43)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    added = threading.Event()
    finished: dict[str, list[int]] = {}

    def producer():
        for i, p in enumerate(prompts):
            llm.add_request(p, params, request_id=str(i))
        added.set()

    def consumer():
        while not added.is_set() or llm.has_unfinished_requests():
            for out in llm.step():
                if out.finished:
                    finished[out.request_id] = out.token_ids

    run_threads(lambda f: f(), [(producer,), (consumer,)])
    assert finished == {str(i): hf_greedy("llama", tuple(p), 8) for i, p in enumerate(prompts)}
    assert_no_leaks(llm)
