"""pagedkv.LLM on a model whose every layer has a sliding window (a tiny Mistral, window 16): each
step gives back the blocks that fell out of every running sequence's window, so long sequences
run side by side in a cache too small for them otherwise, with HF's greedy tokens (HF applies the
same window), serially and overlapped, and nothing held after. A model with a layer that sees the
whole context (Gemma-2's alternating layers, Qwen2 below max_window_layers) releases nothing."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import pagedkv
from conftest import DEVICES
from models import widen
from pagedkv import LLM, SamplingParams
from pagedkv.models.windows import every_layer_window
from pagedkv.runtime.model import prepared
from test_engine import assert_no_leaks, random_prompts

pytestmark = pytest.mark.usefixtures("engine_overlap")

WINDOW = 16
NEW = 40
SMALL = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
             num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=512,
             bos_token_id=1, eos_token_id=2, pad_token_id=0, sliding_window=WINDOW)
MIXED = {  # a layer without a window: nothing may be released
    "gemma2": dict(layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                   query_pre_attn_scalar=64, attn_logit_softcapping=5.0, final_logit_softcapping=4.0),
    "qwen2": dict(use_sliding_window=True, max_window_layers=1),
}
PROMPT_LENS = [50, 70, 33, 90]  # + 40 new: 7 to 17 blocks of 8 tokens each, 52 in all
NUM_BLOCKS = 24  # about 6 blocks a sequence: enough for a window, a chunk and a block of slack


_MODELS: dict = {}
_HF: dict = {}


def tiny(model_type: str, device: str, **fields):
    """One model per (type, device, fields), shared by the serial and the overlapped run."""
    key = (model_type, device, repr(sorted(fields.items())))
    if key not in _MODELS:
        _MODELS[key] = _build(model_type, device, **fields)
    return _MODELS[key]


def _build(model_type: str, device: str, **fields):
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**SMALL, **fields})
    eager = dict(attn_implementation="eager") if model_type == "gemma2" else {}
    model = widen(AutoModelForCausalLM.from_config(config, **eager), norms=model_type == "gemma2")
    return model.to(device).eval()


def hf_greedy(model, prompts: list[list[int]]) -> list[list[int]]:
    """HF generate's greedy tokens for each prompt alone (remembered per model and prompt)."""
    out = []
    for prompt in prompts:
        key = (id(model), tuple(prompt))
        if key not in _HF:
            ids = torch.tensor([prompt], device=model.device)
            hf = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
            _HF[key] = hf[0, len(prompt):].tolist()
        out.append(_HF[key])
    return out


def run(llm: LLM, prompts) -> tuple[list[list[int]], dict]:
    """Greedy tokens through the step loop, with what the cache held at each step: the peak of
    blocks in use and of sequences running, and the most blocks any sequence had released."""
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    ids = [llm.add_request(p, params) for p in prompts]
    seen = dict(blocks=0, running=0, released=0)
    tokens = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                tokens[out.request_id] = out.token_ids
        cache = llm.cache
        seen["blocks"] = max(seen["blocks"], cache.num_blocks - cache.num_free_blocks)
        seen["running"] = max(seen["running"], len(llm.scheduler.running))
        for seq_id in cache.manager.sequence_ids():
            seen["released"] = max(seen["released"], cache.released_blocks(seq_id))
    assert_no_leaks(llm)
    return [tokens[i] for i in ids], seen


@pytest.mark.parametrize("device", DEVICES)
def test_released_blocks_let_long_sequences_share_a_small_cache(device):
    model = tiny("mistral", device)
    assert every_layer_window(prepared(model).weights) == WINDOW
    prompts = random_prompts(PROMPT_LENS, seed=5)
    expected = hf_greedy(model, prompts)
    whole = tiny("mistral", device, sliding_window=512)
    assert hf_greedy(whole, prompts[:1]) != expected[:1]  # the window changes HF's tokens here

    def engine():
        return LLM(model, num_kv_blocks=NUM_BLOCKS, block_size=8, max_num_seqs=4, max_num_batched_tokens=32)

    llm = engine()
    got, seen = run(llm, prompts)
    assert got == expected
    assert seen["released"] > 0 and seen["running"] == 4
    assert llm.stats.num_preemptions == 0 and seen["blocks"] <= NUM_BLOCKS

    kept = engine()
    kept.scheduler.window = 0  # the same engine keeping every block: the sequences do not fit together
    got, seen_kept = run(kept, prompts)
    assert got == expected and seen_kept["released"] == 0
    assert kept.stats.num_preemptions > 0


@pytest.mark.parametrize("device", DEVICES)
def test_prefix_hits_and_forks_after_a_release(device):
    """A prompt whose leading blocks a finished request released finds them cached again; n = 2
    greedy samples fork after a release and both give HF's tokens."""
    model = tiny("mistral", device)
    prompt = random_prompts([80], seed=6)[0]
    expected = hf_greedy(model, [prompt])[0]
    llm = LLM(model, num_kv_blocks=64, block_size=8, max_num_seqs=4, max_num_batched_tokens=32)
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    assert llm.generate([prompt], params, use_tqdm=False)[0].token_ids == expected
    out = llm.generate([prompt], SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, n=2),
                       use_tqdm=False)[0]
    assert out.num_cached_prompt_tokens > 0
    assert [c.token_ids for c in out.outputs] == [expected, expected]
    assert_no_leaks(llm)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model_type", list(MIXED))
def test_a_model_with_a_whole_context_layer_releases_nothing(model_type, device):
    model = tiny(model_type, device, **MIXED[model_type])
    assert pagedkv.support_path(model) == "native", pagedkv.unsupported_reason(model)
    assert every_layer_window(prepared(model).weights) == 0
    prompts = random_prompts(PROMPT_LENS[:2], seed=7)
    llm = LLM(model, num_kv_blocks=64, block_size=8, max_num_seqs=4, max_num_batched_tokens=32)
    assert llm.scheduler.window == 0
    got, seen = run(llm, prompts)
    assert seen["released"] == 0
    assert got == hf_greedy(model, prompts)


@pytest.mark.parametrize("device", DEVICES)
def test_prompt_lookup_truncates_rejected_tokens_after_a_release(device):
    """Speculative rows (HF's prompt lookup) reserve proposals past a release and give the
    rejected ones back (truncate): HF's greedy tokens, blocks released, nothing held after."""
    model = tiny("mistral", device)
    motif = random_prompts([12], seed=8)[0]
    prompts = [motif * 6, random_prompts([60], seed=9)[0]]  # repeats: proposals accepted and rejected
    llm = LLM(model, num_kv_blocks=64, block_size=8, max_num_seqs=4, max_num_batched_tokens=32,
              prompt_lookup_num_tokens=3)
    got, seen = run(llm, prompts)
    assert seen["released"] > 0
    assert got == hf_greedy(model, prompts)
