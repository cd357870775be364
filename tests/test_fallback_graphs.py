"""CUDA graphs of the fallback path (models/fallback.py): a decode step reads no value on the
host (padding rows of a graph bucket write nothing on the device), so it is captured where HF's
modules allow; a step that cannot be captured runs eagerly for good (logged once) or, with
use_cuda_graphs=True, raises ValueError naming why, the cache left whole; settings HF's modules
read at each call (which a replay skips) are part of the model's fingerprint.

On the CPU, ReplayGraphs stands in for runtime.graphs.CudaGraphs (a real capture needs CUDA): it
runs the captured step again at each replay, and fails a capture where a patched module reads a
value on the host, as a real capture does. The `cuda` tests run the real thing."""

from __future__ import annotations

import dataclasses
import logging
import types

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import pagedkv
import tp_worker
from conftest import DEVICES
from pagedkv.cache import KVCache
from pagedkv.models import fallback
from pagedkv.runtime import fixed_batch, runner as runner_module
from pagedkv.runtime.model import prepared
from pagedkv.runtime.runner import ModelRunner, StepInput, capture_failure, capture_step, forward_metadata
from test_engine import assert_no_leaks, assert_nothing_held, random_prompts
from test_fallback import CASES, GREEDY, tiny

# Types whose HF modules read values on the host in a decode step (their experts loop over the
# experts a batch hit: `.nonzero()`), so their capture fails and they run eagerly on CUDA.
EAGER_ON_CUDA = ("afmoe", "cohere2_moe", "ernie4_5_moe", "exaone_moe", "flex_olmo", "glm4_moe",
                 "granitemoe", "granitemoeshared", "hunyuan_v1_moe", "mellum", "minimax_m2",
                 "phimoe", "solar_open", "gpt_oss")
CAPTURING: list[bool] = []  # set while ReplayGraphs captures


class _Replayed:
    def __init__(self, step, buffers):
        self.step, self.buffers = step, buffers

    def replay(self):
        return self.step()


class ReplayGraphs:
    """runtime.graphs.CudaGraphs on the CPU: capture = warm-up + one run with CAPTURING set (a
    failure there ends as a real capture's does: the capture's end fails, the step's error as its
    context); replay = the step again."""

    def __init__(self) -> None:
        self._steps: dict = {}
        self.attempts = 0

    def get(self, key):
        return self._steps.get(key)

    def capture(self, key, step, buffers=None):
        self.attempts += 1
        step()
        CAPTURING.append(True)
        try:
            try:
                step()
            finally:
                CAPTURING.pop()
        except Exception:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
        captured = self._steps[key] = _Replayed(step, buffers)
        return captured

    def __len__(self) -> int:
        return len(self._steps)


def wanted_as_on_cuda(requested, model, caller):
    """cuda_graphs_wanted as on a CUDA device (the CPU's refuses use_cuda_graphs=True)."""
    cuda = types.SimpleNamespace(device=torch.device("cuda", 0), weights=model.weights)
    return runner_module.cuda_graphs_wanted(requested, cuda, caller)


@pytest.fixture
def cpu_graphs(monkeypatch):
    """generate() and runners of LLMs made with `llm_with_graphs` use ReplayGraphs on the CPU."""
    made: list[ReplayGraphs] = []
    own = fixed_batch.FixedBatch._runner_for

    def runner_for(self, *args):
        runner = own(self, *args)
        if runner.graphs is None:
            runner.graphs = ReplayGraphs()
            made.append(runner.graphs)
        return runner

    monkeypatch.setattr(fixed_batch, "cuda_graphs_wanted", wanted_as_on_cuda)
    monkeypatch.setattr(fixed_batch.FixedBatch, "_runner_for", runner_for)
    return made


def llm_with_graphs(model, insist: bool = False, **options) -> pagedkv.LLM:
    llm = pagedkv.LLM(model, max_num_seqs=4, **options)
    if llm.device.type == "cpu":
        llm.runner.graphs = ReplayGraphs()
        llm.runner.use_cuda_graphs = wanted_as_on_cuda(True if insist else None, llm.runner.model, "pagedkv.LLM")
        llm.runner.insist_graphs = insist
    return llm


def fail_when_captured(model, cuda: bool) -> None:
    """Layer 0's MLP reads a value on the host, as some HF code does: fine eagerly, fatal to a
    capture (on the CPU: raises while ReplayGraphs captures)."""
    mlp = model.gpt_neox.layers[0].mlp
    own = mlp.forward

    def forward(x):
        if cuda:
            float(x.sum())  # a host sync: not permitted while the stream captures
        elif CAPTURING:
            raise RuntimeError("operation not permitted when stream is capturing")
        return own(x)

    mlp.forward = forward


def batch(device):
    return tp_worker.left_padded([5, 19], 256, device, seed=1)


def llm_tokens(llm, prompts) -> list[list[int]]:
    params = pagedkv.SamplingParams(max_tokens=GREEDY["max_new_tokens"], temperature=0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def hf_new_tokens(model, prompts) -> list[list[int]]:
    return [model.generate(torch.tensor([p], device=model.device), **GREEDY)[0, len(p):].tolist() for p in prompts]


def decode_step(model_type: str):
    """(runner, padded decode metadata) after a prefill of one row: the row and one padding row."""
    model = tiny(model_type)
    state = prepared(model)
    w = state.weights
    cache = KVCache(len(w.layers), w.num_kv_heads, w.head_dim, dtype=state.dtype, device=state.device,
                    block_size=16, num_blocks=8, max_seq_len=128, max_batch_size=4, max_step_tokens=64)
    runner = ModelRunner(state, cache, False)
    cache.add_sequence(0, [3, 4, 5, 6, 7])
    cache.reserve(0, 4)
    runner.run(StepInput([0], [3, 4, 5, 6, 7], [5], [4]))
    return runner, forward_metadata(cache.build_metadata([0], None, 2), decode=True)


@pytest.mark.parametrize("model_type", list(CASES))
def test_decode_step_reads_no_value_on_the_host(model_type):
    """Under FakeTensorMode (values unknown) a decode step runs unless HF's own modules read a
    value (the types of EAGER_ON_CUDA): what a CUDA graph capture needs, checked on the CPU."""
    model = tiny(model_type)
    if not fallback._dispatches_attention(type(model).__module__):
        pytest.skip(f"{model_type} is refused with this transformers")
    runner, meta = decode_step(model_type)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fields = ("positions", "slot_mapping", "block_tables", "context_lens")
    fake = dataclasses.replace(meta, **{f: mode.from_tensor(getattr(meta, f)) for f in fields})
    try:
        with mode:
            runner.decoder.forward(torch.zeros(2, dtype=torch.int64), fake)
    except Exception as error:  # noqa: BLE001
        assert model_type in EAGER_ON_CUDA, f"{model_type}: {capture_failure(error)}"
        return
    assert model_type not in EAGER_ON_CUDA, f"{model_type} reads no value: take it off EAGER_ON_CUDA"


def test_padding_rows_write_nothing():
    """A graph bucket's padding row (slot -1) writes no K/V and leaves the real row's logits as
    an unpadded step computes them (up to the GEMMs' rounding at another batch size)."""
    runner, padded = decode_step("gpt_neox")
    cache = runner.cache
    ids = torch.tensor([9, 0])
    before = [t.clone() for t in cache.k_caches + cache.v_caches]
    logits = runner.decoder.forward(ids, padded)[:1]
    written = [t.clone() for t in cache.k_caches + cache.v_caches]
    slot = int(padded.slot_mapping[0])
    for old, new in zip(before, written):
        flat_old, flat_new = old.flatten(0, 1), new.flatten(0, 1)  # [slots, Hkv, Dh]
        others = torch.arange(flat_old.shape[0]) != slot
        assert torch.equal(flat_old[others], flat_new[others])
        assert not torch.equal(flat_old[slot], flat_new[slot])
    unpadded = forward_metadata(cache.build_metadata([0], None, None), decode=True)
    torch.testing.assert_close(runner.decoder.forward(ids[:1], unpadded), logits, rtol=1e-5, atol=1e-5)
    for a, b in zip(written, cache.k_caches + cache.v_caches):  # the same slot, the same K/V
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type", ["gpt_neox", "phi", "cohere2"])
def test_graph_steps_give_hf_tokens(model_type, cpu_graphs):
    """generate() (its captured sample-in-graph steps) and LLM (the runner's bucketed steps)."""
    model = tiny(model_type)
    ids, mask = batch("cpu")
    assert torch.equal(pagedkv.generate(model, ids, attention_mask=mask, **GREEDY),
                       model.generate(ids, attention_mask=mask, **GREEDY))
    assert len(cpu_graphs) == 1 and len(cpu_graphs[0]) == 1
    prompts = random_prompts([5, 19, 7])  # 3 rows: the bucket of 4 has a padding row
    llm = llm_with_graphs(model)
    assert llm_tokens(llm, prompts) == hf_new_tokens(model, prompts)
    assert len(llm.runner.graphs) > 0 and llm.runner.use_cuda_graphs
    assert_no_leaks(llm)


def test_a_step_that_cannot_be_captured_runs_eagerly(cpu_graphs, caplog):
    model = tiny("gpt_neox")
    fail_when_captured(model, cuda=False)
    ids, mask = batch("cpu")
    expected = model.generate(ids, attention_mask=mask, **GREEDY)
    with caplog.at_level(logging.INFO, logger="pagedkv.runtime.runner"):
        assert torch.equal(pagedkv.generate(model, ids, attention_mask=mask, **GREEDY), expected)
        assert torch.equal(pagedkv.generate(model, ids, attention_mask=mask, **GREEDY), expected)
    error = prepared(model).weights.capture_error
    assert error == "RuntimeError: operation not permitted when stream is capturing"
    logged = [r.getMessage() for r in caplog.records if "runs eagerly" in r.getMessage()]
    assert len(logged) == 1 and "'gpt_neox'" in logged[0] and error in logged[0], logged
    assert sum(g.attempts for g in cpu_graphs) == 1  # the second call did not try again
    with pytest.raises(ValueError, match="use_cuda_graphs=True, but the decode step of GPTNeoXForCausalLM"):
        pagedkv.generate(model, ids, attention_mask=mask, use_cuda_graphs=True, **GREEDY)
    assert_nothing_held(model)
    prompts = random_prompts([5, 19, 7])
    llm = llm_with_graphs(model)  # the model's steps run eagerly: not tried again
    assert not llm.runner.use_cuda_graphs
    assert llm_tokens(llm, prompts) == hf_new_tokens(model, prompts)
    assert_no_leaks(llm)


def test_use_cuda_graphs_true_raises_when_the_capture_fails(cpu_graphs):
    """Mid-call: the capture's error is named, nothing is held, the next call gives HF's tokens."""
    model = tiny("gpt_neox")
    fail_when_captured(model, cuda=False)
    ids, mask = batch("cpu")
    with pytest.raises(ValueError, match="cannot be captured as a CUDA graph: RuntimeError: operation not permitted"):
        pagedkv.generate(model, ids, attention_mask=mask, use_cuda_graphs=True, **GREEDY)
    assert_nothing_held(model)
    assert torch.equal(pagedkv.generate(model, ids, attention_mask=mask, **GREEDY),
                       model.generate(ids, attention_mask=mask, **GREEDY))

    model = tiny("gpt_neox")
    fail_when_captured(model, cuda=False)
    llm = llm_with_graphs(model, insist=True)
    prompts = random_prompts([5, 19])
    with pytest.raises(ValueError, match="cannot be captured as a CUDA graph"):
        llm_tokens(llm, prompts)
    assert_no_leaks(llm)
    assert llm_tokens(llm_with_graphs(model), prompts) == hf_new_tokens(model, prompts)


def test_capture_step_lets_other_errors_through():
    """A warm-up's error (an eager error), out-of-memory, and native models' errors go on as they
    are and record nothing."""
    weights = fallback.FallbackWeights(None, [None], 1, 64, 256)

    class Graphs:
        def capture(self, key, step, buffers=None):
            step()
            raise RuntimeError("capture ended")

    def runner(weights):
        return types.SimpleNamespace(model=types.SimpleNamespace(weights=weights), graphs=Graphs(),
                                     insist_graphs=False)

    def eager_error():
        raise KeyError("warm-up")

    with pytest.raises(KeyError, match="warm-up"):
        capture_step(runner(weights), 1, eager_error)
    with pytest.raises(RuntimeError, match="capture ended"):
        capture_step(runner(object()), 1, lambda: None)  # a native model's weights
    assert weights.capture_error is None


def test_capture_failure_names_the_first_error():
    try:
        try:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore")
        except RuntimeError:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
    except RuntimeError as error:
        assert capture_failure(error) == "RuntimeError: CUDA error: operation not permitted when stream is capturing"


@pytest.mark.parametrize("device", DEVICES)
def test_a_changed_setting_is_seen_or_refused(device):
    """A module attribute HF reads at each call (which a graph replay would skip): generate()
    takes the model again; an LLM bound to it refuses, naming it."""
    model = tiny("gpt_neox", device)
    ids, mask = batch(device)
    prompts = random_prompts([5, 19])
    llm = pagedkv.LLM(model, max_num_seqs=2)
    assert llm_tokens(llm, prompts) == hf_new_tokens(model, prompts)
    before = pagedkv.generate(model, ids, attention_mask=mask, **GREEDY)
    model.gpt_neox.layers[0].attention.scaling *= 4
    expected = model.generate(ids, attention_mask=mask, **GREEDY)
    assert not torch.equal(expected, before), "the change must matter to HF's tokens"
    assert torch.equal(pagedkv.generate(model, ids, attention_mask=mask, **GREEDY), expected)
    with pytest.raises(pagedkv.ModelChanged, match=r"gpt_neox.layers.0.attention.scaling changed from"):
        llm_tokens(llm, prompts)
    assert_no_leaks(llm)


@pytest.mark.parametrize("device", DEVICES)
def test_in_place_weight_writes_are_seen(device):
    """The graphs read HF's own parameters: an in-place write shows in the next replay."""
    model = tiny("gpt_neox", device)
    prompts = random_prompts([5, 19])
    llm = pagedkv.LLM(model, max_num_seqs=2)
    before = llm_tokens(llm, prompts)
    with torch.no_grad():
        model.gpt_neox.layers[0].mlp.dense_h_to_4h.weight.mul_(-1)
    assert llm_tokens(llm, prompts) == hf_new_tokens(model, prompts) != before


# -- CUDA: real captures ----------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("model_type", list(CASES))
def test_every_case_is_captured_or_runs_eagerly_on_cuda(model_type, caplog):
    """Greedy fp32 tokens equal HF's with graphs on (the default), through generate() and LLM;
    each type is captured, or (EAGER_ON_CUDA) its capture failed and it runs eagerly, logged."""
    model = tiny(model_type, "cuda")
    if not fallback._dispatches_attention(type(model).__module__):
        pytest.skip(f"{model_type} is refused with this transformers")
    ids, mask = batch("cuda")
    with caplog.at_level(logging.INFO, logger="pagedkv.runtime.runner"):
        got = pagedkv.generate(model, ids, attention_mask=mask, **GREEDY)
    assert torch.equal(got, model.generate(ids, attention_mask=mask, **GREEDY))
    prompts = random_prompts([5, 19, 7])
    llm = pagedkv.LLM(model, max_num_seqs=4)
    assert llm_tokens(llm, prompts) == hf_new_tokens(model, prompts)
    assert_no_leaks(llm)
    error = prepared(model).weights.capture_error
    if model_type in EAGER_ON_CUDA:
        assert error is not None, f"{model_type} was captured: take it off EAGER_ON_CUDA"
        assert any(error in r.getMessage() for r in caplog.records), caplog.text
        assert len(llm.runner.graphs) == 0
    else:
        assert error is None, f"{model_type} runs eagerly: {error}"
        assert len(prepared(model).fixed_batch.runner.graphs) > 0
        assert len(llm.runner.graphs) > 0
    assert not torch.cuda.is_current_stream_capturing()


@pytest.mark.cuda
def test_a_failing_capture_on_cuda_runs_eagerly_or_raises():
    """A real capture that fails (a host sync inside it): None runs eagerly with HF's tokens;
    True raises ValueError naming it; the stream and cache stay usable."""
    model = tiny("gpt_neox", "cuda")
    fail_when_captured(model, cuda=True)
    ids, mask = batch("cuda")
    expected = model.generate(ids, attention_mask=mask, **GREEDY)
    assert torch.equal(pagedkv.generate(model, ids, attention_mask=mask, **GREEDY), expected)
    assert prepared(model).weights.capture_error is not None
    assert not torch.cuda.is_current_stream_capturing()
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    with pytest.raises(ValueError, match="cannot be captured as a CUDA graph"):
        pagedkv.generate(model, ids, attention_mask=mask, use_cuda_graphs=True, **GREEDY)
    assert_nothing_held(model)
    assert torch.equal(pagedkv.generate(model, ids, attention_mask=mask, **GREEDY), expected)

    model = tiny("gpt_neox", "cuda")  # a fresh one: LLM(use_cuda_graphs=True) fails mid-call
    fail_when_captured(model, cuda=True)
    prompts = random_prompts([5, 19])
    llm = pagedkv.LLM(model, max_num_seqs=2, use_cuda_graphs=True)
    with pytest.raises(ValueError, match="cannot be captured as a CUDA graph"):
        llm_tokens(llm, prompts)
    assert_no_leaks(llm)
    assert llm_tokens(pagedkv.LLM(model, max_num_seqs=2), prompts) == hf_new_tokens(model, prompts)
