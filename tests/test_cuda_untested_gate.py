"""Native decoders whose CUDA kernels no GPU has run yet (registry.CUDA_UNTESTED_NATIVE: Gemma's,
the MoE types') do not run those kernels on a CUDA device: there they take the fallback path (HF's
modules over the paged cache, GPU-tested), or are refused by name where it cannot run them; on
the CPU they run natively."""

from __future__ import annotations

import pytest
import torch

import pagedkv
import test_gemma
import test_moe
import tp_worker
from pagedkv.models import registry

GREEDY = dict(max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)


def as_if_on_cuda(monkeypatch) -> None:
    """The gate's device test answers as for a CUDA model (the fallback path itself runs here)."""
    monkeypatch.delenv(registry.UNTESTED_CUDA_ENV, raising=False)
    monkeypatch.setattr(registry, "_cuda_kernels_untested", lambda model: True)


@pytest.mark.parametrize("name, tiny", [("gemma", test_gemma.tiny), ("gemma3_text", test_gemma.tiny),
                                        ("mixtral", test_moe.tiny), ("qwen2_moe", test_moe.tiny)])
def test_untested_types_take_the_fallback_path_with_hf_tokens(name, tiny, monkeypatch):
    model = tiny(name)
    assert pagedkv.support_path(model) == "native"
    as_if_on_cuda(monkeypatch)
    assert pagedkv.support_path(model) == "fallback", pagedkv.unsupported_reason(model)
    ids, mask = tp_worker.left_padded([5, 7], 256, "cpu", seed=1)  # within Gemma-3's window of 8
    expected = model.generate(ids, attention_mask=mask, **GREEDY)
    got = pagedkv.generate(model, ids, attention_mask=mask, **GREEDY)
    assert torch.equal(got, expected)


def test_an_untested_type_without_a_fallback_is_refused_by_name(monkeypatch):
    model = test_moe.tiny("qwen3_moe")
    as_if_on_cuda(monkeypatch)
    assert "have not passed their GPU tests yet" in pagedkv.unsupported_reason(model)
    with pytest.raises(pagedkv.UnsupportedModel, match="qwen3_moe"):
        pagedkv.generate(model, torch.tensor([[3, 4, 5]]), max_new_tokens=2)


def test_the_gate_reads_the_device_and_the_override(monkeypatch):
    model = test_moe.tiny("mixtral")
    monkeypatch.delenv(registry.UNTESTED_CUDA_ENV, raising=False)
    assert not registry._cuda_kernels_untested(model)  # on the CPU
    model.to("meta")
    assert registry._cuda_kernels_untested(model) is False  # only CUDA is gated


@pytest.mark.cuda
@pytest.mark.parametrize("name, tiny", [("gemma", test_gemma.tiny), ("mixtral", test_moe.tiny)])
def test_on_cuda_they_run_the_fallback_path(name, tiny, monkeypatch):
    monkeypatch.delenv(registry.UNTESTED_CUDA_ENV, raising=False)
    model = tiny(name, "cuda")
    assert pagedkv.support_path(model) == "fallback", pagedkv.unsupported_reason(model)
    monkeypatch.setenv(registry.UNTESTED_CUDA_ENV, "1")
    assert pagedkv.support_path(model) == "native"
