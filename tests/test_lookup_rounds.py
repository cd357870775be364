"""Greedy prompt lookup with its rounds on the device (runtime/lookup_rounds.py): the tokens of
non-speculative greedy decoding with graphs on and off, captured rounds reused by later calls of
other prompts, batch sizes and max_new_tokens, padding rows of a batch bucket, an interrupt that
leaves nothing held, and draft models kept on the host-read rounds (sampling:
tests/test_lookup_sampling.py)."""

from __future__ import annotations

import pytest
import torch

import pagedkv
from conftest import DEVICES
from models import tiny_model
from pagedkv.runtime import fixed_batch, prompt_lookup
from recording_streamer import FailingStreamer, RecordingStreamer
from test_assistant_model import truncated
from test_prompt_lookup import GREEDY, assert_cache_empty, batch, stats, walk, walker

GRAPHS = [None, False]  # the default (graphs on CUDA) and eager rounds


def mixed_rows(model) -> list[list[int]]:
    """A row whose prompt holds the walk (accepted at once), one of noise, one with a wrong
    continuation first."""
    path = walk(model, 11, 12)
    torch.manual_seed(1)
    noise = torch.randint(3, 256, (20,)).tolist()
    return [path + noise + path[:1], noise, noise[:5] + path[3:5] + noise[5:9]]


def generate_both(model, rows, **kwargs):
    device = next(model.parameters()).device
    ids, mask = batch(rows)
    ids, mask = ids.to(device), mask.to(device)
    expected = pagedkv.generate(model, ids, attention_mask=mask, **kwargs)
    got = pagedkv.generate(model, ids, attention_mask=mask, prompt_lookup_num_tokens=kwargs.pop("k", 4),
                           **kwargs)
    return got, expected


@pytest.fixture
def no_host_rounds(monkeypatch):
    """Greedy prompt lookup must not fall back on the host-read rounds."""
    def refuse(*args, **kwargs):
        raise AssertionError("greedy prompt lookup ran runtime/prompt_lookup.py's host rounds")
    monkeypatch.setattr(fixed_batch, "run_prompt_lookup", refuse)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("graphs", GRAPHS)
def test_device_rounds_give_greedy_tokens(no_host_rounds, device, graphs):
    model = walker().to(device)
    rows = mixed_rows(model)
    for k, max_new, subset in ((4, 30, rows), (10, 30, rows), (4, 17, rows[1:]), (4, 30, rows[::2])):
        ids, mask = batch(subset)
        ids, mask = ids.to(device), mask.to(device)
        expected = pagedkv.generate(model, ids, attention_mask=mask, max_new_tokens=max_new, **GREEDY)
        got = pagedkv.generate(model, ids, attention_mask=mask, max_new_tokens=max_new,
                               prompt_lookup_num_tokens=k, use_cuda_graphs=graphs, **GREEDY)
        assert torch.equal(got, expected), (k, max_new, len(subset))
        s = stats(model)
        assert 0 < s.accepted <= s.proposed and s.rounds < max_new
        assert_cache_empty(model)


@pytest.mark.parametrize("device", DEVICES)
def test_chaotic_model_and_eos(no_host_rounds, device):
    """A random model (proposals mostly rejected: every round's first position decides), rows of
    different lengths ending at different EOS steps."""
    model = tiny_model("llama").to(device)
    torch.manual_seed(0)
    rows = [torch.randint(3, 256, (n,)).tolist() * 2 for n in (5, 17, 1, 33)]
    ids, mask = batch(rows)
    ids, mask = ids.to(device), mask.to(device)
    plain = pagedkv.generate(model, ids, attention_mask=mask, max_new_tokens=40, **GREEDY)
    eos = int(plain[1, 6])  # row 1 ends at its 7th token, the others where they meet it
    kwargs = dict(max_new_tokens=40, do_sample=False, eos_token_id=eos, pad_token_id=0, min_new_tokens=3)
    expected = pagedkv.generate(model, ids, attention_mask=mask, **kwargs)
    got = pagedkv.generate(model, ids, attention_mask=mask, prompt_lookup_num_tokens=3, **kwargs)
    assert torch.equal(got, expected)
    assert stats(model).proposed > 0
    assert_cache_empty(model)


@pytest.mark.parametrize("device", DEVICES)
def test_an_interrupt_leaves_nothing_held(no_host_rounds, device):
    model = walker().to(device)
    rows = mixed_rows(model)
    ids, mask = batch(rows)
    ids, mask = ids.to(device), mask.to(device)
    expected = pagedkv.generate(model, ids, attention_mask=mask, max_new_tokens=30, **GREEDY)

    streamer = FailingStreamer(3, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        pagedkv.generate(model, ids, attention_mask=mask, max_new_tokens=30, streamer=streamer,
                         prompt_lookup_num_tokens=4, **GREEDY)
    assert streamer.ended
    assert_cache_empty(model)
    got = pagedkv.generate(model, ids, attention_mask=mask, max_new_tokens=30, prompt_lookup_num_tokens=4, **GREEDY)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_the_streamer_gets_the_decode_steps_columns(no_host_rounds, device):
    model = walker().to(device)
    path = walk(model, 11, 8)
    ids, mask = batch([path + [40] + path[:1], [7] * 4 + path[:6]])
    ids, mask = ids.to(device), mask.to(device)
    runs = []
    for k in (None, 4):
        streamer = RecordingStreamer()
        pagedkv.generate(model, ids, attention_mask=mask, max_new_tokens=10, streamer=streamer,
                         prompt_lookup_num_tokens=k, do_sample=False, eos_token_id=path[5], pad_token_id=0)
        runs.append([t.tolist() for t in streamer.chunks])
    assert runs[0] == runs[1]


def test_draft_models_keep_the_host_rounds(monkeypatch):
    """Sampled prompt lookup runs on the device too (tests/test_lookup_sampling.py); a draft
    model's proposals of a "heuristic" schedule, greedy or sampled, are verified in the host-read
    rounds (a constant k's rounds run on the device: tests/test_draft_rounds.py)."""
    calls = []
    real = fixed_batch.run_prompt_lookup
    monkeypatch.setattr(fixed_batch, "run_prompt_lookup", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    model = walker()
    for do_sample in (False, True):
        pagedkv.generate(model, torch.tensor([[5, 6, 7, 5, 6]]), max_new_tokens=6, do_sample=do_sample,
                         assistant_model=truncated(model), num_assistant_tokens_schedule="heuristic")
    assert len(calls) == 2 and prompt_lookup.run_prompt_lookup is real
