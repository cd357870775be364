"""pagedkv.LLM's vLLM-style inputs (tiny random fp32 models, CPU; CUDA variants marked): repetition,
presence and frequency penalties and min_p against HF or a plain-PyTorch reference, logprobs of
the raw distribution against HF's output_logits, penalties and logprobs beside plain requests,
through preemption and faults. Stop strings, prompt dicts, chat and bad values:
tests/test_llm_text_inputs.py."""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICES
from models import tiny_model
from pagedkv import LLM, SamplingParams
from test_engine import assert_no_leaks, hf_greedy, model, random_prompts

# Tests whose device state crosses steps (penalty counts, logprob tables) run serially and overlapped.
overlapped = pytest.mark.usefixtures("engine_overlap")

MAX_NEW = 12
V = 256
# The runner's fp32 logits differ from HF's by ~1e-4 (another kernel order): logprobs too.
LOGPROB_TOL = 1e-3


def greedy(max_tokens: int = MAX_NEW, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kwargs)


def reference_greedy(prompt, max_new=MAX_NEW, repetition=1.0, presence=0.0, frequency=0.0, arch="llama"):
    """Greedy tokens of a full forward per token with vLLM's penalties (plain PyTorch)."""
    m, ids, out = model(arch), list(prompt), []
    for _ in range(max_new):
        with torch.no_grad():
            logits = m(torch.tensor([ids])).logits[0, -1].float()  # [V]
        counts = torch.bincount(torch.tensor(out, dtype=torch.int64), minlength=V).float()
        seen = torch.zeros(V, dtype=torch.bool)
        seen[ids] = True
        logits = torch.where(seen, torch.where(logits < 0, logits * repetition, logits / repetition), logits)
        logits = logits - frequency * counts - presence * (counts > 0)
        out.append(int(logits.argmax()))
        ids.append(out[-1])
    return out


def raw_logits(prompt, output, arch="llama", device="cpu"):
    """[len(output), V] raw logits that chose each output token (one forward of prompt + output)."""
    with torch.no_grad():
        logits = model_on(arch, device)(torch.tensor([list(prompt) + list(output)], device=device)).logits[0]
    return logits[len(prompt) - 1:-1].float().cpu()


def model_on(arch: str, device: str):
    return model(arch) if device == "cpu" else tiny_model(arch, device=device)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("penalty", [1.5, 0.7])
def test_repetition_penalty_greedy_matches_hf(arch, penalty):
    llm = LLM(model(arch), max_num_seqs=4)
    changed = 0
    for prompt in random_prompts([9, 30, 4], seed=11):
        hf = model(arch).generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False,
                                  repetition_penalty=penalty, eos_token_id=None, pad_token_id=0)
        expected = hf[0, len(prompt):].tolist()
        changed += expected != hf_greedy(arch, tuple(prompt))
        out = llm.generate(prompt, greedy(repetition_penalty=penalty), use_tqdm=False)[0]
        assert out.token_ids == expected
    assert changed  # the penalty changes tokens here
    assert_no_leaks(llm)


@pytest.mark.parametrize("kwargs", [dict(presence=1.0), dict(frequency=1.5),
                                    dict(repetition=1.3, presence=0.7, frequency=0.4)])
def test_presence_and_frequency_penalties_match_reference(kwargs):
    prompt = random_prompts([3], seed=12)[0]  # greedy repeats tokens within 24 (penalties matter)
    names = {"repetition": "repetition_penalty", "presence": "presence_penalty", "frequency": "frequency_penalty"}
    params = greedy(max_tokens=24, **{names[k]: v for k, v in kwargs.items()})
    expected = reference_greedy(prompt, 24, **kwargs)
    assert expected != reference_greedy(prompt, 24)
    llm = LLM(model(), max_num_seqs=4)
    assert llm.generate(prompt, params, use_tqdm=False)[0].token_ids == expected
    assert_no_leaks(llm)


@overlapped
def test_mixed_batch_each_request_gets_its_tokens_alone():
    """Penalized, logprob and plain requests in one batch, with preemption and chunked prefill:
    each gets what it gets alone (penalty counts are rebuilt for recomputed sequences)."""
    prompts = random_prompts([30, 45, 20, 60, 9, 50], seed=13)
    kinds = [greedy(repetition_penalty=1.4), greedy(), greedy(frequency_penalty=1.0, presence_penalty=0.5),
             greedy(logprobs=2), greedy(repetition_penalty=0.8, logprobs=1), greedy()]
    alone = LLM(model(), max_num_seqs=8)
    expected = [alone.generate(p, k, use_tqdm=False)[0] for p, k in zip(prompts, kinds)]
    llm = LLM(model(), num_kv_blocks=10, max_num_seqs=8, max_num_batched_tokens=32)
    outs = llm.generate(prompts, kinds, use_tqdm=False)
    assert llm.stats.num_preemptions > 0
    for out, want in zip(outs, expected):
        assert out.token_ids == want.token_ids
        assert (out.outputs[0].logprobs is None) == (want.outputs[0].logprobs is None)
    assert outs[1].token_ids == hf_greedy("llama", tuple(prompts[1]))
    assert outs[0].token_ids == reference_greedy(prompts[0], repetition=1.4)
    assert_no_leaks(llm)


def test_min_p_keeps_only_tokens_above_min_p_of_the_top():
    prompt = random_prompts([6], seed=14)[0]
    llm = LLM(model(), max_num_seqs=16)

    def violations(**kwargs):
        """Sampled tokens whose probability (temperature 2) is below 0.3 of the top token's."""
        params = SamplingParams(max_tokens=8, temperature=2.0, seed=5, n=12, ignore_eos=True, **kwargs)
        bad = 0
        for sample in llm.generate(prompt, params, use_tqdm=False)[0].outputs:
            probs = torch.softmax(raw_logits(prompt, sample.token_ids) / 2.0, dim=-1)
            chosen = probs.gather(1, torch.tensor(sample.token_ids)[:, None])[:, 0]
            bad += int((chosen < 0.3 * probs.amax(dim=-1) * (1 - 1e-5)).sum())
        return bad

    assert violations() > 0  # the distribution does put mass there
    assert violations(min_p=0.3) == 0
    assert_no_leaks(llm)


def test_top_k_minus_one_is_off():
    prompt = random_prompts([8], seed=15)[0]
    llm = LLM(model(), max_num_seqs=4)
    outs = [llm.generate(prompt, SamplingParams(max_tokens=10, temperature=1.0, seed=3, top_k=k), use_tqdm=False)[0]
            for k in (-1, 0, 5)]
    assert SamplingParams(top_k=-1).top_k == 0
    assert outs[0].token_ids == outs[1].token_ids != outs[2].token_ids


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_match_hf_raw_logits(device):
    prompt = random_prompts([3], seed=12)[0]
    m = model_on("llama", device)
    hf = m.generate(torch.tensor([prompt], device=device), max_new_tokens=MAX_NEW, do_sample=False,
                    output_logits=True, return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    llm = LLM(m, max_num_seqs=4, use_cuda_graphs=None)
    # repetition_penalty changes the tokens, not the logprobs: those are of the raw distribution
    plain, penalized, zero = llm.generate([prompt] * 3, [greedy(logprobs=3), greedy(logprobs=3, repetition_penalty=3.0),
                                                         greedy(logprobs=0)], use_tqdm=False)
    assert plain.token_ids == hf.sequences[0, len(prompt):].tolist()
    for step, (token, entry) in enumerate(zip(plain.token_ids, plain.outputs[0].logprobs)):
        logprobs = torch.log_softmax(hf.logits[step][0].float().cpu(), dim=-1)
        top = logprobs.topk(3)
        assert list(entry) == top.indices.tolist()  # greedy: the sampled token is the top one
        assert [e.rank for e in entry.values()] == [1, 2, 3]
        torch.testing.assert_close(torch.tensor([e.logprob for e in entry.values()]), top.values,
                                   atol=LOGPROB_TOL, rtol=0)
    cumulative = sum(e[t].logprob for t, e in zip(plain.token_ids, plain.outputs[0].logprobs))
    assert plain.outputs[0].cumulative_logprob == pytest.approx(cumulative)
    raw = torch.log_softmax(raw_logits(prompt, penalized.token_ids, device=device), dim=-1)
    for step, (token, entry) in enumerate(zip(penalized.token_ids, penalized.outputs[0].logprobs)):
        first = next(iter(entry))
        assert first == token and entry[token].logprob == pytest.approx(float(raw[step, token]), abs=LOGPROB_TOL)
        assert entry[token].rank == int((raw[step] >= raw[step, token]).sum())
    assert penalized.token_ids != plain.token_ids
    assert [list(e) for e in zero.outputs[0].logprobs] == [[t] for t in plain.token_ids]
    assert zero.outputs[0].logprobs is not None and plain.outputs[0].logprobs[0] is not None
    assert_no_leaks(llm)


@overlapped
def test_logprobs_of_sampled_tokens_and_n_samples():
    prompt = random_prompts([10], seed=17)[0]
    llm = LLM(model(), max_num_seqs=8)
    out = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=9, n=3, logprobs=2,
                                              ignore_eos=True), use_tqdm=False)[0]
    for sample in out.outputs:
        raw = torch.log_softmax(raw_logits(prompt, sample.token_ids), dim=-1)
        assert len(sample.logprobs) == len(sample.token_ids) == 8
        for step, (token, entry) in enumerate(zip(sample.token_ids, sample.logprobs)):
            assert next(iter(entry)) == token
            assert entry[token].logprob == pytest.approx(float(raw[step, token]), abs=LOGPROB_TOL)
            assert set(raw[step].topk(2).indices.tolist()) <= set(entry)
    streamed = {}
    for partial in llm.stream(prompt, SamplingParams(max_tokens=5, temperature=0, logprobs=1, ignore_eos=True)):
        assert len(partial.outputs[0].logprobs) == len(partial.token_ids)
        streamed[len(partial.token_ids)] = partial
    assert sorted(streamed) == [1, 2, 3, 4, 5]
    assert_no_leaks(llm)


@overlapped
@pytest.mark.parametrize("fault", ["forward", "interrupt"])
def test_penalties_and_logprobs_survive_a_fault(fault, monkeypatch):
    """A failed step (its samples never read) and an interrupt between a token's append and its
    logprobs' read: stepping on gives the tokens and logprobs of a run without the fault."""
    prompts = random_prompts([12, 20], seed=18)
    kinds = [greedy(repetition_penalty=1.3, logprobs=2), SamplingParams(max_tokens=MAX_NEW, temperature=1.0,
                                                                          seed=4, frequency_penalty=1.0,
                                                                          logprobs=1, ignore_eos=True)]
    clean = LLM(model(), max_num_seqs=4).generate(prompts, kinds, use_tqdm=False)
    llm = LLM(model(), max_num_seqs=4)
    for p, k in zip(prompts, kinds):
        llm.add_request(p, k)
    calls = {"n": 0}
    if fault == "forward":
        run = llm.runner.run

        def flaky(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 5:
                raise RuntimeError("injected")
            return run(*args, **kwargs)

        monkeypatch.setattr(llm.runner, "run", flaky)
    else:
        import pagedkv.engine.llm as engine_llm
        read = engine_llm.read_watched

        def flaky(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 5:
                raise KeyboardInterrupt
            return read(*args, **kwargs)

        monkeypatch.setattr(engine_llm, "read_watched", flaky)
    finished, raised = {}, 0
    while llm.has_unfinished_requests():
        try:
            outs = llm.step()
        except (RuntimeError, KeyboardInterrupt):
            raised += 1
            continue
        finished.update({o.request_id: o for o in outs if o.finished})
    assert raised == 1
    for want, got in zip(clean, (finished["0"], finished["1"])):
        assert got.token_ids == want.token_ids
        assert [list(e) for e in got.outputs[0].logprobs] == [list(e) for e in want.outputs[0].logprobs]
    assert_no_leaks(llm)


@overlapped
@pytest.mark.parametrize("device", DEVICES)
def test_penalties_on_device_match_reference(device):
    prompts = random_prompts([9, 33, 14], seed=19)
    llm = LLM(model_on("llama", device), max_num_seqs=4)
    kinds = [greedy(repetition_penalty=1.4), greedy(frequency_penalty=1.2, presence_penalty=0.3), greedy()]
    outs = llm.generate(prompts, kinds, use_tqdm=False)
    assert outs[0].token_ids == reference_greedy(prompts[0], repetition=1.4)
    assert outs[1].token_ids == reference_greedy(prompts[1], frequency=1.2, presence=0.3)
    assert outs[2].token_ids == reference_greedy(prompts[2])
    assert_no_leaks(llm)
