"""Rope "dynamic" (Llama) and "longrope" (Phi-3) on the native decoder (layers/rotary.py
RopeByLength, each step's cos/sin from its tokens' S): HF's greedy tokens from pagedkv.generate
(left-padded batches, prompts and decodes on both sides of the switch, CUDA graphs on CUDA) and
from pagedkv.LLM (each request as HF's generate of it alone; chunked prefill, preemption), and
the refusals where HF computes something pagedkv does not (Phi-3 crossing the switch, where
HF's generate drops its cache, beam search)."""

from __future__ import annotations

import functools

import pytest
import torch

import pagedkv
from pagedkv import LLM, SamplingParams
from pagedkv.layers.rotary import LengthDependentRope, RopeByLength, phi3_drops_cache
from conftest import DEVICES
from test_engine import assert_no_leaks
from test_rope_length_dependent import SWITCH, batch, tiny

NEW = 16
LENGTHS = {"prompt past the switch": [SWITCH + 8], "decode crosses it": [20],
           "batch crosses it": [10, 28], "batch of one past it": [SWITCH + 5, 12], "within it": [6, 9]}


def crosses(kind: str, lengths: list[int]) -> bool:
    """Whether HF's Phi-3 generate drops its cache in this batch (it crosses the switch): pagedkv
    refuses it (5.24 recomputes the sequence, 5.17 goes on without the earlier K)."""
    return phi3_drops_cache(tiny(kind).config) and max(lengths) <= SWITCH < max(lengths) + NEW - 1


@functools.lru_cache(maxsize=None)
def hf_alone(kind: str, prompt: tuple[int, ...], device: str) -> list[int]:
    """HF's greedy new tokens for one prompt alone."""
    ids = torch.tensor([prompt], device=device)
    return hf_tokens(kind, ids, torch.ones_like(ids), device)[0].tolist()


def hf_tokens(kind: str, ids, mask, device: str, before=None) -> torch.Tensor:
    """HF's greedy new tokens, from a fresh model (or after HF's generate of `before`)."""
    model = tiny(kind).to(device)
    if before is not None:
        model.generate(before[0], attention_mask=before[1], max_new_tokens=NEW, do_sample=False,
                       eos_token_id=None, pad_token_id=0)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[:, ids.shape[1]:]


@pytest.mark.parametrize("kind", ["dynamic", "longrope"])
@pytest.mark.parametrize("device", DEVICES)
def test_device_table_equals_hf_rotary(kind, device):
    """RopeByLength's cos/sin (torch ops over its device table) equal LengthDependentRope's (HF's
    own forward for each S), bit for bit, for any S, within the switch and past it."""
    rotary = tiny(kind).model.rotary_emb.to(device)
    host = LengthDependentRope(rotary)
    table = RopeByLength(rotary, 4 * SWITCH, torch.device(device))
    table.ensure(4 * SWITCH)
    g = torch.Generator().manual_seed(0)
    positions = torch.cat([torch.randint(0, SWITCH, (32,), generator=g), torch.randint(0, 4 * SWITCH, (32,), generator=g)])
    lens = torch.maximum(positions + 1, torch.randint(1, 4 * SWITCH + 1, (64,), generator=g))
    lens[:32] = torch.randint(SWITCH // 2, SWITCH + 1, (32,), generator=g).maximum(positions[:32] + 1)
    expected = host.cos_sin(positions.to(device), lens.to(device))
    assert torch.equal(table.cos_sin(positions.int().to(device), lens.to(device)), expected)
    assert int((lens > SWITCH).sum()) > 8 and int((lens <= SWITCH).sum()) > 8


@pytest.mark.parametrize("kind", ["dynamic", "longrope"])
@pytest.mark.parametrize("name", list(LENGTHS))
@pytest.mark.parametrize("device", DEVICES)
def test_generate_gives_hf_tokens(kind, name, device):
    """pagedkv.generate on a left-padded batch: HF's greedy tokens (the fast path, and HF's
    processors' path via a repetition penalty of 1.0 forced through output_scores)."""
    lengths = LENGTHS[name]
    ids, mask = batch(lengths, device)
    model = tiny(kind).to(device)
    if crosses(kind, lengths):
        with pytest.raises(ValueError, match="crosses original_max_position_embeddings"):
            pagedkv.generate(model, ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        ids, mask = batch([SWITCH + 3, 7], device)  # the model still runs the next call
    expected = hf_tokens(kind, ids, mask, device)
    for _ in range(2):  # the second call replays the first's captured graphs on CUDA
        out = pagedkv.generate(model, ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                               eos_token_id=None, pad_token_id=0)
        assert torch.equal(out[:, ids.shape[1]:], expected), (kind, name)
    scored = pagedkv.generate(model, ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                              eos_token_id=None, pad_token_id=0, output_scores=True,
                              return_dict_in_generate=True)
    assert torch.equal(scored.sequences[:, ids.shape[1]:], expected)


@pytest.mark.parametrize("device", DEVICES)
def test_generate_follows_hf_grown_dynamic_rope(device):
    """HF's dynamic rope module keeps the frequencies of the longest S it ran (until a forward
    shorter than max_position_embeddings): a generate() after an HF generate that grew it gives
    the tokens HF's own second call gives (pagedkv took the weights before HF grew it: the
    fingerprint's new buffer makes it take them again)."""
    first = batch([SWITCH + 12], device)
    ids, mask = batch([SWITCH + 2, SWITCH], device)
    expected = hf_tokens("dynamic", ids, mask, device, before=first)
    assert not torch.equal(expected, hf_tokens("dynamic", ids, mask, device))  # the state matters
    model = tiny("dynamic").to(device)
    pagedkv.generate(model, first[0], attention_mask=first[1], max_new_tokens=NEW, do_sample=False,
                     eos_token_id=None, pad_token_id=0)  # pagedkv's own calls grow nothing
    model.generate(first[0], attention_mask=first[1], max_new_tokens=NEW, do_sample=False,
                   eos_token_id=None, pad_token_id=0)  # HF's grows it (a new inv_freq buffer)
    out = pagedkv.generate(model, ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    assert torch.equal(out[:, ids.shape[1]:], expected)


@pytest.mark.usefixtures("engine_overlap")
@pytest.mark.parametrize("kind", ["dynamic", "longrope"])
@pytest.mark.parametrize("device", DEVICES)
def test_llm_gives_each_prompt_hf_tokens(kind, device):
    """pagedkv.LLM: every request's greedy tokens are HF's generate of its prompt alone, with
    prompts chunked (8 tokens a step) and the cache too small for all (preemption)."""
    lengths = [SWITCH + 9, 5, SWITCH - 4, SWITCH + 1, 20, 12]
    prompts = [batch([n], "cpu")[0][0].tolist() for n in lengths]
    refused = [p for p in prompts if crosses(kind, [len(p)])]
    prompts = [p for p in prompts if p not in refused]
    model = tiny(kind).to(device)
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    for blocks in (None, 12):
        llm = LLM(model, max_num_batched_tokens=8, max_num_seqs=4, num_kv_blocks=blocks or 64, block_size=8)
        for prompt in refused:  # Phi-3 where HF drops its cache: refused, nothing queued
            with pytest.raises(ValueError, match="crosses original_max_position_embeddings"):
                llm.add_request(prompt, params)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        for prompt, tokens in zip(prompts, got):
            assert list(tokens) == hf_alone(kind, tuple(prompt), device), (kind, len(prompt), blocks)
        assert_no_leaks(llm)
        assert (llm.stats.num_preemptions > 0) == (blocks is not None)
    if phi3_drops_cache(model.config):
        assert refused


def test_beam_search_is_refused():
    """HF's beam search over a length-dependent rope spans the padded batch's S per step, which
    pagedkv's beam steps do not carry: refused by name, and the next call still works."""
    model = tiny("dynamic")
    ids, mask = batch([SWITCH + 3, 10], "cpu")
    with pytest.raises(ValueError, match="num_beams > 1 is not supported with rope type 'dynamic'"):
        pagedkv.generate(model, ids, attention_mask=mask, max_new_tokens=4, num_beams=2, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    out = pagedkv.generate(model, ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    assert torch.equal(out[:, ids.shape[1]:], hf_tokens("dynamic", ids, mask, "cpu"))


def test_quantized_checkpoint_is_refused(tmp_path):
    """from_pretrained_quantized does not build the per-step rope (yet): refused by name, not run
    with the static table's error."""
    import json

    from test_quantized_checkpoints import CASES, write_checkpoint

    write_checkpoint(tmp_path, "llama", CASES[0][2])
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_parameters"] = dict(rope_type="dynamic", factor=2.0, rope_theta=10000.0)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(pagedkv.UnsupportedModel, match="rope type 'dynamic' is not supported with a quantized"):
        pagedkv.from_pretrained_quantized(tmp_path, device="cpu")


def test_tensor_parallel_is_refused():
    """The per-step rope is not sharded: tensor_parallel refuses it by name before any set-up."""
    with pytest.raises(pagedkv.UnsupportedModel, match="rope type 'longrope' .* is not sharded yet"):
        pagedkv.tensor_parallel(tiny("longrope"))
