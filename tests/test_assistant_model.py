"""generate(assistant_model=draft): greedy assisted decoding gives pagedkv's non-speculative greedy
tokens and HF's greedy tokens, token for token (fp32, CPU), for batches of any size, with the
draft run by pagedkv on its own cache; HF's num_assistant_tokens schedules; refusals named.

Drafts: a layer-truncated copy of a target whose second layer is damped (it agrees with the
target most of the time: proposals accepted, some rejected), an unrelated random model (almost
every proposal rejected), and the target's exact copy (every proposal accepted, so EOS and
max_new_tokens fall inside accepted runs)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import pagedkv
from conftest import DEVICES
from models import tiny_model, widen
from pagedkv.hf.generation_config import UnsupportedGenerationArgument
from pagedkv.runtime import draft_model
from pagedkv.runtime.model import PREPARED_ATTR
from recording_streamer import FailingStreamer
from test_prompt_lookup import assert_cache_empty, batch

GREEDY = dict(do_sample=False, eos_token_id=None)


def target(device: str = "cpu"):
    """A tiny Llama whose second layer adds little: its first layer alone mostly agrees."""
    model = tiny_model("llama", device=device)
    with torch.no_grad():
        layer = model.model.layers[1]
        layer.self_attn.o_proj.weight.mul_(0.25)
        layer.mlp.down_proj.weight.mul_(0.25)
    return model


def truncated(model):
    """A copy of `model` with its first layer only (the draft of the issue's benchmark)."""
    draft = copy.deepcopy(model)
    draft.model.layers = draft.model.layers[:1]
    draft.config.num_hidden_layers = 1
    return draft


def stats(model):
    return getattr(model, PREPARED_ATTR).fixed_batch.last_prompt_lookup


def assert_draft_empty(draft):
    cache = pagedkv.kv_cache_of(draft)
    assert cache is not None, "the draft never ran through pagedkv"
    assert len(cache.manager) == 0 and cache.num_free_blocks == cache.num_blocks


def random_rows(lengths, seed=0):
    torch.manual_seed(seed)
    return [torch.randint(3, 256, (n,)).tolist() for n in lengths]


def check_same(model, draft, rows, k=None, schedule=None, **kwargs):
    """Assisted == non-speculative, both caches empty afterwards; returns the new tokens."""
    ids, mask = batch(rows)
    expected = pagedkv.generate(model, ids, attention_mask=mask, **kwargs)
    got = pagedkv.generate(model, ids, attention_mask=mask, assistant_model=draft, num_assistant_tokens=k,
                           num_assistant_tokens_schedule=schedule, **kwargs)
    assert torch.equal(got, expected)
    assert_cache_empty(model)
    assert_draft_empty(draft)
    return got[:, ids.shape[1]:]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", [1, 4])
def test_batch_one_equals_hf_greedy(k, device):
    model = target(device)
    draft = truncated(model)
    ids = torch.tensor(random_rows([9])[0], device=device).unsqueeze(0)
    expected = model.generate(ids, max_new_tokens=30, **GREEDY)
    got = pagedkv.generate(model, ids, max_new_tokens=30, assistant_model=draft,
                           num_assistant_tokens=k, **GREEDY)
    assert torch.equal(got, expected)
    s = stats(model)
    assert 0 < s.accepted < s.proposed  # the truncated copy agrees often, not always
    assert s.rounds < 30
    assert_draft_empty(draft)


@pytest.mark.parametrize("draft_kind", ["truncated", "unrelated", "copy"])
def test_batches_of_mixed_acceptance(draft_kind):
    model = target()
    draft = {"truncated": lambda: truncated(model), "unrelated": lambda: tiny_model("llama", seed=5),
             "copy": lambda: copy.deepcopy(model)}[draft_kind]()
    rows = random_rows([5, 17, 1, 33], seed=2)
    check_same(model, draft, rows, max_new_tokens=25, k=3, schedule="heuristic_transient",
               **GREEDY)
    s = stats(model)
    assert s.proposed > 0
    if draft_kind == "copy":
        assert s.accepted == s.proposed
    elif draft_kind == "truncated":
        assert 0 < s.accepted < s.proposed
    # each row equals HF's greedy generate of that row alone
    ids, mask = batch(rows)
    got = pagedkv.generate(model, ids, attention_mask=mask, max_new_tokens=25, assistant_model=draft, **GREEDY)
    for r, row in enumerate(rows):
        alone = model.generate(torch.tensor([row]), max_new_tokens=25, **GREEDY)[0, len(row):]
        assert got[r, ids.shape[1]:].tolist() == alone.tolist()


def test_eos_and_max_new_tokens_inside_an_accepted_run():
    model = target()
    draft = copy.deepcopy(model)  # every proposal accepted: runs of k + 1 tokens per round
    rows = random_rows([6, 11], seed=4)
    plain = pagedkv.generate(model, torch.tensor([rows[0]]), max_new_tokens=12, **GREEDY)[0, 6:].tolist()
    eos = plain[7]  # the 8th new token of row 0: the second of the second round's run of 5
    assert eos not in plain[:7], plain
    got = check_same(model, draft, rows, max_new_tokens=12, k=4, do_sample=False,
                     eos_token_id=eos, pad_token_id=0)
    assert got[0, :8].tolist() == plain[:8] and set(got[0, 8:].tolist()) <= {0}
    assert stats(model).accepted == stats(model).proposed
    got = check_same(model, draft, rows, max_new_tokens=7, k=4, **GREEDY)
    assert got.shape[1] == 7 and stats(model).rounds == 2  # 1 + 5 tokens, then 1 (no proposal left)


def test_the_draft_runs_on_its_own_cache_and_sees_the_bonus_token():
    """Both caches hold only their rows' fed tokens (every block free after the call), and the
    draft's cache is not the target's. A draft that never saw a bonus token would propose from a
    stale context: the exact copy's proposals would stop being accepted."""
    model = target()
    draft = copy.deepcopy(model)
    check_same(model, draft, random_rows([13, 3], seed=6), max_new_tokens=30, k=2,
               **GREEDY)
    assert pagedkv.kv_cache_of(draft) is not pagedkv.kv_cache_of(model)
    s = stats(model)
    assert s.accepted == s.proposed and s.rounds == 10  # 3 tokens a round: 1 + 9 * 3 + 2 = 30


def test_an_error_mid_call_frees_both_caches():
    model = target()
    draft = truncated(model)
    pagedkv.generate(model, torch.tensor([[5, 6, 7]]), max_new_tokens=4, assistant_model=draft, **GREEDY)

    ids = torch.tensor(random_rows([9, 9], seed=7))
    with pytest.raises(RuntimeError, match="streamer failed"):
        pagedkv.generate(model, ids, max_new_tokens=20, streamer=FailingStreamer(4, RuntimeError("streamer failed")), assistant_model=draft, **GREEDY)
    assert_cache_empty(model)
    assert_draft_empty(draft)
    # the next call gives HF's tokens
    got = pagedkv.generate(model, ids, max_new_tokens=20, assistant_model=draft, **GREEDY)
    assert torch.equal(got, model.generate(ids, max_new_tokens=20, **GREEDY))


def test_a_draft_step_error_frees_both_caches(monkeypatch):
    model = target()
    draft = truncated(model)
    calls = []
    original = draft_model.DraftProposer.propose

    def failing(self, *args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("draft failed")
        return original(self, *args)

    monkeypatch.setattr(draft_model.DraftProposer, "propose", failing)
    ids, mask = batch(random_rows([9, 4]))
    with pytest.raises(RuntimeError, match="draft failed"):  # the host rounds (constant k: test_draft_rounds.py)
        pagedkv.generate(model, ids, attention_mask=mask, max_new_tokens=20, assistant_model=draft,
                         num_assistant_tokens_schedule="heuristic_transient", **GREEDY)
    assert len(calls) == 3
    assert_cache_empty(model)
    assert_draft_empty(draft)
    monkeypatch.undo()
    got = pagedkv.generate(model, ids, attention_mask=mask, max_new_tokens=20, assistant_model=draft, **GREEDY)
    assert torch.equal(got, pagedkv.generate(model, ids, attention_mask=mask, max_new_tokens=20, **GREEDY))


def spy_ks(monkeypatch, cls, attribute):
    """The k that each proposal round starts with (cls.update records it before HF's rule)."""
    seen = []
    original = cls.update_candidate_strategy if attribute is None else cls.accepted

    def spy(self, *args):
        seen.append(self.num_assistant_tokens if attribute is None else list(self.k))
        return original(self, *args)

    monkeypatch.setattr(cls, "update_candidate_strategy" if attribute is None else "accepted", spy)
    return seen


@pytest.mark.parametrize("schedule", ["constant", "heuristic", "heuristic_transient"])
def test_schedules_follow_hf(monkeypatch, schedule):
    """Batch 1: the k of every round equals HF's AssistedCandidateGenerator's with the same pair
    (HF's confidence threshold off: it stops HF's draft early, which pagedkv does not do); the
    "heuristic" schedule leaves the last k in the draft's generation_config, as HF does, the others
    leave it as it was."""
    from transformers.generation.candidate_generator import AssistedCandidateGenerator

    model = target()
    ids = torch.tensor([random_rows([9], seed=8)[0]])
    runs = []
    for system in ("hf", "pagedkv"):
        draft = truncated(model)
        draft.generation_config.num_assistant_tokens = 3
        draft.generation_config.num_assistant_tokens_schedule = schedule
        draft.generation_config.assistant_confidence_threshold = 0.0
        if system == "hf":
            seen = spy_ks(monkeypatch, AssistedCandidateGenerator, None)
            out = model.generate(ids, max_new_tokens=40, assistant_model=draft, **GREEDY)
            monkeypatch.undo()
        else:
            seen = spy_ks(monkeypatch, draft_model.DraftProposer, "k")
            out = pagedkv.generate(model, ids, max_new_tokens=40, assistant_model=draft, **GREEDY)
            # constant: the rounds run on the device (runtime/draft_rounds.py) with k throughout
            seen = [k[0] for k in seen] if schedule != "constant" else [3] * stats(model).rounds
        runs.append((out.tolist(), seen, draft.generation_config.num_assistant_tokens))
    assert runs[0] == runs[1]
    assert len(set(runs[1][1])) > (schedule != "constant")  # the k really moved (or stayed)


def test_k_per_row_in_a_batch(monkeypatch):
    """Rows of a batch each follow HF's rule on their own proposals (+2 when all accepted, else
    -1, at least 1); num_assistant_tokens of the call overrides the draft's generation_config."""
    model = target()
    draft = truncated(model)
    draft.generation_config.num_assistant_tokens = 7
    seen, rounds = [], []
    original = draft_model.DraftProposer.accepted

    def spy(self, rows, counts):
        seen.append(list(self.k))
        rounds.append((list(rows), [len(self.proposals[i]) for i in rows], list(counts)))
        return original(self, rows, counts)

    monkeypatch.setattr(draft_model.DraftProposer, "accepted", spy)
    ids, mask = batch(random_rows([4, 12, 7], seed=9))
    pagedkv.generate(model, ids, attention_mask=mask, max_new_tokens=30, assistant_model=draft,
                     num_assistant_tokens=2, num_assistant_tokens_schedule="heuristic_transient", **GREEDY)
    ks = [2, 2, 2]
    assert seen[0] == ks
    for (rows, proposed, counts), now in zip(rounds, seen[1:] + [None]):
        for i, n, a in zip(rows, proposed, counts):
            ks[i] = ks[i] + 2 if a == n else max(1, ks[i] - 1)
        if now is not None:
            assert now == ks
    assert len({tuple(k) for k in seen}) > 2
    assert draft.generation_config.num_assistant_tokens == 7  # transient: unchanged


def test_refused_with_a_named_reason():
    model = target()
    ids = torch.tensor([[5, 6, 7]])
    other_vocab = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128,
                                               num_hidden_layers=1, num_attention_heads=2,
                                               num_key_value_heads=1, max_position_embeddings=512))
    with pytest.raises(UnsupportedGenerationArgument, match="vocab_size 300.*256"):
        pagedkv.generate(model, ids, max_new_tokens=4, assistant_model=other_vocab, **GREEDY)
    gpt2 = widen(GPT2LMHeadModel(GPT2Config(vocab_size=256, n_embd=64, n_layer=1, n_head=2))).eval()
    with pytest.raises(UnsupportedGenerationArgument, match="gpt2"):
        pagedkv.generate(model, ids, max_new_tokens=4, assistant_model=gpt2, **GREEDY)
    draft = truncated(model)
    for kwargs, match in [(dict(do_sample=True, num_return_sequences=2), "num_return_sequences > 1"),
                          (dict(prompt_lookup_num_tokens=3), "prompt_lookup_num_tokens"),
                          (dict(repetition_penalty=1.2), "repetition_penalty"),
                          (dict(num_assistant_tokens=0), "num_assistant_tokens=0"),
                          (dict(num_assistant_tokens_schedule="fast"), "num_assistant_tokens_schedule='fast'"),
                          (dict(assistant_tokenizer=object(), tokenizer=object()), "assistant_tokenizer")]:
        with pytest.raises((UnsupportedGenerationArgument, ValueError), match=match):
            pagedkv.generate(model, ids, max_new_tokens=4, assistant_model=draft,
                             **{"do_sample": False, "eos_token_id": None, **kwargs})
    with pytest.raises(UnsupportedGenerationArgument, match="the model itself"):
        pagedkv.generate(model, ids, max_new_tokens=4, assistant_model=model, **GREEDY)
    # the refusals left nothing behind: the next call gives HF's tokens
    got = pagedkv.generate(model, ids, max_new_tokens=6, assistant_model=draft, **GREEDY)
    assert torch.equal(got, model.generate(ids, max_new_tokens=6, **GREEDY))
