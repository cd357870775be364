"""Beam search (num_beams > 1) against HF's own generate on tiny fp32 models (CPU): the same
sequences, sequences_scores, beam_indices and scores, for several left-padded prompts, length
penalties, early_stopping variants and EOS reached early; beams share their blocks (a
continued beam is a fork, never a copy of its whole sequence) and no block outlives a call."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

import pagedkv
from pagedkv.runtime.runner import ModelRunner
from conftest import DEVICES
from limits import assert_cache_clean, assert_generate_works, gen, model  # noqa: F401 (gen: fixture)
from models import tiny_model
from recording_streamer import RecordingStreamer


def hf(m, ids, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return type(m).generate(m, ids, **kwargs)


def batch(lengths, device="cpu", seed=0):
    """Left-padded input_ids and attention_mask [B, S] of random prompts of these lengths."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.int64)
    mask = torch.zeros(len(lengths), width, dtype=torch.int64)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(3, 256, (n,), generator=g)
        mask[row, width - n:] = 1
    return ids.to(device), mask.to(device)


def _close(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per pair of rows of a [R, V] and b [R', V]: max |a - b|, where -inf meets -inf as equal."""
    diff = (a[:, None] - b[None]).abs()
    diff[torch.isinf(a[:, None]) & (a[:, None] == b[None])] = 0
    return diff.amax(-1)  # [R, R']


def assert_same_output(got, expected, num_beams: int, atol: float = 1e-3):
    """HF's output, to fp32 tolerance. Two running beams whose scores differ by less than the
    forward's rounding (~1e-4 here) may trade places, so a step's beams are compared as a set
    per prompt, and beam_indices through what they select: each returned hypothesis' per-token
    scores gathered along its beam_indices (HF's compute_transition_scores)."""
    m = model()
    assert type(got) is type(expected)
    assert torch.equal(got.sequences.cpu(), expected.sequences.cpu())
    assert (got.sequences_scores is None) == (expected.sequences_scores is None)
    if got.sequences_scores is not None:
        torch.testing.assert_close(got.sequences_scores.cpu(), expected.sequences_scores.cpu(),
                                   atol=1e-4, rtol=1e-4)
    assert got.beam_indices.shape == expected.beam_indices.shape
    assert torch.equal(got.beam_indices.cpu() < 0, expected.beam_indices.cpu() < 0)
    for name in ("scores", "logits"):
        a, b = getattr(got, name), getattr(expected, name)
        assert (a is None) == (b is None), name
        if a is None:
            continue
        assert len(a) == len(b), name
        for x, y in zip(a, b):
            x, y = x.cpu().view(-1, num_beams, x.shape[-1]), y.cpu().view(-1, num_beams, y.shape[-1])
            for xs, ys in zip(x, y):  # one prompt's beams
                close = _close(xs, ys)
                assert close.amin(1).max() < atol and close.amin(0).max() < atol, name
    if got.scores is not None:
        # clamp: past a shorter hypothesis' end the fill may be -1 (no pad id), which HF's
        # function would index with (its positions are masked out by beam_indices -1)
        transitions = [m.compute_transition_scores(o.sequences.cpu().clamp(min=0), tuple(s.cpu() for s in o.scores),
                                                   o.beam_indices.cpu()) for o in (got, expected)]
        torch.testing.assert_close(*transitions, atol=atol, rtol=1e-4)


@functools.lru_cache(maxsize=None)
def free_run_token(arch: str, step: int) -> int:
    """A token HF's beam search picks at new position `step` of row 0 (made the EOS below, so
    that beams finish early)."""
    m = tiny_model(arch)
    ids, mask = batch([6, 11, 3])
    out = hf(m, ids, attention_mask=mask, num_beams=4, max_new_tokens=12, eos_token_id=None,
             do_sample=False)
    return int(out[0, ids.shape[1] + step])


CASES = [
    dict(num_beams=2),
    dict(num_beams=4, num_return_sequences=2),
    dict(num_beams=4, length_penalty=0.5, early_stopping=True),
    dict(num_beams=4, num_return_sequences=4, length_penalty=-1.0, early_stopping="never"),
    dict(num_beams=3, length_penalty=2.0, early_stopping="never"),
    dict(num_beams=2, num_return_sequences=2, early_stopping=False, repetition_penalty=1.3,
         min_new_tokens=4),
    # HF's processors of the processed path (hf/processing.py) run in beam search too
    dict(num_beams=3, no_repeat_ngram_size=2, bad_words_ids=[[7], [9, 10]]),
]


@pytest.mark.parametrize("kwargs", CASES, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()))
@pytest.mark.parametrize("arch, eos", [("llama", "none"), ("qwen2", "early")])
def test_beams_match_hf(arch, kwargs, eos):
    m = tiny_model(arch)
    ids, mask = batch([6, 11, 3])
    eos_ids = None if eos == "none" else [free_run_token(arch, 2), 2]
    args = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=eos_ids,
                pad_token_id=0, return_dict_in_generate=True, output_scores=True, output_logits=True,
                **kwargs)
    expected = hf(m, ids, **args)
    got = pagedkv.generate(m, ids, **args)
    assert_same_output(got, expected, kwargs["num_beams"])
    assert_cache_clean(pagedkv.kv_cache_of(m))


def test_eos_reached_early_shortens_the_output_like_hf():
    m = tiny_model("llama")
    ids, mask = batch([6, 11, 3])
    # A quarter of the vocabulary ends a beam: every prompt gets its 4 hypotheses within a few tokens.
    args = dict(attention_mask=mask, max_new_tokens=12, num_beams=4, early_stopping=True,
                eos_token_id=list(range(3, 67)), pad_token_id=0)
    expected = hf(m, ids, **args)
    assert expected.shape[1] < ids.shape[1] + 12  # the case: every row's beams ended early
    assert torch.equal(pagedkv.generate(m, ids, **args), expected)


@pytest.mark.parametrize("output_scores", [False, True])
def test_returned_structure_like_hf(output_scores):
    """sequences_scores and scores only with output_scores; beam_indices always (HF's choice)."""
    m = model()
    ids, mask = batch([5, 9])
    args = dict(attention_mask=mask, max_new_tokens=6, num_beams=3, return_dict_in_generate=True,
                output_scores=output_scores, eos_token_id=None)
    expected = hf(m, ids, **args)
    got = pagedkv.generate(m, ids, **args)
    assert_same_output(got, expected, 3)
    assert torch.equal(got.beam_indices, expected.beam_indices)  # no near-tie in this case
    assert sorted(k for k, v in got.items() if v is not None) == \
        sorted(k for k, v in expected.items() if v is not None and k not in ("cache", "past_key_values"))
    # HF's beam output holds its DynamicCache in transformers 5.17 (5.24 leaves it None): pagedkv
    # has none to give (docs/generate_arguments.md), and says so by None
    assert got.past_key_values is None


def test_plain_tensor_and_patched_generate(gen):
    ids, mask = batch([7, 4])
    args = dict(attention_mask=mask, max_new_tokens=8, num_beams=4, num_return_sequences=2,
                length_penalty=0.7, eos_token_id=None)
    expected = hf(model(), ids, **args)
    got = gen(ids, **args)
    assert torch.equal(got, expected)
    assert_generate_works(gen)


def test_beam_sampling_is_hf_with_the_same_seed():
    """do_sample=True with beams: HF's multinomial over the beams' scores, from torch's global
    RNG, so a seed reproduces a call and gives HF's tokens for the same seed."""
    m = model()
    ids, mask = batch([5, 9])
    args = dict(attention_mask=mask, max_new_tokens=8, num_beams=3, do_sample=True, top_k=20,
                temperature=1.3, eos_token_id=None)
    torch.manual_seed(7)
    expected = hf(m, ids, **args)
    torch.manual_seed(7)
    got = pagedkv.generate(m, ids, **args)
    torch.manual_seed(7)
    again = pagedkv.generate(m, ids, **args)
    assert torch.equal(got, expected) and torch.equal(got, again)


def test_beams_share_blocks(monkeypatch):
    """A 40-token prompt spans 2 full blocks and a partial one: 4 beams of it share the full
    blocks throughout (their own blocks: the partial one's copies and what they add)."""
    m = model()
    ids, mask = batch([40])
    used = []
    run = ModelRunner.run

    def counting_run(self, step):
        used.append(self.cache.num_blocks - self.cache.num_free_blocks)
        return run(self, step)

    monkeypatch.setattr(ModelRunner, "run", counting_run)
    args = dict(attention_mask=mask, max_new_tokens=8, num_beams=4, eos_token_id=None)
    got = pagedkv.generate(m, ids, **args)
    monkeypatch.undo()
    assert torch.equal(got, hf(m, ids, **args))
    unshared = 4 * -(-(40 + 8) // 16)  # 4 beams x 3 blocks each
    assert max(used) <= 2 + 4 < unshared  # 2 shared full blocks, one last block per beam
    assert_cache_clean(pagedkv.kv_cache_of(m))


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(num_beams=2, num_return_sequences=3), ValueError, r"num_return_sequences. \(3\) has to be smaller"),
    (dict(num_beams=4, num_beam_groups=2), ValueError, r"num_beam_groups"),
    (dict(num_beams=4, diversity_penalty=0.5), ValueError, r"diversity_penalty"),
    (dict(num_beams=2, force_words_ids=[[5]]), ValueError, r"force_words_ids"),
    (dict(num_beams=2, low_memory=True), ValueError, r"low_memory"),
    (dict(num_beams=2, do_sample=True, min_p=2.0), ValueError, r"pagedkv.generate: .*min_p"),
])
def test_refused_beam_settings_leave_generate_working(gen, kwargs, error, match):
    ids, mask = batch([4, 6])
    with pytest.raises(error, match=match):
        gen(ids, attention_mask=mask, max_new_tokens=3, **kwargs)
    assert_generate_works(gen)


def test_streamer_with_beams_is_refused_like_hf(gen):
    ids, mask = batch([4])
    with pytest.raises(ValueError, match="streamer.* cannot be used with beam search"):
        gen(ids, attention_mask=mask, max_new_tokens=3, num_beams=2, streamer=RecordingStreamer())
    assert_generate_works(gen)


def test_interrupted_beam_search_frees_its_blocks(gen, monkeypatch):
    calls = []
    run = ModelRunner.run

    def failing_run(self, step):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return run(self, step)

    monkeypatch.setattr(ModelRunner, "run", failing_run)
    ids, mask = batch([20, 7])
    with pytest.raises(KeyboardInterrupt):
        gen(ids, attention_mask=mask, max_new_tokens=6, num_beams=4, eos_token_id=None)
    monkeypatch.undo()
    assert_generate_works(gen)
    args = dict(attention_mask=mask, max_new_tokens=6, num_beams=4, eos_token_id=None)
    assert torch.equal(gen(ids, **args), hf(model(), ids, **args))


@pytest.mark.parametrize("device", DEVICES)
def test_beams_on_each_device(device):
    """The CUDA path runs the same eager steps (fp32, so the tokens are HF's)."""
    m = tiny_model("llama", device=device)
    ids, mask = batch([6, 13], device=device)
    args = dict(attention_mask=mask, max_new_tokens=10, num_beams=4, num_return_sequences=2,
                return_dict_in_generate=True, output_scores=True, eos_token_id=None)
    assert_same_output(pagedkv.generate(m, ids, **args), hf(m, ids, **args), 4)
    assert_cache_clean(pagedkv.kv_cache_of(m))


class _BanToken(LogitsProcessor):
    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores):
        scores[:, self.token] = -float("inf")
        return scores


class _StopAfter(StoppingCriteria):
    """Done when a row's last token is `token` (a user criterion in place of an EOS)."""

    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_user_processors_and_criteria_run_in_beam_search():
    m = model()
    ids, mask = batch([6, 11])
    free = hf(m, ids, attention_mask=mask, num_beams=3, max_new_tokens=8, eos_token_id=None)
    args = dict(attention_mask=mask, max_new_tokens=8, num_beams=3, eos_token_id=None,
                return_dict_in_generate=True, output_scores=True)
    expected = hf(m, ids, logits_processor=LogitsProcessorList([_BanToken(int(free[0, 12]))]),
                  stopping_criteria=StoppingCriteriaList([_StopAfter(int(free[1, 13]))]), **args)
    got = pagedkv.generate(m, ids, logits_processor=LogitsProcessorList([_BanToken(int(free[0, 12]))]),
                           stopping_criteria=StoppingCriteriaList([_StopAfter(int(free[1, 13]))]), **args)
    assert_same_output(got, expected, 3)
    assert_cache_clean(pagedkv.kv_cache_of(m))
