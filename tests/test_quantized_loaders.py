"""Quantized checkpoints against the packages that define them, where they are installed
(bitsandbytes, compressed-tensors: both run on the CPU; skipped otherwise): a bnb NF4 checkpoint
that transformers + bitsandbytes quantized and saved themselves, and compressed-tensors folders
written by tests/test_quantized_formats.py's writers, loaded by transformers through
compressed-tensors (it decompresses them on the CPU): pagedkv's greedy tokens equal HF's on the
same folder, and the package's own dequantization equals the writers' formula."""

from __future__ import annotations

import pytest
import torch

import pagedkv
from models import tiny_model
from test_engine import random_prompts
from test_quantized_formats import write_checkpoint

GREEDY = dict(max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)


@pytest.mark.parametrize("double_quant", [True, False])
@pytest.mark.parametrize("storage", [torch.uint8, torch.bfloat16])
def test_bnb_checkpoint_saved_by_transformers(tmp_path, double_quant, storage):
    """Its tokens equal HF's on the weights bitsandbytes itself dequantizes (dequantize_4bit).
    Not HF's Linear4bit forward on the CPU: with double quantization it is ~0.4% off its own
    dequantized weights (bitsandbytes' CPU kernel), enough to move tokens of a random model."""
    pytest.importorskip("bitsandbytes")
    import bitsandbytes.functional as bnb
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    reference = tiny_model("qwen2")
    reference.save_pretrained(tmp_path / "fp32")
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=double_quant,
                                bnb_4bit_compute_dtype=torch.float32, bnb_4bit_quant_storage=storage)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "fp32", quantization_config=config, device_map="cpu",
                                              dtype=torch.float32)
    hf.save_pretrained(tmp_path / "nf4")
    linears = [(name, m) for name, m in hf.named_modules() if type(m).__name__ == "Linear4bit"]
    assert len(linears) == 7 * len(hf.model.layers)
    for name, module in linears:
        reference.get_submodule(name).weight.data.copy_(bnb.dequantize_4bit(module.weight.data,
                                                                            module.weight.quant_state))
    model = pagedkv.from_pretrained_quantized(tmp_path / "nf4", dtype=torch.float32, device="cpu")
    ids = torch.tensor(random_prompts([9, 9], seed=3))
    got = pagedkv.generate(model, ids, **GREEDY)
    assert torch.equal(got, reference.generate(ids, **GREEDY))
    if not double_quant:  # there bitsandbytes' CPU forward is its dequantized weights
        assert torch.equal(got, hf.generate(ids, **GREEDY))


@pytest.mark.parametrize("case", ["ct-w4a16-g128-llama", "ct-w4a16-channel-qwen3", "ct-fp8-channel-qwen2",
                                  "ct-fp8-tensor-llama", "ct-fp8-block-qwen3"])
def test_compressed_tensors_folder_as_transformers_loads_it(tmp_path, case):
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    reference, _ = write_checkpoint(tmp_path, case)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    model = pagedkv.from_pretrained_quantized(tmp_path, dtype=torch.float32, device="cpu")
    ids = torch.tensor(random_prompts([9, 9], seed=3))
    assert torch.equal(pagedkv.generate(model, ids, **GREEDY), hf.generate(ids, **GREEDY))
    for name, p in reference.named_parameters():  # decompressed by then: the package's = the writer's formula
        assert torch.equal(hf.get_parameter(name).float(), p), name
