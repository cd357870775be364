"""generate(prompt_lookup_num_tokens=k, do_sample=True) with every round on the device
(runtime/lookup_rounds.py): each fed position draws what a plain decode step draws there
(ops.sample with the row's seed at offset = the token's index), so one seed gives the tokens of
non-speculative sampling, through rows of mixed acceptance, min_new_tokens, EOS and max_new_tokens
inside accepted runs; the distribution apart from that (chi-square over many rows, other seeds);
a seed reproduces a call; NaN logits raise with nothing held, as does an interrupt; the streamer's
columns; CUDA with graphs on and off, captured rounds reused by calls of other sampling settings."""

from __future__ import annotations

import pytest
import torch

import pagedkv
from conftest import DEVICES
from models import tiny_model
from pagedkv.runtime import fixed_batch
from pagedkv.runtime.model import PREPARED_ATTR
from recording_streamer import FailingStreamer, RecordingStreamer
from test_lookup_rounds import mixed_rows
from test_prompt_lookup import assert_cache_empty, batch, stats, walk, walker
from test_prompt_lookup_sampling import P_MIN, SAMPLE, two_sample_p

# (device, use_cuda_graphs): CUDA with graphs (the default) and eager rounds; the CPU's are eager
RUNS = [("cpu", None)] + [pytest.param("cuda", g, marks=pytest.mark.cuda) for g in (None, False)]


@pytest.fixture(autouse=True)
def no_host_rounds(monkeypatch):
    """Sampled prompt lookup must not fall back on runtime/prompt_lookup.py's host-read rounds."""
    def refuse(*args, **kwargs):
        raise AssertionError("sampled prompt lookup ran runtime/prompt_lookup.py's host rounds")
    monkeypatch.setattr(fixed_batch, "run_prompt_lookup", refuse)


def on(device, rows):
    ids, mask = batch(rows)
    return ids.to(device), mask.to(device)


def plain_and_lookup(model, rows, seed: int, k: int = 4, graphs=None, **kwargs):
    """(non-speculative sampling's tokens, prompt lookup's) of rows, each call after manual_seed(seed)."""
    ids, mask = on(next(model.parameters()).device, rows)
    torch.manual_seed(seed)
    plain = pagedkv.generate(model, ids, attention_mask=mask, **kwargs)
    torch.manual_seed(seed)
    got = pagedkv.generate(model, ids, attention_mask=mask, prompt_lookup_num_tokens=k,
                           use_cuda_graphs=graphs, **kwargs)
    assert_cache_empty(model)
    return plain, got


# (seed, k, max_new_tokens, temperature, top_k, top_p)
SETTINGS = ((0, 4, 30, 0.5, 0, 1.0), (1, 10, 30, 0.8, 6, 0.9), (2, 3, 17, 0.3, 0, 0.8), (3, 4, 30, 1.0, 0, 1.0))


def test_a_seed_gives_the_tokens_of_plain_sampling():
    """Rows of mixed acceptance (the walk in the prompt, noise, a wrong continuation first). On
    the CPU a verified position's logits are bit-equal to a decode step's, so the draws are too.
    (On CUDA a k + 1-row product rounds otherwise than a 1-row one, and the walker's planted ties
    turn that into other draws: there a captured round is checked against the eager one below.)"""
    model = walker()
    rows = mixed_rows(model)
    for seed, k, max_new, temperature, top_k, top_p in SETTINGS:
        plain, got = plain_and_lookup(model, rows, seed, k, max_new_tokens=max_new,
                                      temperature=temperature, top_k=top_k, top_p=top_p, **SAMPLE)
        assert torch.equal(got, plain), (seed, k)
        s = stats(model)
        assert 0 < s.accepted < s.proposed and s.rounds < max_new, (seed, s)


@pytest.mark.cuda
def test_captured_rounds_draw_what_eager_rounds_draw():
    """Same kernels, so the same seed gives the same tokens with graphs (captured, then replayed
    by the later calls) and without."""
    model = walker().cuda()
    ids, mask = on("cuda", mixed_rows(model))
    for seed, k, max_new, temperature, top_k, top_p in SETTINGS:
        runs = []
        for graphs in (None, False):
            torch.manual_seed(seed)
            runs.append(pagedkv.generate(model, ids, attention_mask=mask, prompt_lookup_num_tokens=k,
                                         max_new_tokens=max_new, temperature=temperature, top_k=top_k,
                                         top_p=top_p, use_cuda_graphs=graphs, **SAMPLE))
        assert torch.equal(runs[0], runs[1]), (seed, k)
        s = stats(model)
        assert 0 < s.accepted < s.proposed and s.rounds < max_new, (seed, s)
    assert_cache_empty(model)


def test_first_and_later_tokens_follow_non_speculative_sampling():
    """2000 identical rows sampled with and without prompt lookup under other seeds: new tokens
    1-2 jointly, token 3 and token 5 agree in distribution (two-sample chi-square)."""
    model = walker()
    path = walk(model, 11, 8)
    torch.manual_seed(1)
    noise = torch.randint(3, 256, (9,)).tolist()
    ids = torch.tensor([path[:6] + noise + path[:1]] * 2000)  # the walk in the prompt: accepted runs
    settings = dict(max_new_tokens=5, temperature=0.8, top_k=6, top_p=0.95, **SAMPLE)
    torch.manual_seed(2)
    plain = pagedkv.generate(model, ids, **settings)[:, -5:].tolist()
    torch.manual_seed(3)
    spec = pagedkv.generate(model, ids, prompt_lookup_num_tokens=3, **settings)[:, -5:].tolist()
    s = stats(model)
    assert 0 < s.accepted < s.proposed
    assert two_sample_p([tuple(r[:2]) for r in plain], [tuple(r[:2]) for r in spec]) > P_MIN
    for i in (2, 4):
        assert two_sample_p([r[i] for r in plain], [r[i] for r in spec]) > P_MIN, i
    assert_cache_empty(model)


@pytest.mark.parametrize("device, graphs", RUNS)
def test_a_seed_reproduces_a_call(device, graphs):
    """Also across a call that captured its round and one that replays it."""
    model = walker().to(device)
    ids, mask = on(device, mixed_rows(model))
    runs = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed)
        runs.append(pagedkv.generate(model, ids, attention_mask=mask, max_new_tokens=20, temperature=1.5,
                                     prompt_lookup_num_tokens=3, use_cuda_graphs=graphs, **SAMPLE))
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
    assert_cache_empty(model)


@pytest.mark.parametrize("device", DEVICES)
def test_min_new_tokens_and_eos(device):
    """A random model (proposals mostly rejected), rows of different lengths ending at EOS at
    different steps, EOS suppressed position by position below min_new_tokens."""
    model = tiny_model("llama").to(device)
    torch.manual_seed(0)
    rows = [torch.randint(3, 256, (n,)).tolist() * 2 for n in (5, 17, 1, 33)]
    kwargs = dict(max_new_tokens=24, temperature=0.7, do_sample=True, pad_token_id=0)
    ids, mask = batch(rows)
    torch.manual_seed(4)
    row = pagedkv.generate(model, ids.to(device), attention_mask=mask.to(device), eos_token_id=None,
                           **kwargs)[1, ids.shape[1]:].tolist()
    eos = row[6]  # row 1 ends at its 7th token, the others where they meet it
    assert eos not in row[:6], row
    for min_new in (0, 3, 8):
        plain, got = plain_and_lookup(model, rows, 4, 3, eos_token_id=eos, min_new_tokens=min_new, **kwargs)
        assert torch.equal(got, plain), min_new
        assert stats(model).proposed > 0
        row = got[1, ids.shape[1]:].tolist()
        assert (row[6] == eos and set(row[7:]) <= {0}) == (min_new < 7), (min_new, row)  # unless suppressed


@pytest.mark.parametrize("device", DEVICES)
def test_eos_and_max_new_tokens_inside_an_accepted_run(device):
    """top_k=1 (a point-mass target, drawn by the sampled round): the greedy walk, accepted."""
    model = walker().to(device)
    path = walk(model, 11, 6)
    assert len(set(path[:4])) == 4, path
    point = dict(do_sample=True, temperature=0.7, top_k=1)
    plain, got = plain_and_lookup(model, [path[:4] + [40, 41, 42] + path[:1]], 0, max_new_tokens=12,
                                  eos_token_id=path[2], pad_token_id=0, **point)
    assert torch.equal(got, plain) and got[0, 8:].tolist() == path[1:3]  # EOS second of the run
    assert stats(model).rounds == 1
    plain, got = plain_and_lookup(model, [path + [40, 41] + path[:1]], 0, max_new_tokens=4,
                                  eos_token_id=None, **point)
    assert torch.equal(got, plain) and got[0, -4:].tolist() == path[1:5]
    assert stats(model).accepted == 2 and stats(model).rounds == 1


@pytest.mark.parametrize("device, graphs", RUNS)
def test_nan_logits_inside_a_round_raise_and_leave_nothing_held(device, graphs):
    """Row 0 walks into a token whose embedding is NaN (every logit after it NaN) while row 1 goes
    on: the round that draws there raises, naming row 0, and every block is free."""
    model = walker().to(device)
    path = walk(model, 11, 8)
    noise = [7] * 4 + [9, 8, 5]
    ids, mask = on(device, [path[:3] + [40, 41] + path[:1], noise])
    point = dict(max_new_tokens=30, do_sample=True, top_k=1, eos_token_id=None)
    clean = pagedkv.generate(model, ids, attention_mask=mask, **point)
    bad = path[3]  # row 0's 3rd new token: drawn in the first round, fed by the second
    assert bad not in clean[1].tolist() and bad not in path[:3], (path, clean)
    with torch.no_grad():
        model.model.embed_tokens.weight[bad] = float("nan")
    streamer = RecordingStreamer()
    with pytest.raises(RuntimeError, match=r"row\(s\) \[0\] .*NaN or infinite logits"):
        pagedkv.generate(model, ids, attention_mask=mask, prompt_lookup_num_tokens=4, streamer=streamer,
                         use_cuda_graphs=graphs, **point)
    assert streamer.ended and all(-1 not in chunk.tolist() for chunk in streamer.chunks)
    assert_cache_empty(model)


@pytest.mark.parametrize("device", DEVICES)
def test_nan_logits_at_the_first_token_raise(device):
    model = walker().to(device)
    with torch.no_grad():
        model.lm_head.weight[9] = float("nan")
    with pytest.raises(RuntimeError, match="NaN or infinite logits"):
        pagedkv.generate(model, torch.tensor([[5, 6, 7, 5, 6]], device=device), max_new_tokens=6,
                         prompt_lookup_num_tokens=3, **SAMPLE)
    assert_cache_empty(model)


@pytest.mark.parametrize("device", DEVICES)
def test_an_interrupt_leaves_nothing_held(device):
    model = walker().to(device)
    rows = mixed_rows(model)
    ids, mask = on(device, rows)

    streamer = FailingStreamer(3, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        pagedkv.generate(model, ids, attention_mask=mask, max_new_tokens=30, streamer=streamer,
                         prompt_lookup_num_tokens=4, **SAMPLE)
    assert streamer.ended
    assert_cache_empty(model)
    plain, got = plain_and_lookup(model, rows, 5, max_new_tokens=30, **SAMPLE)
    assert torch.equal(got, plain)


@pytest.mark.parametrize("device", DEVICES)
def test_the_streamer_gets_plain_sampling_s_columns(device):
    model = walker().to(device)
    path = walk(model, 11, 8)
    ids, mask = on(device, [path + [40] + path[:1], [7] * 4 + path[:6]])
    runs = []
    for k in (None, 4):
        streamer = RecordingStreamer()
        torch.manual_seed(6)
        pagedkv.generate(model, ids, attention_mask=mask, max_new_tokens=10, streamer=streamer,
                         prompt_lookup_num_tokens=k, do_sample=True, temperature=0.5, eos_token_id=path[5],
                         pad_token_id=0)
        runs.append([t.tolist() for t in streamer.chunks])
    assert runs[0] == runs[1]


@pytest.mark.cuda
def test_captured_rounds_are_reused_by_other_sampling_settings():
    """Temperature, top-k and top-p are read from the round's buffers: one captured round serves
    calls of different settings; greedy rounds are captured apart."""
    model = walker().cuda()
    rows = mixed_rows(model)
    ids, mask = on("cuda", rows)
    for seed, settings in enumerate((dict(temperature=0.7), dict(temperature=1.3, top_k=5, top_p=0.9),
                                     dict(temperature=0.4, top_p=0.7))):
        runs = []
        for graphs in (None, False):  # replayed (captured by the first setting), then eager
            torch.manual_seed(seed)
            runs.append(pagedkv.generate(model, ids, attention_mask=mask, max_new_tokens=30,
                                         prompt_lookup_num_tokens=4, use_cuda_graphs=graphs, **settings, **SAMPLE))
        assert torch.equal(runs[0], runs[1]), settings
    greedy = pagedkv.generate(model, ids, attention_mask=mask, max_new_tokens=30, do_sample=False,
                              eos_token_id=None)
    got = pagedkv.generate(model, ids, attention_mask=mask, max_new_tokens=30, do_sample=False,
                           eos_token_id=None, prompt_lookup_num_tokens=4)
    assert torch.equal(got, greedy)
    rounds = getattr(model, PREPARED_ATTR).fixed_batch._lookup._rounds
    assert sorted(key.do_sample for key, _ in rounds) == [False, True]
