"""The soak run of scripts/soak.py scaled down for CI: 300 requests of random lengths through a
12-block cache (preemption all the time, prefix hits, forks, stop tokens, aborts), every output
equal to HF's greedy tokens and no block leaked. The full run: `python scripts/soak.py`."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

_spec = importlib.util.spec_from_file_location("soak", Path(__file__).parents[1] / "scripts" / "soak.py")
soak = importlib.util.module_from_spec(_spec)
sys.modules["soak"] = soak  # dataclasses look their module up there
_spec.loader.exec_module(soak)


def test_soak_scaled_down():
    threads = torch.get_num_threads()
    try:
        result = soak.run(soak.parse_args(["--requests", "300", "--no-tqdm", "--check-every", "5"]))
    finally:
        torch.set_num_threads(threads)
    assert result.ok, result.summary()
    assert result.near_ties <= 1, result.summary()  # rare: a tie of HF's fp32 logits
    assert result.requests == result.finished + result.aborted == 300
    # The run exercised what it is there for.
    assert result.preemptions > 20 and result.aborted > 0 and result.cached_prompt_tokens > 0
    assert result.interrupts > 0
    assert result.tokens > 300


def test_leak_check_sees_a_leak():
    llm = soak.LLM(soak.tiny_model(0), num_kv_blocks=4, max_num_seqs=2)
    assert soak.leak_problems(llm) == []
    llm.cache.add_sequence(99, [5, 6, 7])  # held by the cache, run by nobody
    assert any("not running" in p for p in soak.leak_problems(llm))


def test_near_tie_needs_a_tie_of_hf_logits():
    """The soak's allowance covers only a token HF's own logits rank level with HF's choice."""
    model = soak.tiny_model(0)
    reference = soak.Reference(model, 8)
    prompt = [5, 6, 7, 8]
    want = reference.expected(prompt, soak.SamplingParams(max_tokens=8, temperature=0))
    hf = model.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False, eos_token_id=None,
                        pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    wrong = want[:3] + [int(hf.logits[3][0].argmin())] + want[4:]
    assert not reference.near_tie(prompt, wrong, want)
    assert reference.near_tie(prompt, wrong, want, rel=float("inf"))
    assert not reference.near_tie(prompt, want[:5], want)  # same tokens, shorter: a mismatch
