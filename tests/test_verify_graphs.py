"""Speculative verification steps padded to one width a row (runner.run_rows_of: the shape a CUDA
graph per batch bucket and width replays; on CUDA by default, PAGEDKV_VERIFY_GRAPHS=0 turns it off;
the fixture turns it on for the CPU too, where the padded step runs eagerly): the tokens of
non-speculative decoding, every slot given back, and the step metadata's padding rows of that
width."""

from __future__ import annotations

import pytest
import torch

import pagedkv
from conftest import DEVICES
from pagedkv.cache import KVCache
from pagedkv.runtime import runner as runner_module
from pagedkv.runtime.prompt_lookup import lookup_room, verification_width
from test_assistant_model import assert_draft_empty, target, truncated
from test_prompt_lookup import GREEDY, assert_cache_empty, batch, stats, walk, walker


@pytest.fixture
def padded_verification(monkeypatch):
    """Runners built from here on pad verification steps (and capture them on CUDA)."""
    monkeypatch.setattr(runner_module, "verify_graphs_wanted", lambda device: True)


def mixed_rows(model) -> list[list[int]]:
    path = walk(model, 11, 12)
    torch.manual_seed(1)
    noise = torch.randint(3, 256, (20,)).tolist()
    return [path + noise + path[:1], noise, noise[:5] + path[3:5] + noise[5:9]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", [2, 4, 10])
def test_prompt_lookup_padded_gives_greedy_tokens(padded_verification, device, k):
    model = walker().to(device)
    ids, mask = batch(mixed_rows(model))
    ids, mask = ids.to(device), mask.to(device)
    expected = pagedkv.generate(model, ids, attention_mask=mask, max_new_tokens=30, **GREEDY)
    got = pagedkv.generate(model, ids, attention_mask=mask, max_new_tokens=30, prompt_lookup_num_tokens=k, **GREEDY)
    assert torch.equal(got, expected)
    s = stats(model)
    assert 0 < s.accepted < s.proposed
    assert_cache_empty(model)
    runner = pagedkv.kv_cache_of(model)  # the runner padded: its cache kept room for the padding
    assert runner is not None


@pytest.mark.parametrize("device", DEVICES)
def test_assistant_model_padded_gives_greedy_tokens(padded_verification, device):
    model = target(device)
    draft = truncated(model)
    torch.manual_seed(0)
    rows = [torch.randint(3, 256, (n,)).tolist() for n in (5, 12, 3, 8)]
    ids, mask = batch(rows)
    ids, mask = ids.to(device), mask.to(device)
    expected = pagedkv.generate(model, ids, attention_mask=mask, max_new_tokens=20, **GREEDY)
    got = pagedkv.generate(model, ids, attention_mask=mask, max_new_tokens=20, assistant_model=draft,
                           num_assistant_tokens=3, **GREEDY)
    assert torch.equal(got, expected)
    assert 0 < stats(model).accepted
    assert_cache_empty(model)
    assert_draft_empty(draft)


def test_widths_and_room():
    assert [verification_width(n) for n in (1, 2, 4, 5, 6, 8, 9, 11, 32, 40)] == [1, 2, 4, 5, 6, 8, 12, 12, 32, 40]
    assert lookup_room(0, 3) == (0, 0)
    assert lookup_room(10, 3) == (11, 4 * 12)  # k + 1 = 11 -> width 12; 3 rows -> a bucket of 4


def test_padding_rows_of_a_width():
    cache = KVCache(num_layers=1, num_kv_heads=1, head_dim=8, num_blocks=8, block_size=16,
                    dtype=torch.float32, device="cpu", max_batch_size=4, max_step_tokens=64)
    cache.add_sequence(1, list(range(10)))
    meta = cache.build_metadata([1], [3], padded_batch=4, pad_query_len=3)
    assert meta.num_tokens == 12
    assert meta.query_start_loc.tolist() == [0, 3, 6, 9, 12]
    assert meta.context_lens.tolist() == [10, 0, 0, 0]
    assert meta.slot_mapping[3:].tolist() == [-1] * 9
    with pytest.raises(ValueError, match="pad_query_len = 0 must be >= 1"):
        cache.build_metadata([1], [3], padded_batch=4, pad_query_len=0)
    with pytest.raises(ValueError, match="padding rows of 30 tokens exceed max_tokens 64"):
        cache.build_metadata([1], [3], padded_batch=4, pad_query_len=30)


def _models():
    import test_fallback
    import test_gemma
    from models import tiny_model
    return {"llama": lambda: tiny_model("llama"), "qwen3": lambda: tiny_model("qwen3"),
            "gemma2 (window 8, softcaps)": lambda: test_gemma.tiny("gemma2"),
            "gpt_neox (fallback)": lambda: test_fallback.tiny("gpt_neox")}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(_models()))
def test_tokens_as_decode_rows_equal_the_prefill_shaped_step(name, device):
    """run_rows_of runs each token of a verification row as a decode row of its own: the logits of
    the prefill-shaped step (paged prefill attention over query_start_loc) to fp32 rounding, for
    each decoder (a window shorter than the context, softcaps, HF's own modules), rows of several
    lengths, padded to a bucket on CUDA."""
    from pagedkv.runtime.model import prepared
    from pagedkv.runtime.runner import ModelRunner, StepInput

    model = _models()[name]().to(device)
    state = prepared(model)
    w = state.weights
    cache = KVCache(len(w.layers), w.num_kv_heads, w.head_dim, dtype=state.dtype, device=state.device,
                    block_size=16, num_blocks=16, max_seq_len=state.max_positions,
                    enable_prefix_caching=False, max_batch_size=256, max_step_tokens=256)
    eager = ModelRunner(state, cache, use_cuda_graphs=False)
    graphs = ModelRunner(state, cache, use_cuda_graphs=device == "cuda")
    width, lengths = 5, [3, 21, 12]  # contexts past the window of 8
    torch.manual_seed(0)
    with torch.inference_mode():
        prompts = [torch.randint(3, 256, (n,)).tolist() for n in lengths]
        for sid, prompt in enumerate(prompts):
            cache.add_sequence(sid, prompt)
        eager.run(StepInput([0, 1, 2], sum(prompts, []), lengths))
        feed = torch.randint(3, 256, (3 * width,)).tolist()
        for sid in range(3):
            cache.append_tokens(sid, feed[sid * width:(sid + 1) * width])
        step = StepInput([0, 1, 2], feed, [width] * 3)
        expected = eager.run(step).float()  # [3 * width, V]
        for runner in (eager, graphs, graphs):  # graphs twice: the capture, then a replay
            got = runner.run_rows_of(step, width).float()
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    for sid in range(3):
        cache.free(sid)
