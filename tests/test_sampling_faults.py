"""A step that fails leaves no stale sampling state (issue 29, item 5): the engine's per-row
sampling tensors are written for a step before it may fail, and its fast path for an unchanged
batch (SamplingBatch.repeats) reuses them. After a fault inside the sampler, or while its rows
are being written, the requests that go on get exactly the seeded tokens of a run without the
fault. Also: a top_k past int32 samples exactly as top_k off (the kernel keeps every token for
top_k >= vocab), where it used to fail its step."""

from __future__ import annotations

import functools

import pytest
import torch

from conftest import DEVICES
from models import tiny_model
from pagedkv import LLM, SamplingParams
from pagedkv.engine.sampling_batch import SamplingBatch
from pagedkv.runtime.sampler import Sampler



@functools.lru_cache(maxsize=None)
def model(device: str):
    return tiny_model("llama", device=device)


def prompts():
    g = torch.Generator().manual_seed(21)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in (7, 19, 4)]


def params(top_k: int = 0):
    """Seeded; the batch changes as requests end (the rows are rewritten, not repeated)."""
    return [SamplingParams(max_tokens=n, temperature=0.9, top_k=k, top_p=p, seed=40 + i, ignore_eos=True)
            for i, (n, k, p) in enumerate([(10, top_k, 1.0), (5, 50, 0.9), (8, 0, 0.8)])]


def run(device: str, sampling=None, faults: int = 0) -> list[list[int]]:
    """Tokens of each request; steps that raise are stepped over (they must raise `faults` times)."""
    llm = LLM(model(device), max_num_seqs=4, num_kv_blocks=32)
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts(), sampling or params())]
    done, seen = {}, 0
    while llm.has_unfinished_requests():
        try:
            done.update({o.request_id: o.token_ids for o in llm.step() if o.finished})
        except RuntimeError as error:
            assert str(error) == "injected fault"
            seen += 1
    assert seen == faults
    assert llm.cache.num_free_blocks == llm.cache.num_blocks
    return [done[i] for i in ids]


@pytest.mark.usefixtures("engine_overlap")  # serially and overlapped
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("at", [1, 2, 4, 7])  # the first sample, a repeated batch's, later ones
def test_fault_inside_the_sampler_then_same_tokens(device, at, monkeypatch):
    expected = run(device)
    original, calls = Sampler.__call__, []

    def faulty(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == at:
            raise RuntimeError("injected fault")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Sampler, "__call__", faulty)
    assert run(device, faults=1) == expected


@pytest.mark.usefixtures("engine_overlap")  # serially and overlapped
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("at", [1, 2, 3])
def test_fault_while_writing_the_rows_then_same_tokens(device, at, monkeypatch):
    """set_rows fails halfway (as it did for a top_k past int32): rows already written with
    wrong seeds and offsets must not be reused by the next step."""
    expected = run(device)
    original, calls = Sampler.set_rows, []

    def faulty(self, temperatures, top_k, top_p, seeds, offsets):
        calls.append(1)
        if len(calls) == at:
            original(self, temperatures, top_k, top_p, [s + 1 for s in seeds], [o + 3 for o in offsets])
            raise RuntimeError("injected fault")
        return original(self, temperatures, top_k, top_p, seeds, offsets)

    monkeypatch.setattr(Sampler, "set_rows", faulty)
    assert run(device, faults=1) == expected


@pytest.mark.usefixtures("engine_overlap")  # serially and overlapped
@pytest.mark.parametrize("device", DEVICES)
def test_top_k_past_int32_samples_as_top_k_off(device):
    assert run(device, params(top_k=2**31)) == run(device, params(top_k=0))
    assert run(device, params(top_k=2**63)) == run(device, params(top_k=256))  # = vocab: off too


def test_sampler_clamps_top_k_to_int32_for_generate():
    sampler = Sampler(2, torch.device("cpu"))
    sampler.fill(1.0, 2**40, 1.0)
    assert sampler.top_k.tolist() == [2**31 - 1] * 2


class FakeSeq:
    """What SamplingBatch reads of a Sequence (compared by identity, like Sequence)."""

    def __init__(self, seed: int, top_k: int = 0):
        self.request = type("R", (), {"params": SamplingParams(temperature=0.9, top_k=top_k)})()
        self.seed, self.num_output, self.pending = seed, 0, 0


def test_sampling_batch_repeats_only_after_a_step_that_sampled():
    """On its own, without the engine's repair: a step whose samples never became pending (it
    failed after prepare) is not repeated; one whose samples did is."""
    batch = SamplingBatch(Sampler(4, torch.device("cpu")), vocab_size=256)
    seqs = [FakeSeq(1), FakeSeq(2)]
    batch.prepare(seqs, 1, repeat=False)
    assert not batch.repeats(seqs, 2)  # step 1 failed: no sample pending
    batch.prepare(seqs, 2, repeat=False)
    for s in seqs:
        s.pending += 1  # step 2 sampled (LaunchedStep.sampled)
    assert batch.repeats(seqs, 3)
    batch.prepare(seqs, 3, repeat=True)
    assert batch.sampler.offsets[:2].tolist() == [1, 1]
    assert not batch.repeats(seqs, 4)  # step 3 failed after moving the offsets on


def test_rows_that_do_not_fit_leave_the_sampler_as_it_was():
    sampler = Sampler(4, torch.device("cpu"))
    sampler.set_rows([0.5, 0.7], [3, 4], [0.9, 1.0], [11, 12], [5, 6])
    before = [t.clone() for t in (sampler.temperatures, sampler.top_k, sampler.top_p, sampler.seeds,
                                  sampler.offsets)]
    with pytest.raises((RuntimeError, OverflowError, ValueError)):
        sampler.set_rows([0.0, 0.0, 0.8], [1, 2, 3], [1.0, 1.0, 1.0], [1, 2, 2**64], [0, 0, 0])
    after = (sampler.temperatures, sampler.top_k, sampler.top_p, sampler.seeds, sampler.offsets)
    assert all(torch.equal(a, b) for a, b in zip(before, after)) and not sampler.all_greedy
    batch = SamplingBatch(sampler, vocab_size=256)
    seqs = [FakeSeq(1), FakeSeq(2)]
    batch.prepare(seqs, 1, repeat=False)
    seqs[1].seed = 2**64  # a row that cannot be written: the next step must not repeat the batch
    with pytest.raises((RuntimeError, OverflowError, ValueError)):
        batch.prepare(seqs, 2, repeat=False)
    for s in seqs:
        s.pending += 1
    assert not batch.repeats(seqs, 3)
