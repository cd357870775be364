"""num_return_sequences > 1 with sampling, against HF's own generate on tiny fp32 models: HF
expands each prompt n times (rows r*n .. r*n+n-1) and samples each row on its own. pagedkv
prefills each prompt once and forks its blocks into the other n - 1 rows (copy-on-write), so
the prompt's K/V are computed and stored once."""

from __future__ import annotations

import pytest
import torch

import pagedkv
from pagedkv.runtime import fixed_batch
from pagedkv.runtime.runner import ModelRunner
from conftest import DEVICES
from limits import assert_cache_clean, assert_generate_works, gen, model  # noqa: F401 (gen: fixture)
from models import tiny_model
from recording_streamer import RecordingStreamer
from test_hf_beams import batch, hf


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kwargs", [
    dict(num_return_sequences=3),
    dict(num_return_sequences=2, repetition_penalty=1.3, min_new_tokens=5),
])
def test_rows_match_hf_where_sampling_is_deterministic(device, kwargs):
    """top_k=1 leaves one token to draw: each row must be HF's row, EOS and padding included."""
    m = tiny_model("qwen2", device=device)
    ids, mask = batch([6, 11, 3], device=device)
    free_run = hf(m, ids, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=None)
    args = dict(attention_mask=mask, max_new_tokens=10, do_sample=True, top_k=1,
                eos_token_id=[int(free_run[1, ids.shape[1] + 3]), 2], pad_token_id=0, **kwargs)
    expected = hf(m, ids, **args)
    got = pagedkv.generate(m, ids, **args)
    assert got.shape == expected.shape == (3 * kwargs["num_return_sequences"], ids.shape[1] + 10)
    assert torch.equal(got, expected)
    assert_cache_clean(pagedkv.kv_cache_of(m))


@pytest.mark.parametrize("device", DEVICES)
def test_rows_are_sampled_independently_and_a_seed_reproduces_them(device):
    m = tiny_model("llama", device=device)
    ids, mask = batch([5, 9], device=device)
    args = dict(attention_mask=mask, max_new_tokens=12, do_sample=True, temperature=1.5,
                num_return_sequences=4, eos_token_id=None)
    torch.manual_seed(3)
    first = pagedkv.generate(m, ids, **args)
    torch.manual_seed(3)
    again = pagedkv.generate(m, ids, **args)
    assert torch.equal(first, again)
    assert torch.equal(first[:, :ids.shape[1]], ids.repeat_interleave(4, dim=0))  # HF's layout
    for r in range(2):  # a prompt's 4 rows drew 4 different continuations
        rows = first[4 * r: 4 * r + 4, ids.shape[1]:]
        assert len({tuple(row.tolist()) for row in rows}) == 4
    assert_cache_clean(pagedkv.kv_cache_of(m))


def test_prompt_runs_once_and_rows_share_its_blocks(monkeypatch):
    """A 40-token prompt (2 full blocks and a partial one) and 4 rows of 8 new tokens: one
    prefill of 40 tokens, and 2 shared blocks + 4 x 1 own block, not 4 x 3."""
    m = model()
    ids, mask = batch([40], seed=123)  # a prompt no earlier call left in the prefix cache
    steps, used = [], []
    run = ModelRunner.run

    def recording_run(self, step):
        steps.append(len(step.token_ids))
        used.append(self.cache.num_blocks - self.cache.num_free_blocks)
        return run(self, step)

    monkeypatch.setattr(ModelRunner, "run", recording_run)
    read_back = fixed_batch.read_back

    def recording_read_back(*args, **kwargs):
        cache = pagedkv.kv_cache_of(m)
        used.append(cache.num_blocks - cache.num_free_blocks)
        return read_back(*args, **kwargs)

    monkeypatch.setattr(fixed_batch, "read_back", recording_read_back)
    out = pagedkv.generate(m, ids, attention_mask=mask, max_new_tokens=8, do_sample=True,
                           num_return_sequences=4, eos_token_id=None)
    monkeypatch.undo()
    assert out.shape == (4, 48)
    assert steps == [40]  # the prefill; the decode steps are captured, not runner.run
    assert max(used) == 2 + 4 < 4 * 3
    assert_cache_clean(pagedkv.kv_cache_of(m))


def test_processed_path_rows_match_hf_for_a_seed():
    """With a setting of HF's processors (min_p) and scores asked for, rows draw as HF's do
    (torch.multinomial over the [B * n, V] rows), so a seed gives HF's tokens and scores."""
    m = model()
    ids, mask = batch([4, 7])
    args = dict(attention_mask=mask, max_new_tokens=6, do_sample=True, min_p=0.05, num_return_sequences=3,
                eos_token_id=None, return_dict_in_generate=True, output_scores=True)
    torch.manual_seed(11)
    expected = hf(m, ids, **args)
    torch.manual_seed(11)
    got = pagedkv.generate(m, ids, **args)
    assert torch.equal(got.sequences, expected.sequences)
    assert len(got.scores) == len(expected.scores)
    for a, b in zip(got.scores, expected.scores):
        assert a.shape == b.shape == (6, m.config.vocab_size)
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-4)
    assert_cache_clean(pagedkv.kv_cache_of(m))


def test_streamer_sees_the_expanded_rows_like_hf():
    m = model()
    ids, mask = batch([5])
    recorder = RecordingStreamer()
    out = pagedkv.generate(m, ids, attention_mask=mask, max_new_tokens=4, do_sample=True,
                           num_return_sequences=2, eos_token_id=None, streamer=recorder)
    assert torch.equal(recorder.chunks[0], ids.repeat_interleave(2, dim=0))  # as HF puts them
    assert torch.equal(torch.stack(recorder.chunks[1:], dim=1), out[:, 5:])


def test_greedy_rows_are_refused_like_hf(gen):
    ids, mask = batch([4, 6])
    with pytest.raises(ValueError, match="Greedy methods .* do not support `num_return_sequences`"):
        gen(ids, attention_mask=mask, max_new_tokens=3, num_return_sequences=2)
    with pytest.raises(ValueError, match="num_return_sequences=0; it must be >= 1"):
        gen(ids, attention_mask=mask, max_new_tokens=3, do_sample=True, num_return_sequences=0)
    assert_generate_works(gen)


def test_patched_generate_returns_rows(gen):
    ids, mask = batch([3, 8])
    args = dict(attention_mask=mask, max_new_tokens=5, do_sample=True, top_k=1, num_return_sequences=2,
                eos_token_id=None)
    assert torch.equal(gen(ids, **args), hf(model(), ids, **args))
    assert_generate_works(gen)
