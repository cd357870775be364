"""pagedkv.LLM against per-request HF generate, token for token (tiny random models, fp32, CPU):
mixed lengths, forced preemption, chunked prefill, prefix hits, stop ids, n > 1, the step and
streaming APIs, bad inputs. Every run must give all cache blocks back."""

from __future__ import annotations

import functools

import pytest
import torch

import pagedkv
import tp_worker
from pagedkv import LLM, SamplingParams
from models import tiny_model
from tolerance import assert_tokens_equal_up_to_near_tie
from pagedkv.runtime.model import prepared

# Every test runs with the engine stepping serially and overlapped (conftest.engine_overlap).
pytestmark = pytest.mark.usefixtures("engine_overlap")

MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)


@functools.lru_cache(maxsize=None)
def model(arch: str = "llama"):
    return tiny_model(arch)


@functools.lru_cache(maxsize=None)
def hf_greedy(arch: str, prompt: tuple[int, ...], max_new: int = MAX_NEW) -> list[int]:
    out = model(arch).generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False,
                               eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def random_prompts(lengths, seed=0, vocab=256):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def assert_nothing_held(model) -> None:
    """No sequence and no block left in the cache pagedkv.generate keeps for `model`."""
    cache = pagedkv.kv_cache_of(model)
    assert len(cache.manager) == 0 and cache.num_free_blocks == cache.num_blocks


def assert_no_leaks(llm: LLM) -> None:
    assert not llm.has_unfinished_requests()
    assert llm.cache.num_free_blocks == llm.cache.num_blocks
    assert len(llm.cache.manager) == 0


def assert_llm_gives_hf_greedy_tokens(llm: LLM, model, prompts, greedy: dict) -> None:
    """llm's greedy tokens for `prompts` (generated together) equal HF generate's with `greedy`
    (its max_new_tokens, one prompt at a time, on the model's device); nothing held after."""
    params = SamplingParams(max_tokens=greedy["max_new_tokens"], temperature=0, ignore_eos=True)
    got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    for prompt, tokens in zip(prompts, got):
        hf = model.generate(torch.tensor([prompt], device=model.device), **greedy)
        assert tokens == hf[0, len(prompt):].tolist(), f"prompt of {len(prompt)} tokens"
    assert_no_leaks(llm)


def assert_native_generate_gives_hf_tokens(model, weights_type: type, greedy: dict) -> None:
    """pagedkv.generate on a left-padded batch of two prompts (CUDA graphs on CUDA) runs `model`
    natively on `weights_type` and gives HF generate's greedy tokens (`greedy`: its arguments,
    which must make >= 4 distinct tokens, so a stuck model fails); nothing held after."""
    assert pagedkv.support_path(model) == "native", pagedkv.unsupported_reason(model)
    ids, mask = tp_worker.left_padded([5, 19], 256, str(model.device), seed=1)
    expected = model.generate(ids, attention_mask=mask, **greedy)  # [2, 19 + new]
    assert len(set(expected[:, ids.shape[1]:].flatten().tolist())) >= 4, expected
    got = pagedkv.generate(model, ids, attention_mask=mask, **greedy)
    assert type(prepared(model).weights) is weights_type
    assert torch.equal(got, expected)
    assert_nothing_held(model)


def assert_generate_gives_hf_tokens_up_to_near_tie(model, greedy: dict) -> None:
    """bf16: pagedkv.generate's tokens on a left-padded batch of two prompts equal HF's up to the
    first near-tie in HF's logits (tolerance.assert_tokens_equal_up_to_near_tie); nothing held."""
    ids, mask = tp_worker.left_padded([5, 19], 256, str(model.device), seed=1)
    expected = model.generate(ids, attention_mask=mask, **greedy, output_logits=True, return_dict_in_generate=True)
    got = pagedkv.generate(model, ids, attention_mask=mask, **greedy)
    assert_tokens_equal_up_to_near_tie(got, expected, ids.shape[1])
    assert_nothing_held(model)


def check_greedy(llm: LLM, prompts, arch="llama"):
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.prompt_token_ids == prompt
        assert out.token_ids == hf_greedy(arch, tuple(prompt)), f"prompt of {len(prompt)} tokens"
        assert out.finish_reason == "length" and out.finished
    assert_no_leaks(llm)
    return outs


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_mixed_lengths_match_hf(arch):
    llm = LLM(model(arch), max_num_seqs=8, max_num_batched_tokens=256)
    check_greedy(llm, random_prompts([5, 40, 17, 1, 70, 33]), arch)


def test_forced_preemption_matches_hf():
    llm = LLM(model(), num_kv_blocks=10, max_num_seqs=8, max_num_batched_tokens=128)
    check_greedy(llm, random_prompts([30, 45, 20, 60, 9, 50], seed=1))
    assert llm.stats.num_preemptions > 0


def test_chunked_prefill_matches_hf():
    llm = LLM(model(), max_num_seqs=4, max_num_batched_tokens=16)
    prompts = random_prompts([70, 3, 37, 16, 17], seed=2)
    check_greedy(llm, prompts)
    assert llm.stats.num_prompt_tokens_computed == sum(map(len, prompts))
    # every prompt longer than the budget took several steps
    assert llm.stats.num_steps >= sum(len(p) for p in prompts) // 16


def test_prefix_hits_skip_prefill_and_match_hf():
    llm = LLM(model(), max_num_seqs=8, max_num_batched_tokens=512)
    shared = random_prompts([48], seed=3)[0]
    first = shared + [7, 8, 9]
    check_greedy(llm, [first])
    computed = llm.stats.num_prompt_tokens_computed
    others = [shared + tail for tail in random_prompts([5, 20, 1], seed=4)]
    outs = check_greedy(llm, others)
    assert [o.num_cached_prompt_tokens for o in outs] == [48, 48, 48]
    assert llm.stats.num_cached_prompt_tokens == 3 * 48
    assert llm.stats.num_prompt_tokens_computed - computed == sum(len(p) - 48 for p in others)


def test_prefix_hits_within_one_step():
    """Requests admitted together: the later ones read blocks that the same forward writes."""
    llm = LLM(model(), max_num_seqs=4, max_num_batched_tokens=256)
    shared = random_prompts([36], seed=15)[0]
    outs = check_greedy(llm, [shared, shared + [5], shared[:33]])
    assert [o.num_cached_prompt_tokens for o in outs] == [0, 32, 32]
    assert llm.stats.num_steps == MAX_NEW  # all three prefilled in the first step


def test_prefix_hits_with_chunking_and_preemption():
    shared = random_prompts([40], seed=5)[0]
    prompts = [shared + tail for tail in random_prompts([9, 30, 2, 25], seed=6)]
    llm = LLM(model(), num_kv_blocks=12, max_num_seqs=4, max_num_batched_tokens=24)
    check_greedy(llm, prompts)
    assert llm.stats.num_cached_prompt_tokens > 0


def test_stop_token_ids_and_eos():
    prompt = random_prompts([11], seed=7)[0]
    free = hf_greedy("llama", tuple(prompt))
    stop = free[4]
    llm = LLM(model(), max_num_seqs=4)
    outs = llm.generate([prompt, prompt], [
        SamplingParams(max_tokens=MAX_NEW, temperature=0, stop_token_ids=[stop]),
        SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)], use_tqdm=False)
    first = free.index(stop) + 1
    assert outs[0].token_ids == free[:first] and outs[0].finish_reason == "stop"
    assert outs[1].token_ids == free[:3] and outs[1].finish_reason == "length"
    llm.eos_token_ids = frozenset([stop])  # the model's EOS, unless ignore_eos
    out = llm.generate(prompt, SamplingParams(max_tokens=MAX_NEW, temperature=0), use_tqdm=False)[0]
    assert out.token_ids == free[:first] and out.finish_reason == "stop"
    assert_no_leaks(llm)


def test_n_samples_share_the_prompt_by_fork():
    prompt = random_prompts([37], seed=8)[0]
    llm = LLM(model(), max_num_seqs=8)
    out = llm.generate(prompt, SamplingParams(n=3, max_tokens=MAX_NEW, temperature=0, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(c.token_ids == hf_greedy("llama", tuple(prompt)) for c in out.outputs)
    assert llm.stats.num_prompt_tokens_computed == len(prompt)  # one prefill for the three
    assert_no_leaks(llm)


def sampled(llm: LLM, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_no_leaks(llm)
    return [[c.token_ids for c in o.outputs] for o in outs]


def test_seeded_sampling_independent_of_batch_and_preemption():
    prompts = random_prompts([21, 50, 8, 33], seed=9)
    params = [SamplingParams(n=2, max_tokens=MAX_NEW, temperature=1.0, top_k=50, top_p=0.9,
                             seed=100 + i, ignore_eos=True) for i in range(len(prompts))]
    alone = [sampled(LLM(model(), max_num_seqs=2), [p], [sp])[0] for p, sp in zip(prompts, params)]
    together = sampled(LLM(model(), max_num_seqs=8), prompts, params)
    tight = LLM(model(), num_kv_blocks=8, max_num_seqs=8, max_num_batched_tokens=32)
    squeezed = sampled(tight, prompts, params)
    assert tight.stats.num_preemptions > 0
    assert together == alone and squeezed == alone
    assert any(a != b for a, b in alone)  # the two samples of a prompt differ


def test_step_api_and_partial_outputs():
    llm = LLM(model(), max_num_seqs=4)
    prompts = random_prompts([6, 25], seed=10)
    ids = [llm.add_request(p, GREEDY, request_id=f"r{i}") for i, p in enumerate(prompts)]
    seen: dict[str, list[int]] = {i: [] for i in ids}
    finished = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            assert len(out.token_ids) == len(seen[out.request_id]) + 1
            seen[out.request_id] = list(out.token_ids)
            if out.finished:
                finished[out.request_id] = out
    assert [finished[i].token_ids for i in ids] == [hf_greedy("llama", tuple(p)) for p in prompts]
    m = finished["r1"].metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert m.time_to_first_token > 0 and m.latency >= m.time_to_first_token
    assert_no_leaks(llm)


def test_stream_yields_progress_then_result_and_cleans_up_when_stopped():
    llm = LLM(model(), max_num_seqs=4)
    prompts = random_prompts([9, 14, 30], seed=11)
    last = {}
    for out in llm.stream(prompts, GREEDY):
        last[out.request_id] = out
    assert all(o.finished for o in last.values())
    assert [o.token_ids for o in last.values()] == [hf_greedy("llama", tuple(p)) for p in prompts]
    for out in llm.stream(prompts, GREEDY):
        break  # the consumer leaves early: its requests are aborted, their blocks freed
    assert_no_leaks(llm)


class CharTokenizer:
    """A stand-in tokenizer: one token per character (ids 3..), EOS 2."""

    def encode(self, text):
        return [3 + ord(c) % 250 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + (i % 26)) for i in ids if not (skip_special_tokens and i < 3))


def test_string_prompts_and_text():
    llm = LLM(model(), tokenizer=CharTokenizer(), max_num_seqs=4)
    outs = llm.generate(["hello world", "paged"], GREEDY, use_tqdm=False)
    tok = CharTokenizer()
    assert outs[0].prompt == "hello world"
    assert outs[0].token_ids == hf_greedy("llama", tuple(tok.encode("hello world")))
    assert outs[1].text == tok.decode(outs[1].token_ids)
    assert_no_leaks(llm)


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.5), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(max_tokens=0), "max_tokens"), (dict(n=0), "n must"), (dict(top_k=-2), "top_k"),
    (dict(seed=-3), "seed"),
])
def test_invalid_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_bad_inputs_raise_and_leave_the_engine_usable():
    llm = LLM(model(), num_kv_blocks=8, max_num_seqs=4)  # 128 tokens
    good = random_prompts([10], seed=12)[0]
    with pytest.raises(ValueError, match="empty"):
        llm.generate([good, []], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="at most 127"):
        llm.generate([good, list(range(3, 200))], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="outside"):
        llm.add_request([5, 999], GREEDY)
    with pytest.raises(ValueError, match="tokenizer"):
        llm.add_request("text", GREEDY)
    with pytest.raises(ValueError, match="max_num_seqs"):
        llm.add_request(good, SamplingParams(n=5))
    llm.add_request(good, GREEDY, request_id="x")
    with pytest.raises(ValueError, match="in use"):
        llm.add_request(good, GREEDY, request_id="x")
    llm.abort_request("x")
    assert_no_leaks(llm)
    check_greedy(llm, [good])
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLM(model(), max_num_seqs=64, max_num_batched_tokens=32)


def test_generation_stops_at_max_model_len():
    llm = LLM(model(), max_num_seqs=2, max_model_len=40)
    prompt = random_prompts([35], seed=13)[0]
    out = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert out.token_ids == hf_greedy("llama", tuple(prompt))[:5]
    assert_no_leaks(llm)


def test_exports():
    assert pagedkv.LLM is LLM and pagedkv.SamplingParams is SamplingParams


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_decode_steps_match_eager(dtype):
    """On the GPU: decode-only steps replayed as CUDA graphs give the eager engine's tokens
    (greedy and seeded), under preemption, chunking and prefix hits; fp32 also equals HF."""
    gpu_model = tiny_model("qwen3", dtype=dtype, device="cuda")
    prompts = random_prompts([30, 45, 20, 60, 9, 50, 1, 17], seed=14)
    params = [SamplingParams(max_tokens=MAX_NEW, temperature=0.0 if i % 2 else 0.8, seed=i,
                             ignore_eos=True) for i in range(len(prompts))]
    runs = []
    for graphs in (False, True):
        llm = LLM(gpu_model, num_kv_blocks=12, max_num_seqs=8, max_num_batched_tokens=48,
                  use_cuda_graphs=graphs)
        runs.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        assert llm.stats.num_preemptions > 0
        assert_no_leaks(llm)
    assert runs[0] == runs[1]
    if dtype == torch.float32:  # greedy rows equal HF's generate on the same GPU model
        for prompt, got, p in zip(prompts, runs[1], params):
            if p.greedy:
                out = gpu_model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=MAX_NEW,
                                         do_sample=False, eos_token_id=None, pad_token_id=0)
                assert got == out[0, len(prompt):].tolist()
