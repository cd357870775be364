"""pagedkv.LLM after its model's weights are written in place (an optimizer step, load_state_dict,
an op under no_grad): the prefix cache's K/V came from the old weights, so a later request must
not reuse them; requests still unfinished at the write hold such K/V, so a new request is refused
until they are finished or aborted (nothing queued, the next call correct)."""

from __future__ import annotations

import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.runtime.model import ModelChanged
from models import tiny_model

pytestmark = pytest.mark.usefixtures("engine_overlap")

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def _hf(model, prompt):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _write(model):
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight.mul_(1.7)


def test_cached_blocks_are_not_reused_after_an_in_place_write():
    model = tiny_model("llama", seed=3)
    llm = LLM(model, max_num_seqs=4, max_num_batched_tokens=256)
    prompt = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    before = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert before == _hf(model, prompt)
    _write(model)
    after = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert after == _hf(model, prompt) != before
    assert llm.cache.num_free_blocks == llm.cache.num_blocks


def test_a_write_while_requests_run_refuses_new_requests_until_they_end():
    model = tiny_model("llama", seed=3)
    llm = LLM(model, max_num_seqs=4, max_num_batched_tokens=256)
    prompt = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    llm.add_request(prompt, GREEDY, request_id="old")
    llm.step()
    _write(model)
    with pytest.raises(ModelChanged, match="written in place"):
        llm.add_request(prompt, GREEDY, request_id="new")
    with pytest.raises(ModelChanged, match="abort"):
        llm.generate([prompt], GREEDY, use_tqdm=False)
    llm.abort_request("old")
    out = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert out == _hf(model, prompt)
    assert llm.cache.num_free_blocks == llm.cache.num_blocks
