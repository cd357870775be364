"""generate(assistant_model=draft) with the "constant" schedule runs every round on the device
(runtime/draft_rounds.py): greedy, the tokens of non-speculative greedy decoding; sampled, one seed
gives the tokens of non-speculative sampling (each position draws its decode step's draw), the
distribution apart from that; the draft proposes exactly what the host-read rounds' draft proposes
(the same counts of proposed and accepted tokens); EOS, max_new_tokens and min_new_tokens inside
accepted runs; errors and interrupts leave both caches empty; "heuristic" schedules keep the host
rounds; on CUDA graphs on and off, captured rounds replayed by later calls and captured again for
a new draft cache.

Pairs (tests/test_assistant_model.py): a target whose second layer is damped with its one-layer
copy as draft (accepted and rejected proposals), an unrelated random draft (mostly rejected), and
the target's exact copy (every proposal accepted)."""

from __future__ import annotations

import copy

import pytest
import torch

import pagedkv
from models import tiny_model
from pagedkv.runtime import draft_model, draft_rounds, fixed_batch
from pagedkv.runtime.model import PREPARED_ATTR
from recording_streamer import FailingStreamer, RecordingStreamer
from test_assistant_model import assert_draft_empty, random_rows, stats, target, truncated
from test_prompt_lookup import assert_cache_empty, batch
from test_prompt_lookup_sampling import P_MIN, SAMPLE, two_sample_p

GREEDY = dict(do_sample=False, eos_token_id=None)
# (device, use_cuda_graphs): CUDA with graphs (the default) and eager rounds; the CPU's are eager
RUNS = [("cpu", None)] + [pytest.param("cuda", g, marks=pytest.mark.cuda) for g in (None, False)]
DRAFTS = {"truncated": truncated, "unrelated": lambda model: tiny_model("llama", seed=5).to(model.device),
          "copy": copy.deepcopy}


@pytest.fixture(autouse=True)
def device_rounds(monkeypatch):
    """The constant schedule must not fall back on the host-read rounds (a test that needs the
    host rounds undoes this)."""
    def refuse(*args, **kwargs):
        raise AssertionError("a constant-k draft ran runtime/prompt_lookup.py's host rounds")
    monkeypatch.setattr(fixed_batch, "run_prompt_lookup", refuse)


def on(device, rows):
    ids, mask = batch(rows)
    return ids.to(device), mask.to(device)


def pair(device, kind="truncated"):
    model = target(device)
    return model, DRAFTS[kind](model)


def assisted(model, draft, ids, mask, seed=None, **kwargs):
    """generate with the draft (after manual_seed(seed) if given); both caches empty after."""
    if seed is not None:
        torch.manual_seed(seed)
    out = pagedkv.generate(model, ids, attention_mask=mask, assistant_model=draft, **kwargs)
    assert_cache_empty(model)
    assert_draft_empty(draft)
    return out


def plain(model, ids, mask, seed=None, **kwargs):
    if seed is not None:
        torch.manual_seed(seed)
    return pagedkv.generate(model, ids, attention_mask=mask, **kwargs)


@pytest.mark.parametrize("device, graphs", RUNS)
@pytest.mark.parametrize("kind", list(DRAFTS))
def test_greedy_gives_plain_greedy_tokens(device, graphs, kind):
    model, draft = pair(device, kind)
    rows = random_rows([5, 17, 1, 33], seed=2)
    # k=None: HF's default 20, capped by max_new_tokens - 1
    for k, max_new, subset in ((3, 25, rows), (1, 25, rows[1:]), (6, 14, rows[::2]), (None, 6, rows[:2])):
        ids, mask = on(device, subset)
        expected = plain(model, ids, mask, max_new_tokens=max_new, **GREEDY)
        got = assisted(model, draft, ids, mask, max_new_tokens=max_new, num_assistant_tokens=k,
                       use_cuda_graphs=graphs, **GREEDY)
        assert torch.equal(got, expected), (kind, k, max_new)
        s = stats(model)
        assert s.proposed > 0 and s.rounds < max_new, (kind, k, s)
        if kind == "copy":
            assert s.accepted == s.proposed, (k, s)
        elif kind == "truncated":
            assert 0 < s.accepted < s.proposed, (k, s)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("do_sample", [False, True])
def test_the_draft_proposes_what_the_host_rounds_draft_proposes(monkeypatch, device, do_sample):
    """Same rounds, same proposals, same acceptance as runtime/prompt_lookup.py's rounds over
    DraftProposer (a draft that missed a token in its cache would propose otherwise); sampled, the
    host rounds draw otherwise, so only greedy counts are compared with them token for token."""
    model, draft = pair(device)
    ids, mask = on(device, random_rows([4, 12, 7, 20], seed=9))
    settings = dict(max_new_tokens=30, num_assistant_tokens=4, **(SAMPLE if do_sample else GREEDY))
    runs = [(assisted(model, draft, ids, mask, seed=3, **settings), stats(model))]
    monkeypatch.undo()  # the host rounds, as before this module
    # the proposer's own rounds: on_device reads False whatever __init__ sets
    monkeypatch.setattr(draft_model.DraftProposer, "on_device", property(lambda self: False, lambda self, value: None),
                        raising=False)
    runs.append((assisted(model, draft, ids, mask, seed=3, **settings), stats(model)))
    if not do_sample:
        assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1], runs
    assert 0 < runs[0][1].accepted < runs[0][1].proposed


def test_eos_and_max_new_tokens_inside_an_accepted_run():
    model, draft = pair("cpu", "copy")  # every proposal accepted: runs of k + 1 tokens a round
    rows = random_rows([6, 11], seed=4)
    ids, mask = batch(rows)
    alone = plain(model, torch.tensor([rows[0]]), None, max_new_tokens=12, **GREEDY)[0, 6:].tolist()
    eos = alone[7]  # the 8th new token of row 0: the second of the second round's run of 5
    assert eos not in alone[:7], alone
    kwargs = dict(max_new_tokens=12, do_sample=False, eos_token_id=eos, pad_token_id=0)
    got = assisted(model, draft, ids, mask, num_assistant_tokens=4, **kwargs)
    assert torch.equal(got, plain(model, ids, mask, **kwargs))
    new = got[0, ids.shape[1]:].tolist()
    assert new[:8] == alone[:8] and set(new[8:]) <= {0}
    assert stats(model).accepted == stats(model).proposed
    got = assisted(model, draft, ids, mask, max_new_tokens=7, num_assistant_tokens=4, **GREEDY)
    assert torch.equal(got, plain(model, ids, mask, max_new_tokens=7, **GREEDY))
    assert stats(model).rounds == 2  # 1 + 5 tokens, then 1 (no proposal left)


@pytest.mark.parametrize("do_sample", [False, True])
def test_min_new_tokens_and_eos(do_sample):
    """Rows ending at EOS at different steps, EOS suppressed position by position below
    min_new_tokens; sampled, the same seed's tokens as plain sampling."""
    model, draft = pair("cpu")
    rows = random_rows([5, 17, 1, 33], seed=0)
    ids, mask = batch(rows)
    base = dict(max_new_tokens=24, pad_token_id=0, **(dict(do_sample=True, temperature=0.7) if do_sample
                                                        else dict(do_sample=False)))
    row = plain(model, ids, mask, seed=4, eos_token_id=None, **base)[1, ids.shape[1]:].tolist()
    eos = row[6]  # row 1 ends at its 7th token, the others where they meet it
    assert eos not in row[:6], row
    for min_new in (0, 3, 8):
        kwargs = dict(eos_token_id=eos, min_new_tokens=min_new, **base)
        got = assisted(model, draft, ids, mask, seed=4, num_assistant_tokens=3, **kwargs)
        assert torch.equal(got, plain(model, ids, mask, seed=4, **kwargs)), min_new
        assert stats(model).proposed > 0
        new = got[1, ids.shape[1]:].tolist()
        assert (new[6] == eos and set(new[7:]) <= {0}) == (min_new < 7), (min_new, new)


@pytest.mark.parametrize("device, graphs", RUNS)
def test_a_seed_gives_the_tokens_of_plain_sampling(device, graphs):
    """Each position draws what a decode step draws there (row seed, offset = the token's index).
    On the CPU a verified position's logits are bit-equal to a decode step's, so the draws are
    too; on CUDA (other roundings of a (k + 1)-row product) a seed reproduces the call, captured
    or replayed, and the eager rounds draw what the captured ones draw."""
    model, draft = pair(device)
    ids, mask = on(device, random_rows([5, 9, 3, 14], seed=1))
    for seed, k, max_new, temperature, top_k, top_p in ((0, 4, 30, 0.5, 0, 1.0), (1, 7, 20, 0.8, 6, 0.9),
                                                        (2, 2, 17, 1.2, 0, 0.8)):
        kwargs = dict(max_new_tokens=max_new, temperature=temperature, top_k=top_k, top_p=top_p, **SAMPLE)
        got = assisted(model, draft, ids, mask, seed=seed, num_assistant_tokens=k, use_cuda_graphs=graphs, **kwargs)
        s = stats(model)
        assert 0 < s.accepted < s.proposed and s.rounds < max_new, (seed, s)
        if device == "cpu":
            assert torch.equal(got, plain(model, ids, mask, seed=seed, **kwargs)), seed
        else:
            for again in (graphs, False):
                assert torch.equal(got, assisted(model, draft, ids, mask, seed=seed, num_assistant_tokens=k,
                                                 use_cuda_graphs=again, **kwargs)), (seed, again)
    other = assisted(model, draft, ids, mask, seed=9, num_assistant_tokens=4, use_cuda_graphs=graphs,
                     max_new_tokens=20, temperature=1.5, **SAMPLE)
    assert not torch.equal(other, assisted(model, draft, ids, mask, seed=8, num_assistant_tokens=4,
                                           use_cuda_graphs=graphs, max_new_tokens=20, temperature=1.5, **SAMPLE))
    point_mass = assisted(model, draft, ids, mask, seed=0, num_assistant_tokens=3, use_cuda_graphs=graphs,
                          max_new_tokens=12, top_k=1, **SAMPLE)
    assert torch.equal(point_mass, plain(model, ids, mask, max_new_tokens=12, **GREEDY))


def test_first_and_later_tokens_follow_non_speculative_sampling():
    """1500 identical rows sampled with and without the draft under other seeds: new tokens 1-2
    jointly, token 3 and token 5 agree in distribution (two-sample chi-square)."""
    model, draft = pair("cpu")
    ids = torch.tensor(random_rows([6], seed=3) * 1500)
    settings = dict(max_new_tokens=5, temperature=0.7, top_k=8, top_p=0.95, **SAMPLE)
    base = plain(model, ids, None, seed=2, **settings)[:, -5:].tolist()
    spec = assisted(model, draft, ids, None, seed=3, num_assistant_tokens=2, **settings)[:, -5:].tolist()
    s = stats(model)
    assert 0 < s.accepted < s.proposed
    assert two_sample_p([tuple(r[:2]) for r in base], [tuple(r[:2]) for r in spec]) > P_MIN
    for i in (2, 4):
        assert two_sample_p([r[i] for r in base], [r[i] for r in spec]) > P_MIN, i


@pytest.mark.parametrize("do_sample", [False, True])
def test_the_streamer_gets_plain_decoding_s_columns(do_sample):
    model, draft = pair("cpu", "copy")
    ids, mask = batch(random_rows([8, 3], seed=5))
    eos = plain(model, ids, mask, max_new_tokens=10, **GREEDY)[0, -4].item()
    runs = []
    for with_draft in (False, True):
        streamer = RecordingStreamer()
        torch.manual_seed(6)
        pagedkv.generate(model, ids, attention_mask=mask, max_new_tokens=10, streamer=streamer,
                         assistant_model=draft if with_draft else None, do_sample=do_sample, temperature=0.5,
                         eos_token_id=eos, pad_token_id=0)
        runs.append([t.tolist() for t in streamer.chunks])
    assert runs[0] == runs[1] and len(runs[0]) > 3


@pytest.mark.parametrize("device, graphs", RUNS)
@pytest.mark.parametrize("failure", [KeyboardInterrupt, RuntimeError])
def test_an_interrupt_or_error_leaves_both_caches_empty(device, graphs, failure):
    model, draft = pair(device)
    ids, mask = on(device, random_rows([9, 4, 13], seed=7))
    expected = plain(model, ids, mask, max_new_tokens=30, **GREEDY)

    streamer = FailingStreamer(4, failure("stopped"))
    with pytest.raises(failure):
        pagedkv.generate(model, ids, attention_mask=mask, max_new_tokens=30, streamer=streamer,
                         assistant_model=draft, num_assistant_tokens=3, use_cuda_graphs=graphs, **GREEDY)
    assert streamer.ended
    assert_cache_empty(model)
    assert_draft_empty(draft)
    got = assisted(model, draft, ids, mask, max_new_tokens=30, num_assistant_tokens=3, use_cuda_graphs=graphs,
                   **GREEDY)
    assert torch.equal(got, expected)


def test_an_error_inside_a_round_leaves_both_caches_empty(monkeypatch):
    model, draft = pair("cpu")
    ids, mask = batch(random_rows([9, 4], seed=7))
    calls, real = [], draft_rounds.draft_round

    def failing(*args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("round failed")
        return real(*args)

    monkeypatch.setattr(draft_rounds, "draft_round", failing)
    with pytest.raises(RuntimeError, match="round failed"):
        pagedkv.generate(model, ids, attention_mask=mask, max_new_tokens=20, assistant_model=draft, **GREEDY)
    assert len(calls) == 3
    assert_cache_empty(model)
    assert_draft_empty(draft)
    monkeypatch.setattr(draft_rounds, "draft_round", real)
    got = assisted(model, draft, ids, mask, max_new_tokens=20, **GREEDY)
    assert torch.equal(got, plain(model, ids, mask, max_new_tokens=20, **GREEDY))


@pytest.mark.parametrize("device, graphs", RUNS)
def test_nan_logits_inside_a_round_raise_and_leave_nothing_held(device, graphs):
    """Row 0's third new token has a NaN embedding in the target (not in the draft, which
    proposes it): the round that draws after it raises, naming row 0 alone."""
    model, draft = pair(device, "copy")
    ids, mask = on(device, random_rows([6, 8], seed=12))
    clean = plain(model, ids, mask, max_new_tokens=12, **GREEDY)[:, ids.shape[1]:].tolist()
    bad = clean[0][2]
    assert bad not in clean[0][:2] + clean[1] + ids.tolist()[1] + ids.tolist()[0], (bad, clean)
    with torch.no_grad():
        model.model.embed_tokens.weight[bad] = float("nan")
    streamer = RecordingStreamer()
    with pytest.raises(RuntimeError, match=r"row\(s\) \[0\] .*NaN or infinite logits"):
        pagedkv.generate(model, ids, attention_mask=mask, max_new_tokens=12, top_k=1, streamer=streamer,
                         assistant_model=draft, num_assistant_tokens=4, use_cuda_graphs=graphs, **SAMPLE)
    assert streamer.ended and all(-1 not in chunk.tolist() for chunk in streamer.chunks)
    assert_cache_empty(model)
    assert_draft_empty(draft)


def test_heuristic_schedules_keep_the_host_rounds(monkeypatch):
    """k changes per row and round there: runtime/prompt_lookup.py's rounds over DraftProposer,
    whose k rule tests/test_assistant_model.py checks against HF's."""
    monkeypatch.undo()
    calls, real = [], fixed_batch.run_prompt_lookup
    monkeypatch.setattr(fixed_batch, "run_prompt_lookup", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    model, draft = pair("cpu")
    ids, mask = batch(random_rows([7, 12], seed=8))
    expected = plain(model, ids, mask, max_new_tokens=20, **GREEDY)
    for schedule, host in (("heuristic", 1), ("heuristic_transient", 1), ("constant", 0)):
        calls.clear()
        got = assisted(model, draft, ids, mask, max_new_tokens=20, num_assistant_tokens=2,
                       num_assistant_tokens_schedule=schedule, **GREEDY)
        assert torch.equal(got, expected) and len(calls) == host, schedule


def test_a_draft_of_fewer_positions_is_refused():
    model = target()
    draft = truncated(model)
    draft.config.max_position_embeddings = 40
    ids = torch.tensor([random_rows([30], seed=1)[0]])
    with pytest.raises(ValueError, match="assistant_model's max_position_embeddings is 40"):
        pagedkv.generate(model, ids, max_new_tokens=20, assistant_model=draft, **GREEDY)
    assert_cache_empty(model)
    assert_draft_empty(draft)


@pytest.mark.cuda
def test_cuda_takes_the_device_rounds():
    """A constant-k call on CUDA runs DeviceDraft's rounds (no switch), with greedy decoding's tokens."""
    ran = []
    real = draft_rounds.DeviceDraft.run
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(draft_rounds.DeviceDraft, "run", lambda *a, **kw: ran.append(1) or real(*a, **kw))
        model, draft = pair("cuda")
        ids = torch.tensor([random_rows([7], seed=8)[0]], device="cuda")
        got = assisted(model, draft, ids, None, max_new_tokens=12, num_assistant_tokens=3, **GREEDY)
    assert torch.equal(got, plain(model, ids, None, max_new_tokens=12, **GREEDY))
    assert len(ran) == 1


@pytest.mark.cuda
def test_captured_rounds_are_replayed_and_captured_again_for_a_new_draft_cache():
    """A later call of other prompts (same bucket and table widths) replays the captured round; a
    draft whose cache was re-made (a call too large for it) gets the round captured again."""
    model, draft = pair("cuda")
    big, big_mask = on("cuda", random_rows([5, 9] * 40, seed=3))  # 80 rows
    plain(model, big, big_mask, max_new_tokens=30, **GREEDY)  # a target cache large enough for every call
    target_cache = pagedkv.kv_cache_of(model)
    rounds = getattr(model, PREPARED_ATTR).fixed_batch._draft._rounds
    for seed in (1, 2):
        ids, mask = on("cuda", random_rows([5, 9], seed=seed))
        got = assisted(model, draft, ids, mask, max_new_tokens=10, num_assistant_tokens=3, **GREEDY)
        assert torch.equal(got, plain(model, ids, mask, max_new_tokens=10, **GREEDY))
        assert len(rounds) == 1
    (key, (captured, *_)), = rounds.items()
    draft_cache = pagedkv.kv_cache_of(draft)
    got = assisted(model, draft, big, big_mask, max_new_tokens=10, num_assistant_tokens=3, **GREEDY)
    assert torch.equal(got, plain(model, big, big_mask, max_new_tokens=10, **GREEDY))
    assert pagedkv.kv_cache_of(draft) is not draft_cache and pagedkv.kv_cache_of(model) is target_cache
    got = assisted(model, draft, ids, mask, max_new_tokens=10, num_assistant_tokens=3, **GREEDY)
    assert torch.equal(got, plain(model, ids, mask, max_new_tokens=10, **GREEDY))
    assert len(rounds) == 2 and rounds[key][0] != captured
