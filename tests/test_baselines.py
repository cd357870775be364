"""pagedkv.tools.baselines.StaticCacheDecoder, the compiled PyTorch decoder that bench_generate and
pagedkv.tools.profile time pagedkv against: its greedy tokens equal HF generate's for every
architecture pagedkv runs (fp32, CPU, eager), its decode step traces as one graph, and bad
arguments are refused."""

from __future__ import annotations

import pytest
import torch

from models import ARCHITECTURES, tiny_model

from pagedkv.tools.baselines import StaticCacheDecoder


def hf_new_tokens(model, ids: torch.Tensor, new: int) -> torch.Tensor:
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[:, ids.shape[1]:]


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_tokens_equal_hf(arch, batch):
    model = tiny_model(arch)
    ids = torch.randint(3, model.config.vocab_size, (batch, 11))
    new = 12
    decoder = StaticCacheDecoder(model, batch=batch, max_seq=32, compile_mode=None)
    expected = hf_new_tokens(model, ids, new)
    assert expected.unique().numel() > 2  # the tokens vary, so equality means something
    assert torch.equal(decoder.generate(ids, new), expected)
    # A second call over the same cache rewrites it from position 0.
    assert torch.equal(decoder.generate(ids, new), expected)


@pytest.mark.cuda
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_compiled_step_on_cuda_gives_hf_tokens(arch):
    """The step as bench_generate runs it: compiled with reduce-overhead (CUDA graphs whose cache
    buffers are written in place), fp32 so that the tokens must equal HF's exactly."""
    model = tiny_model(arch, device="cuda")
    decoder = StaticCacheDecoder(model, batch=2, max_seq=32)
    for _ in range(2):  # a second prompt: the replayed graphs over a rewritten cache
        ids = torch.randint(3, model.config.vocab_size, (2, 9), device="cuda")
        expected = hf_new_tokens(model, ids, 12)
        assert torch.equal(decoder.generate(ids, 12), expected)


def test_decode_step_traces_as_one_graph():
    model = tiny_model("qwen3")
    decoder = StaticCacheDecoder(model, batch=2, max_seq=32, compile_mode=None)
    # The eager backend: Dynamo's tracing (fullgraph raises at any graph break) without Inductor.
    decoder.step = torch.compile(decoder.decode_step, backend="eager", fullgraph=True)
    ids = torch.randint(3, model.config.vocab_size, (2, 5))
    expected = hf_new_tokens(model, ids, 6)
    assert torch.equal(decoder.generate(ids, 6), expected)


def test_bad_arguments_are_refused():
    model = tiny_model("llama")
    decoder = StaticCacheDecoder(model, batch=2, max_seq=16, compile_mode=None)
    with pytest.raises(ValueError, match="built for batch 2, got 1"):
        decoder.generate(torch.randint(3, 100, (1, 4)), 4)
    with pytest.raises(ValueError, match="needs max_seq >= 20"):
        decoder.generate(torch.randint(3, 100, (2, 10)), 11)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1, got 0"):
        decoder.generate(torch.randint(3, 100, (2, 10)), 0)
    with pytest.raises(ValueError, match="input_ids are on meta, the model on cpu"):
        decoder.generate(torch.empty(2, 4, dtype=torch.long, device="meta"), 4)
    with pytest.raises(ValueError, match="GPT2LMHeadModel is not supported"):
        from transformers import GPT2Config, GPT2LMHeadModel
        StaticCacheDecoder(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2)), 1, 8)
    with pytest.raises(ValueError, match="passes the sliding window 512"):
        StaticCacheDecoder(tiny_model("mistral"), batch=1, max_seq=513, compile_mode=None)
