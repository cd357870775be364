"""generate(prompt_lookup_num_tokens=k): greedy prompt-lookup speculative decoding gives pagedkv's
non-speculative greedy tokens, token for token (fp32, CPU), with proposals really accepted.

Two tiny models: a widened random Llama (chaotic: proposals are almost always rejected, so every
round's first position, computed over slots that held rejected tokens before, decides the tokens)
and the same with each attention output projection zeroed, whose next token is a function of the
current token alone: its greedy walk is known in advance, so prompts that hold the walk make
proposals that are accepted, and EOS or max_new_tokens can be put inside an accepted run."""

from __future__ import annotations

import random

import pytest
import torch

import pagedkv
from models import tiny_model
from pagedkv.hf.generation_config import UnsupportedGenerationArgument
from pagedkv.runtime.model import PREPARED_ATTR
from pagedkv.runtime.prompt_lookup import propose
from recording_streamer import FailingStreamer, RecordingStreamer

GREEDY = dict(do_sample=False, eos_token_id=None)


def walker():
    """A model whose greedy next token depends on the current token only (no attention output)."""
    model = tiny_model("llama")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    return model


def walk(model, start: int, n: int) -> list[int]:
    """start and the n greedy tokens after it."""
    device = next(model.parameters()).device
    out = pagedkv.generate(model, torch.tensor([[start]], device=device), max_new_tokens=n, **GREEDY)
    return out[0].tolist()


def stats(model):
    return getattr(model, PREPARED_ATTR).fixed_batch.last_prompt_lookup


def assert_cache_empty(model):
    cache = pagedkv.kv_cache_of(model)
    assert len(cache.manager) == 0 and cache.num_free_blocks == cache.num_blocks


def batch(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded input_ids and attention_mask [len(rows), longest]."""
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.int64)
    mask = torch.zeros(len(rows), width, dtype=torch.int64)
    for r, row in enumerate(rows):
        ids[r, width - len(row):] = torch.tensor(row)
        mask[r, width - len(row):] = 1
    return ids, mask


def check_same(model, rows, **kwargs):
    ids, mask = batch(rows)
    expected = pagedkv.generate(model, ids, attention_mask=mask, **kwargs)
    got = pagedkv.generate(model, ids, attention_mask=mask, **kwargs, prompt_lookup_num_tokens=4)
    assert torch.equal(got, expected)
    assert_cache_empty(model)
    return got


def test_propose_is_hf_prompt_lookup():
    assert propose([5, 6, 7, 8, 5, 6], 3, 2) == [7, 8, 5]  # the 2-gram 5 6 first
    assert propose([1, 6, 9, 5, 6, 2, 6], 2, 2) == [9, 5]  # no 2-gram: the first 1-gram 6
    assert propose([1, 2, 3], 4, 2) == []
    assert propose([4, 4], 4, 3) == [4]  # the continuation stops at the row's end


def test_ngram_index_proposes_what_the_scan_does():
    """NgramIndex (what generate's rounds use) against propose's scan, on random rows of a small
    vocabulary (many repeats) grown a few tokens at a time, for n-gram sizes 1..4 and k 1..5."""
    from pagedkv.runtime.prompt_lookup import NgramIndex

    rng = random.Random(0)
    for case in range(200):
        max_ngram, vocab = rng.randint(1, 4), rng.randint(2, 6)
        index, tokens = NgramIndex(max_ngram), []
        for _ in range(rng.randint(1, 12)):
            grown = [rng.randrange(vocab) for _ in range(rng.randint(1, 5))]
            tokens += grown
            index.extend(grown)
            k = rng.randint(1, 5)
            assert index.propose(k) == propose(tokens, k, max_ngram), (case, tokens, k, max_ngram)


@pytest.mark.parametrize("lengths", [[7], [5, 17, 1, 33]])
def test_rejected_proposals_change_nothing(lengths):
    model = tiny_model("llama")
    torch.manual_seed(0)
    rows = [torch.randint(3, 256, (n,)).tolist() * 2 for n in lengths]  # repeats: proposals
    check_same(model, rows, max_new_tokens=40, **GREEDY)
    assert stats(model).proposed > 0


def test_accepted_runs_in_a_batch_of_mixed_acceptance():
    model = walker()
    path = walk(model, 11, 12)
    torch.manual_seed(1)
    noise = torch.randint(3, 256, (20,)).tolist()
    rows = [path + noise + path[:1],  # the walk is in the prompt: accepted at once
            noise,  # proposals from its own output only
            noise[:5] + path[3:5] + noise[5:9]]  # a wrong continuation first
    check_same(model, rows, max_new_tokens=30, **GREEDY)
    s = stats(model)
    assert 0 < s.accepted < s.proposed  # some accepted, some rejected
    assert s.rounds < 30


def test_eos_inside_an_accepted_run():
    model = walker()
    path = walk(model, 11, 6)
    assert len(set(path[:4])) == 4, path
    # EOS is the second token of a run of 3 accepted (+ 1): the row ends there and pads
    got = check_same(model, [path[:4] + [40, 41, 42] + path[:1]], max_new_tokens=12, do_sample=False, eos_token_id=path[2], pad_token_id=0)
    assert got[0, 8:].tolist() == path[1:3]
    assert stats(model).accepted >= 1 and stats(model).rounds == 1


def test_max_new_tokens_inside_an_accepted_run():
    model = walker()
    path = walk(model, 11, 6)
    got = check_same(model, [path + [40, 41] + path[:1]], max_new_tokens=4, **GREEDY)
    assert got[0, -4:].tolist() == path[1:5]
    assert stats(model).accepted == 2 and stats(model).rounds == 1


def test_min_new_tokens_inside_an_accepted_run():
    """EOS is suppressed position by position: an accepted EOS at new token 2 < min_new_tokens
    is not the greedy token there, so the run breaks and the row goes on as a decode step would."""
    model = walker()
    path = walk(model, 11, 6)
    rows = [path[:5] + [40, 41] + path[:1]]
    for min_new in (0, 2, 3):
        check_same(model, rows, max_new_tokens=8, do_sample=False, eos_token_id=path[2],
                   pad_token_id=0, min_new_tokens=min_new)
        assert stats(model).rounds >= 1


def test_the_prefix_cache_holds_the_fed_tokens_only():
    """After a call whose rounds truncated rejected tokens, a next turn's prompt (prompt + reply +
    more) that finds the call's blocks in the prefix cache gives a fresh cache's tokens."""
    model = tiny_model("llama")
    torch.manual_seed(3)
    prompt = torch.randint(3, 256, (21,)).tolist() * 2
    first = pagedkv.generate(model, torch.tensor([prompt]), max_new_tokens=40, prompt_lookup_num_tokens=4,
                             **GREEDY)[0].tolist()
    assert stats(model).proposed > stats(model).accepted
    # every full block of the fed tokens (all but the last new one) is keyed, and nothing more
    assert pagedkv.kv_cache_of(model).manager.num_evictable_blocks == (len(first) - 1) // 16
    turn = first + [7, 8, 9]
    again = pagedkv.generate(model, torch.tensor([turn]), max_new_tokens=12, **GREEDY)
    fresh = tiny_model("llama")
    assert pagedkv.generate(fresh, torch.tensor([prompt]), max_new_tokens=40, **GREEDY)[0].tolist() == first
    assert torch.equal(again, pagedkv.generate(tiny_model("llama"), torch.tensor([turn]), max_new_tokens=12,
                                               **GREEDY))  # nothing cached
    assert_cache_empty(model)


def test_streamer_gets_the_decode_steps_columns():
    model = walker()
    path = walk(model, 11, 8)
    ids, mask = batch([path + [40] + path[:1], [7] * 4 + path[:6]])
    runs = []
    for k in (None, 4):
        streamer = RecordingStreamer()
        pagedkv.generate(model, ids, attention_mask=mask, max_new_tokens=10, streamer=streamer,
                         prompt_lookup_num_tokens=k, **GREEDY)
        runs.append([t.tolist() for t in streamer.chunks])
    assert runs[0] == runs[1]


def test_an_error_frees_every_block():
    model = walker()
    pagedkv.generate(model, torch.tensor([[5, 6, 7]]), max_new_tokens=4, **GREEDY)

    with pytest.raises(RuntimeError, match="streamer failed"):
        pagedkv.generate(model, torch.tensor([[5, 6, 7, 5, 6, 7, 5]]), max_new_tokens=20,
                         streamer=FailingStreamer(3, RuntimeError("streamer failed")), prompt_lookup_num_tokens=3, **GREEDY)
    assert_cache_empty(model)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(prompt_lookup_num_tokens=0), ValueError, "prompt_lookup_num_tokens=0"),
    (dict(prompt_lookup_num_tokens=-2), ValueError, "prompt_lookup_num_tokens=-2"),
    (dict(prompt_lookup_num_tokens=3, max_matching_ngram_size=0), ValueError, "max_matching_ngram_size=0"),
    (dict(prompt_lookup_num_tokens=3, repetition_penalty=1.2), UnsupportedGenerationArgument,
     "repetition_penalty"),
    (dict(prompt_lookup_num_tokens=3, num_beams=2), UnsupportedGenerationArgument, "num_beams"),
    (dict(prompt_lookup_num_tokens=3, suppress_tokens=[5]), UnsupportedGenerationArgument, "suppress_tokens"),
    (dict(prompt_lookup_num_tokens=3, return_dict_in_generate=True, output_scores=True),
     UnsupportedGenerationArgument, "output_scores"),
])
def test_what_is_not_supported_is_refused(kwargs, error, match):
    model = tiny_model("llama")
    with pytest.raises(error, match=match):
        pagedkv.generate(model, torch.tensor([[5, 6, 7]]), max_new_tokens=4, **kwargs)
