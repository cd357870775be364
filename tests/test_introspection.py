"""What a user sees when looking at pagedkv's objects: the patched generate reads as HF's (name,
docstring, signature, help) and still runs pagedkv; LLM, KVCache and outputs print what they
hold; the `pagedkv` loggers say what was set up (never per step) and are never configured by
the library; `python -m pagedkv` prints versions and a self-check's PASS/FAIL."""

from __future__ import annotations

import copy
import inspect
import logging
import pickle
import pydoc
import subprocess
import sys

import pytest
import torch
import transformers

import pagedkv
from pagedkv import LLM, CompletionOutput, KVCache, RequestMetrics, RequestOutput, SamplingParams
from models import tiny_model

GREEDY = dict(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)


# -- the patched generate ------------------------------------------------------------------------
def test_patched_generate_reads_as_hfs_and_runs_pagedkv():
    model = tiny_model("llama")
    original = model.generate
    ids = torch.randint(3, 256, (2, 9))
    expected = original(ids, **GREEDY)
    pagedkv.patch(model)
    patched = model.generate
    assert patched.__name__ == "generate" and patched.__qualname__ == original.__qualname__
    assert patched.__doc__ == original.__doc__
    assert inspect.signature(patched) == inspect.signature(original)
    assert patched.__wrapped__ == original
    page = pydoc.render_doc(patched, renderer=pydoc.plaintext)
    assert "generate(inputs" in page and "generation_config" in page
    assert original.__doc__.strip().splitlines()[0] in page
    assert "LlamaForCausalLM" in repr(patched) and "pagedkv" in repr(patched)
    # still pagedkv: its cache exists after the call, and the tokens are HF's
    assert pagedkv.kv_cache_of(model) is None
    assert torch.equal(patched(ids, **GREEDY), expected)
    assert pagedkv.kv_cache_of(model) is not None
    # a copy's generate reads as HF's generate of the copy
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert twin.generate.__name__ == "generate" and twin.generate.__wrapped__.__self__ is twin
        assert inspect.signature(twin.generate) == inspect.signature(original)
    pagedkv.unpatch(model)
    assert "generate" not in vars(model)
    assert model.generate == original and model.generate.__func__ is type(model).generate


# -- reprs ---------------------------------------------------------------------------------------
def test_llm_repr_names_model_device_cache_and_queues():
    llm = LLM(tiny_model("llama"), num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=64)
    text = repr(llm)
    for part in ("LLM(", "LlamaForCausalLM", "device=cpu", "dtype=float32", "64 blocks",
                 "GB", "max_num_seqs=4", "running=0", "waiting=0"):
        assert part in text, (part, text)
    llm.add_request([5, 6, 7], SamplingParams(max_tokens=3))
    assert "waiting=1" in repr(llm)
    llm.step()
    assert "running=1" in repr(llm) and "waiting=0" in repr(llm)


def test_kv_cache_repr_names_shape_and_free_blocks():
    cache = KVCache(3, 2, 64, dtype=torch.float32, block_size=16, num_blocks=10, device="cpu")
    text = repr(cache)
    for part in ("KVCache(", "num_blocks=10", "block_size=16", "num_layers=3", "num_kv_heads=2",
                 "head_dim=64", "dtype=float32", "device=cpu", "free_blocks=10", "GB"):
        assert part in text, (part, text)
    cache.add_sequence(0, list(range(3, 23)))  # 20 tokens: 2 blocks
    assert "free_blocks=8" in repr(cache)
    assert "at 0x" not in text


class WordTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(f"w{i}" for i in ids)


def test_output_reprs_show_text_and_finish_reason():
    short = CompletionOutput(0, [1, 2, 3], "stop", WordTokenizer())
    assert "text='w1 w2 w3'" in repr(short) and "finish_reason='stop'" in repr(short)
    long = CompletionOutput(0, list(range(300)), "length", WordTokenizer())
    text = repr(long)
    assert len(text) < 300, text  # the text and token ids are cut, saying how long they are
    assert "w0 w1" in text and "300 tokens" in text and "finish_reason='length'" in text
    out = RequestOutput("r7", "a prompt", [4, 5], [long], True, RequestMetrics(0.0))
    text = repr(out)
    assert len(text) < 600, text
    for part in ("request_id='r7'", "prompt='a prompt'", "finished=True", "w0 w1", "'length'"):
        assert part in text, (part, text)
    no_tokenizer = CompletionOutput(1, [9], None, None)
    assert "text=None" in repr(no_tokenizer) and "finish_reason=None" in repr(no_tokenizer)


# -- logging -------------------------------------------------------------------------------------
def test_library_never_configures_logging():
    code = ("import logging, pagedkv; root = logging.getLogger(); pk = logging.getLogger('pagedkv'); "
            "print(len(root.handlers), [type(h).__name__ for h in pk.handlers], pk.level, pk.propagate)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["0", "['NullHandler']", "0", "True"], out.stdout


def test_setup_is_logged_at_info_and_steps_are_not(caplog):
    caplog.set_level(logging.DEBUG, logger="pagedkv")
    model = tiny_model("llama")
    llm = LLM(model, num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=64)
    info = [r for r in caplog.records if r.levelno == logging.INFO]
    weights = [r.getMessage() for r in info if r.name == "pagedkv.runtime.model"]
    assert len(weights) == 1 and "LlamaForCausalLM" in weights[0] and "float32" in weights[0] \
        and "cpu" in weights[0] and "MB" in weights[0], weights
    cache = [r.getMessage() for r in info if r.name == "pagedkv.cache.kv_cache"]
    assert len(cache) == 1 and "64 blocks" in cache[0] and "GB" in cache[0], cache
    assert all(r.name.startswith("pagedkv.") for r in caplog.records)
    ids = torch.randint(3, 256, (2, 9))
    pagedkv.generate(model, ids, **GREEDY)  # its first call sizes generate()'s cache
    caplog.clear()
    pagedkv.generate(model, ids, **GREEDY)
    llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=8), use_tqdm=False)
    assert caplog.records == []  # nothing per call or step once set up


@pytest.mark.cuda
def test_cuda_graph_capture_is_logged(caplog):
    caplog.set_level(logging.INFO, logger="pagedkv")
    model = tiny_model("llama", torch.bfloat16, "cuda")
    llm = LLM(model, num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=64, use_cuda_graphs=True)
    llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=8), use_tqdm=False)
    captured = [r.getMessage() for r in caplog.records if r.name == "pagedkv.runtime.graphs"]
    assert captured and "captured" in captured[0] and "MB" in captured[0], captured


# -- python -m pagedkv ---------------------------------------------------------------------------
def test_python_m_pagedkv_prints_versions_and_passes():
    proc = subprocess.run([sys.executable, "-m", "pagedkv"], capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    for part in (f"pagedkv {pagedkv.__version__}", f"torch {torch.__version__}",
                 f"transformers {transformers.__version__}", f"python {sys.version.split()[0]}",
                 pagedkv.build_info, "CUDA available:", "PASS"):
        assert part in out, (part, out)
    assert "FAIL" not in out


def test_python_m_pagedkv_fails_when_tokens_differ(monkeypatch, capsys):
    import pagedkv.__main__ as cli

    real = pagedkv.generate

    def off_by_one(model, input_ids, **kwargs):
        out = real(model, input_ids, **kwargs)
        out[:, -1] = (out[:, -1] + 1) % model.config.vocab_size
        return out

    monkeypatch.setattr(cli, "generate", off_by_one)
    assert cli.main([]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "PASS" not in out.split("FAIL")[-1], out
