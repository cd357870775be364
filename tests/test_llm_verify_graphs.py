"""pagedkv.LLM's verification steps as decode rows (runner.run_decode_rows): a step whose rows are
all decode rows, some verifying a proposal (k_i + 1 tokens), runs each of its tokens as a decode
row of its own, and on CUDA replays as a CUDA graph per (row bucket, token bucket). Greedy tokens
against the engine without speculation and HF's generate (tiny random fp32 models), rows of mixed
widths, steps with a prefill chunk beside verification rows (still the eager prefill-shaped
step); every block given back. The padded layout itself runs on the CPU too (eagerly)."""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICES
from pagedkv import LLM, SamplingParams
from pagedkv.cache import KVCache
from pagedkv.runtime.model import prepared
from pagedkv.runtime.runner import ModelRunner, StepInput, decode_rows_padding, tokens_as_decode_rows
from test_assistant_model import target, truncated
from test_engine import assert_no_leaks
from test_llm_speculative import assert_draft_free, repeating_prompts

MAX_TOKENS = (24, 1, 2, 17, 30, 5, 24, 9, 13)
K_OF_REQUEST = (None, 2, 0, 1, None, 3, 2, None, 0)  # per request: the engine's k, another, off


class Spied:
    """The engine's runner calls, by the engine's step number: run() (decode and prefill-shaped
    steps), run_decode_rows() (with each step's query lengths), Speculation.verify()."""

    def __init__(self, llm: LLM) -> None:
        self.run: list[int] = []
        self.rows: list[tuple[int, list[int]]] = []
        self.verified: list[int] = []
        runner, spec = llm.runner, llm.speculation
        run, rows, verify = runner.run, runner.run_decode_rows, spec.verify

        def spy_run(step):
            self.run.append(llm.stats.num_steps)
            return run(step)

        def spy_rows(step):
            self.rows.append((llm.stats.num_steps, list(step.query_lens)))
            return rows(step)

        def spy_verify(logits, verify_rows):
            self.verified.append(llm.stats.num_steps)
            return verify(logits, verify_rows)

        runner.run, runner.run_decode_rows, spec.verify = spy_run, spy_rows, spy_verify


def hf_tokens(model, prompts, max_tokens) -> list[list[int]]:
    out = []
    for prompt, n in zip(prompts, max_tokens):
        ids = model.generate(torch.tensor([prompt], device=model.device), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        out.append(ids[0, len(prompt):].tolist())
    return out


def graph_keys(llm: LLM, spied: Spied) -> list[tuple]:
    """The CUDA-graph key of each decode-rows step the engine ran."""
    runner = llm.runner
    out = []
    for _, lens in spied.rows:
        rows, tokens = decode_rows_padding(len(lens), sum(lens), runner.max_batch, llm.cache.max_step_tokens)
        out.append(("decode_rows", rows, tokens))
    return out


def check_greedy(device: str, method: str, use_cuda_graphs: bool | None) -> tuple[LLM, Spied]:
    """LLM with `method` ("lookup" or "draft"): greedy tokens equal to the engine's without
    speculation and to HF's, verification steps run as decode rows of mixed widths, and steps
    with a prefill chunk beside verification rows run prefill-shaped; nothing held after."""
    model = target(device)
    option = "prompt_lookup_num_tokens" if method == "lookup" else "num_assistant_tokens"
    spec = dict(prompt_lookup_num_tokens=4) if method == "lookup" else dict(
        assistant_model=truncated(model), num_assistant_tokens=4)
    prompts = repeating_prompts(len(MAX_TOKENS), seed=3)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **({} if k is None else {option: k}))
              for n, k in zip(MAX_TOKENS, K_OF_REQUEST)]
    # a small cache each: two engines are alive at once (0.9 of free memory each would not fit)
    sizes = dict(max_num_seqs=4, max_num_batched_tokens=64, use_cuda_graphs=use_cuda_graphs, kv_cache_memory=64 << 20)
    llm = LLM(model, **sizes, **spec)
    spied = Spied(llm)
    got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    plain = LLM(model, **sizes)
    plain_params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in MAX_TOKENS]
    assert got == [o.token_ids for o in plain.generate(prompts, plain_params, use_tqdm=False)]
    assert got == hf_tokens(model, prompts, MAX_TOKENS)
    stats = llm.speculation.stats
    assert 0 < stats.accepted < stats.proposed, stats
    assert spied.rows, "no verification step ran as decode rows"
    assert any(len(set(lens)) >= 2 for _, lens in spied.rows), spied.rows  # rows of 1 and k_i + 1 tokens
    assert len({n for _, lens in spied.rows for n in lens}) >= 3, spied.rows  # and several k_i
    rows_steps = {step for step, _ in spied.rows}
    assert rows_steps <= set(spied.verified)  # every decode-rows step verified a proposal
    assert set(spied.verified) & set(spied.run), "no step had a prefill chunk beside verification rows"
    assert not rows_steps & set(spied.run)
    assert_no_leaks(llm)
    assert_draft_free(llm)
    return llm, spied


@pytest.mark.parametrize("method", ["lookup", "draft"])
def test_greedy_decode_rows_cpu(method):
    check_greedy("cpu", method, None)


@pytest.mark.cuda
@pytest.mark.parametrize("method", ["lookup", "draft"])
@pytest.mark.parametrize("use_cuda_graphs", [True, False])
def test_greedy_decode_rows_cuda(method, use_cuda_graphs):
    llm, spied = check_greedy("cuda", method, use_cuda_graphs)
    keys = graph_keys(llm, spied)
    if use_cuda_graphs:
        assert all(llm.runner.graphs.get(key) is not None for key in keys), keys
        assert len(set(keys)) < len(keys)  # some steps replayed a graph captured before
    else:
        assert not any(llm.runner.graphs.get(key) for key in keys)


@pytest.mark.cuda
def test_verify_graphs_off_runs_decode_rows_eagerly(monkeypatch):
    """PAGEDKV_VERIFY_GRAPHS=0 (an A/B switch): the same tokens, no decode-rows graph captured."""
    monkeypatch.setenv("PAGEDKV_VERIFY_GRAPHS", "0")
    llm, spied = check_greedy("cuda", "lookup", True)
    assert not any(llm.runner.graphs.get(key) for key in graph_keys(llm, spied))


def test_padding_of_decode_rows():
    """Rows to a batch bucket (padding rows of one token) if they fit the step, tokens to a
    bucket: past the largest batch bucket a multiple of 64, never past max_step_tokens."""
    assert decode_rows_padding(1, 5, 4, 64) == (1, 8)
    assert decode_rows_padding(3, 7, 4, 64) == (4, 8)  # 7 + a padding row's token
    assert decode_rows_padding(3, 9, 4, 64) == (4, 16)
    assert decode_rows_padding(3, 12, 4, 12) == (3, 12)  # no room for a padding row
    assert decode_rows_padding(3, 11, 4, 13) == (4, 13)  # 16 would be past max_step_tokens
    assert decode_rows_padding(5, 40, 8, 42) == (5, 42)
    assert decode_rows_padding(64, 300, 64, 8192) == (64, 320)
    assert decode_rows_padding(2, 257, 256, 8192) == (2, 320)


def test_padded_tokens_of_the_step_metadata():
    cache = KVCache(num_layers=1, num_kv_heads=1, head_dim=8, num_blocks=8, block_size=16,
                    dtype=torch.float32, device="cpu", max_batch_size=4, max_step_tokens=16)
    cache.add_sequence(1, list(range(10)))
    cache.add_sequence(2, list(range(5)))
    meta = cache.build_metadata([1, 2], [3, 1], padded_batch=4, padded_tokens=12)
    assert meta.num_tokens == 12 and meta.num_seqs == 2
    assert meta.query_start_loc.tolist() == [0, 3, 4, 5, 6]
    assert meta.context_lens.tolist() == [10, 5, 0, 0]
    assert meta.positions.tolist() == [7, 8, 9, 4] + [0] * 8
    assert meta.slot_mapping[:4].tolist() == [7, 8, 9, 16 + 4] and meta.slot_mapping[4:].tolist() == [-1] * 8
    for bad, match in ((17, "padded_tokens = 17 must be in \\[6, 16\\]"), (5, "padded_tokens = 5 must be in")):
        with pytest.raises(ValueError, match=match):
            cache.build_metadata([1, 2], [3, 1], padded_batch=4, padded_tokens=bad)
    cache.free_all()


@pytest.mark.parametrize("device", DEVICES)
def test_padded_decode_rows_equal_the_prefill_shaped_step(device):
    """Rows of widths 4, 1 and 3, padded to 4 rows and 16 tokens, each token as a decode row
    (eagerly, as a CUDA graph runs it): the logits of the prefill-shaped step to fp32 rounding,
    and padding tokens write no K/V."""
    model = target(device)
    state = prepared(model)
    w = state.weights
    cache = KVCache(len(w.layers), w.num_kv_heads, w.head_dim, dtype=state.dtype, device=state.device,
                    block_size=16, num_blocks=16, max_seq_len=state.max_positions, enable_prefix_caching=False,
                    max_batch_size=4, max_step_tokens=64)
    runner = ModelRunner(state, cache, use_cuda_graphs=False)
    lengths, widths = [3, 21, 12], [4, 1, 3]
    torch.manual_seed(0)
    with torch.inference_mode():
        prompts = [torch.randint(3, 256, (n,)).tolist() for n in lengths]
        for sid, prompt in enumerate(prompts):
            cache.add_sequence(sid, prompt)
        runner.run(StepInput([0, 1, 2], sum(prompts, []), lengths))
        feed = torch.randint(3, 256, (sum(widths),)).tolist()
        at = 0
        for sid, n in enumerate(widths):
            cache.append_tokens(sid, feed[at:at + n])
            at += n
        expected = runner.run(StepInput([0, 1, 2], feed, widths)).float()  # [8, V]
        kv = cache.kv.clone()
        rows, tokens = decode_rows_padding(3, 8, 4, 64)
        assert (rows, tokens) == (4, 16)
        meta = cache.build_metadata([0, 1, 2], widths, rows, padded_tokens=tokens)
        ids = torch.tensor(feed + [0] * (tokens - 8), device=device)
        got = runner.decoder.forward(ids, tokens_as_decode_rows(meta)).float()  # [16, V]
        torch.testing.assert_close(got[:8], expected, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(cache.kv, kv, rtol=1e-4, atol=1e-4)  # the same K/V, no other slot written
        eager = runner.run_decode_rows(StepInput([0, 1, 2], feed, widths)).float()  # CPU: unpadded
        torch.testing.assert_close(eager, expected, rtol=1e-4, atol=1e-4)
    cache.free_all()
