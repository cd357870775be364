"""generate() across calls: a prompt that extends an earlier call's prompt + output (a chat's next
turn) reuses that call's K/V from the prefix cache, so its prefill computes only the rest; the
tokens stay HF's generate on the whole prompt (fp32, token for token). Cached K/V never outlive
the weights they came from, a failed call leaves none it did not write, and past_key_values is
refused with the how-to."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import DynamicCache

import pagedkv
from pagedkv.runtime.runner import ModelRunner
from conftest import DEVICES
from interrupts import Interrupter, interrupt_points
from models import tiny_model

BLOCK = 16
MAX_NEW = 20
GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=0)


@pytest.fixture
def prefills(monkeypatch) -> list[list[int]]:
    """query_lens of every prefill step the runner runs (decode steps do not go through run())."""
    seen: list[list[int]] = []
    run = ModelRunner.run

    def spy(self, step):
        if step.query_lens is not None:
            seen.append(list(step.query_lens))
        return run(self, step)

    monkeypatch.setattr(ModelRunner, "run", spy)
    return seen


def text(n: int, seed: int) -> list[int]:
    """n random token ids (>= 3: never pad, BOS or EOS)."""
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def left_padded(rows: list[list[int]], device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows], device=device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
    return ids, mask


def both(model, rows: list[list[int]], **kwargs) -> list[list[int]]:
    """Each row's new tokens from pagedkv.generate, asserted equal to HF's generate on the whole
    (left-padded) prompts."""
    ids, mask = left_padded(rows, next(model.parameters()).device)
    kwargs = {"max_new_tokens": MAX_NEW, **GREEDY, **kwargs}
    want = model.generate(ids, attention_mask=mask, **kwargs)
    got = pagedkv.generate(model, ids, attention_mask=mask, **kwargs)
    assert torch.equal(got.cpu(), want.cpu())
    return got[:, ids.shape[1]:].tolist()


def cached(prev_prompt: int, new: list[int], next_prompt: int, eos: tuple[int, ...] = ()) -> int:
    """Tokens of the next prompt that an earlier call's row (prompt of prev_prompt tokens, new
    tokens `new`) leaves in the prefix cache: whole blocks of the tokens it fed (all but its last
    new token, none after its first EOS), at most the next prompt's length - 1."""
    fed = len(new) - 1
    for i, t in enumerate(new):
        if t in eos:
            fed = min(fed, i + 1)
            break
    return min((prev_prompt + fed) // BLOCK, (next_prompt - 1) // BLOCK) * BLOCK


def sized(model, tokens: int = 128) -> pagedkv.KVCache:
    """generate's cache, made by a first call large enough for the test's later ones (a call
    that needs more blocks re-makes it, losing what it cached)."""
    both(model, [text(tokens - 4, seed=99)], max_new_tokens=4)
    return pagedkv.kv_cache_of(model)


def assert_only_cached_blocks(model) -> None:
    """Between calls generate's cache holds no row; its blocks are free or cached (evictable)."""
    cache = pagedkv.kv_cache_of(model)
    assert len(cache.manager) == 0
    assert cache.num_free_blocks == cache.num_blocks


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_five_turn_chat_prefills_only_the_new_tokens(arch, device, prefills):
    """Each turn's prompt is the last one + its reply + new text. A turn that needs a larger
    cache re-makes it (at least twice the size: the earlier K/V are lost, the tokens stay right);
    every other turn computes only what the cache does not hold."""
    model = tiny_model(arch, device=device)
    prompt, reused = text(21, seed=1), 0
    for turn, user in enumerate([0, 5, 3, 2, 4]):
        if turn:
            before = (len(prompt), new, pagedkv.kv_cache_of(model))
            prompt = prompt + new + text(user, seed=10 + turn)
        new = both(model, [prompt])[0]
        assert_only_cached_blocks(model)
        if turn:
            same_cache = pagedkv.kv_cache_of(model) is before[2]
            hit = cached(before[0], before[1], len(prompt)) if same_cache else 0
            assert prefills[-1] == [len(prompt) - hit]
            reused += same_cache
    assert reused == 2 and prefills[-1] == [115 - 96]  # turns 3 and 5 reused their caches


@pytest.mark.parametrize("device", DEVICES)
def test_two_conversations_in_a_batch_with_an_eos(device, prefills):
    """Two rows, left-padded; one stops at an EOS: its tokens up to the EOS are reused, and the
    next prompt holds them (as a chat's next turn does), not the padding after."""
    model = tiny_model("qwen2", device=device)
    prompts = [text(37, seed=2), text(12, seed=3)]
    free_run = both(model, prompts, max_new_tokens=60)  # a cache large enough for every call
    eos = free_run[1][9]  # row 1 stops at its 10th new token
    cache = pagedkv.kv_cache_of(model)
    kwargs = dict(eos_token_id=[eos], pad_token_id=0)
    new = both(model, prompts, **kwargs)
    assert new[1][10:] == [0] * (MAX_NEW - 10)
    replies = [new[0], new[1][:new[1].index(eos) + 1]]
    nxt = [p + r + text(9, seed=20 + i) for i, (p, r) in enumerate(zip(prompts, replies))]
    both(model, nxt, **kwargs)
    assert prefills[-1] == [len(n) - cached(len(p), r, len(n), (eos,))
                            for p, r, n in zip(prompts, new, nxt)]
    # Row 1's prompt (12 tokens) fills no block alone: the block it reuses holds its reply.
    assert prefills[-1][1] == len(nxt[1]) - BLOCK
    assert pagedkv.kv_cache_of(model) is cache
    assert_only_cached_blocks(model)


def test_prompt_diverging_inside_a_cached_block_reuses_the_blocks_before(prefills):
    model = tiny_model("llama")
    cache = sized(model)
    prompt = text(40, seed=4)
    new = both(model, [prompt])[0]
    nxt = prompt + new + text(6, seed=5)
    nxt[20] = (nxt[20] + 1) % 253 + 3  # inside the second block
    both(model, [nxt])
    assert prefills[-1] == [len(nxt) - BLOCK]
    # The same prompt again now reuses all its blocks but the last token's.
    both(model, [nxt])
    assert prefills[-1] == [len(nxt) - (len(nxt) - 1) // BLOCK * BLOCK]
    assert pagedkv.kv_cache_of(model) is cache


def _no_grad_mul(model, other):
    with torch.no_grad():
        model.model.layers[0].mlp.gate_proj.weight.mul_(-1)


def _load_state_dict(model, other):
    model.load_state_dict(other.state_dict())


def _optimizer_step(model, other):
    model(torch.tensor([[5, 6, 7]])).logits.square().mean().backward()
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    model.zero_grad()


def _new_module(model, other):
    model.model.layers[1].mlp.down_proj = other.model.layers[1].mlp.down_proj


@pytest.mark.parametrize("change", [_no_grad_mul, _load_state_dict, _optimizer_step, _new_module],
                         ids=lambda f: f.__name__.lstrip("_"))
def test_changed_weights_never_reuse_stale_kv(change, prefills):
    model, other = tiny_model("llama"), tiny_model("llama", seed=1)
    cache = sized(model)
    prompt = text(40, seed=6)
    new = both(model, [prompt])[0]
    nxt = prompt + new + text(3, seed=7)
    change(model, other)
    both(model, [nxt])  # HF's tokens on the changed model
    assert prefills[-1] == [len(nxt)], "K/V of the old weights were reused"
    both(model, [nxt + [9]])  # and the new weights' K/V are reused again
    assert prefills[-1][0] < len(nxt)
    # In-place writes keep the cache (its stale blocks dropped); a new module makes a new one.
    assert (pagedkv.kv_cache_of(model) is cache) == (change is not _new_module)


def test_a_larger_cache_made_for_a_later_call_stays_correct(prefills):
    model = tiny_model("llama")
    prompt = text(18, seed=8)
    new = both(model, [prompt], max_new_tokens=5)[0]
    blocks = pagedkv.kv_cache_of(model).num_blocks
    rows = [prompt + new + text(4, seed=9), text(50, seed=10), text(70, seed=11)]
    both(model, rows, max_new_tokens=40)
    assert pagedkv.kv_cache_of(model).num_blocks > blocks
    assert_only_cached_blocks(model)


def test_full_cache_of_cached_blocks_never_fails_a_call(prefills):
    """Cached blocks are evicted for a later call that needs the space: same size of call, all
    new prompts, again and again."""
    model = tiny_model("llama")
    for seed in range(4):
        both(model, [text(30, seed=30 + seed), text(33, seed=40 + seed)], max_new_tokens=10)
        assert prefills[-1] == [30, 33]
        assert_only_cached_blocks(model)


@pytest.mark.parametrize("device", DEVICES)
def test_interrupted_call_then_the_next_turn_is_correct(device):
    """An interrupt anywhere in a call whose prompt reuses an earlier call's blocks leaves no
    row and no K/V it did not write: the next call (the same turn) gives HF's tokens."""
    model = tiny_model("llama", device=device)
    prompt = text(30, seed=12)
    first = both(model, [prompt], max_new_tokens=8)[0]
    rows = [prompt + first + text(5, seed=13), text(19, seed=14)]
    ids, mask = left_padded(rows, device)
    kwargs = dict(attention_mask=mask, max_new_tokens=8, **GREEDY)
    want = model.generate(ids, **kwargs).cpu()

    def call() -> torch.Tensor:
        return pagedkv.generate(model, ids, **kwargs).cpu()

    with Interrupter() as counter:
        call()
    # Every line of prefix_reuse.py (its first and last run), and a sample of the call's other
    # lines in the cache set-up, admission and freeing (tests/test_interrupts.py covers them all).
    ours = [i for i, (file, _) in enumerate(counter.sites, 1) if file.endswith("prefix_reuse.py")]
    mine = [s if s[0].endswith("prefix_reuse.py") else ("", 0) for s in counter.sites]
    points = set(interrupt_points(mine, sample=0)) & set(ours)
    near = [i for i, (file, _) in enumerate(counter.sites, 1)
            if file.endswith(("fixed_batch.py", "kv_cache.py"))]
    points |= set(random.Random(0).sample(near, min(12 if device == "cpu" else 4, len(near))))
    failures = []
    for at in sorted(points):
        tracer = Interrupter(at)
        try:
            with tracer:
                call()
        except KeyboardInterrupt:
            pass
        try:
            assert torch.equal(call(), want), "the next call's tokens differ"
            assert_only_cached_blocks(model)
        except AssertionError as error:
            failures.append(f"{tracer.where}: {error}")
    assert not failures, "\n".join(failures[:20])


def test_past_key_values_is_refused_with_the_how_to():
    model = tiny_model("llama")
    ids = torch.tensor([text(20, seed=15)])
    out = model.generate(ids, max_new_tokens=4, return_dict_in_generate=True, **GREEDY)
    assert isinstance(out.past_key_values, DynamicCache)
    nxt = torch.cat([out.sequences, torch.tensor([[7, 8]])], dim=1)
    for cache in (out.past_key_values, DynamicCache()):
        with pytest.raises(pagedkv.UnsupportedGenerationArgument,
                           match=r"past_key_values.*reuses .* by itself.*whole conversation as input_ids"):
            pagedkv.generate(model, nxt, past_key_values=cache, max_new_tokens=4, **GREEDY)
    # None (what pagedkv returns as past_key_values) is taken: the earlier K/V are reused anyway.
    got = pagedkv.generate(model, ids, max_new_tokens=4, return_dict_in_generate=True, **GREEDY)
    assert got.past_key_values is None
    again = pagedkv.generate(model, nxt, past_key_values=got.past_key_values, max_new_tokens=4, **GREEDY)
    assert torch.equal(again, model.generate(nxt, max_new_tokens=4, **GREEDY))
