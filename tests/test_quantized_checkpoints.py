"""pagedkv.from_pretrained_quantized: AWQ and GPTQ (desc_act on and off, both zero formats)
checkpoints of tiny Llama-family models, written from random weights in the exact on-disk
formats (tests/int4_formats.py), run by pagedkv in W4A16 form: its greedy tokens equal HF's
generate on the same model with the DEQUANTIZED weights (each format's own formula) put into a
plain HF model; weight_bytes counts the packed bytes; unsupported configs are refused naming the
field."""

from __future__ import annotations

import copy
import json
import pathlib

import pytest
import torch
from safetensors.torch import save_file

import pagedkv
from int4_formats import awq_dequantize, gptq_dequantize, quantize, to_awq, to_gptq
from models import tiny_model
from pagedkv.quant import W4A16Weight
from pagedkv.runtime.model import weight_bytes
from test_engine import assert_no_leaks, random_prompts

GREEDY = dict(max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# (id, arch, quantization_config); GPTQ's act_order "shared": q/k/v (gate/up) sorted alike, as
# GPTQ sorts them by the same input (one packed QKV); "own": each its own order (three parts).
CASES = [
    ("awq-llama-g64", "llama", dict(quant_method="awq", bits=4, group_size=64, zero_point=True, version="gemm")),
    ("awq-qwen2-g128", "qwen2", dict(quant_method="awq", bits=4, group_size=128, zero_point=True, version="gemm")),
    ("gptq-llama", "llama", dict(quant_method="gptq", bits=4, group_size=128, desc_act=False, sym=False)),
    ("gptq-desc_act-shared-qwen3", "qwen3", dict(quant_method="gptq", bits=4, group_size=64, desc_act=True,
                                                 act_order="shared")),
    ("gptq_v2-desc_act-own-qwen2", "qwen2", dict(quant_method="gptq", bits=4, group_size=32, desc_act=True,
                                                 checkpoint_format="gptq_v2", act_order="own")),
]


def write_checkpoint(folder: pathlib.Path, arch: str, quant: dict) -> tuple[torch.nn.Module, int]:
    """Quantize a tiny random model's decoder linears into `folder` (config.json with the
    quantization_config, model.safetensors; the rest stored in float16 as these checkpoints
    are). Returns (a plain HF model holding the dequantized weights and the float16-rounded
    rest, in fp32; the bytes pagedkv should hold: packed linears plus the rest in fp32)."""
    model = tiny_model(arch)
    reference = copy.deepcopy(model)
    quant = dict(quant)
    act_order = quant.pop("act_order", None)
    group, zero_offset = quant["group_size"], quant.get("checkpoint_format", "gptq") == "gptq"
    tensors, packed_bytes = {}, 0
    for name, module in model.named_modules():
        if name.rpartition(".")[2] not in LINEARS:
            continue
        w = module.weight.detach()
        if quant["quant_method"] == "awq":
            stored = to_awq(*quantize(w, group))
            dequantized = awq_dequantize(**stored, group_size=group)
        else:
            if act_order == "shared":  # the same permutation for the parts of one fused layer
                torch.manual_seed(sum(name.rpartition(".")[0].encode()))
            stored = to_gptq(w, group, zero_offset, desc_act=quant["desc_act"])
            dequantized = gptq_dequantize(**stored, zero_offset=zero_offset)
            if not quant["desc_act"]:
                stored.pop("g_idx")  # the consecutive groups: some writers leave it out
        tensors.update({f"{name}.{k}": v for k, v in stored.items()})
        reference.get_submodule(name).weight.data.copy_(dequantized)
        out_features, in_features = w.shape
        packed_bytes += in_features * out_features // 2 + 3 * out_features * in_features // group
        packed_bytes += 8 * in_features if quant.get("desc_act") else 0  # the column order (int64)
    dense_bytes = 0
    for name, p in model.named_parameters():
        if name.rpartition(".")[0].rpartition(".")[2] in LINEARS and name.endswith(".weight"):
            continue
        tensors[name] = p.detach().half()
        reference.get_parameter(name).data.copy_(tensors[name].float())
        dense_bytes += p.numel() * 4
    if act_order == "shared":  # one column order for q, k, v (not 3) and for gate, up (not 2)
        packed_bytes -= 8 * model.config.hidden_size * 3 * len(model.model.layers)
    save_file(tensors, folder / "model.safetensors")
    model.config.quantization_config = quant
    model.config.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    return reference.eval(), packed_bytes + dense_bytes


@pytest.mark.parametrize("case, arch, quant", CASES, ids=[c[0] for c in CASES])
def test_generate_matches_hf_on_the_dequantized_model(tmp_path, case, arch, quant):
    reference, expected_bytes = write_checkpoint(tmp_path, arch, quant)
    model = pagedkv.from_pretrained_quantized(tmp_path, dtype=torch.float32, device="cpu")
    assert all(p.is_meta for p in model.parameters())
    weights = model._pagedkv_model.weights
    layer = weights.layers[0]
    assert isinstance(layer.o, W4A16Weight) and isinstance(layer.down, W4A16Weight)
    if quant.get("act_order") == "own":  # q, k, v sorted differently: three packed parts
        assert isinstance(layer.qkv, tuple) and all(isinstance(p, W4A16Weight) for p in layer.qkv)
    else:
        assert isinstance(layer.qkv, W4A16Weight) and isinstance(layer.gate_up, W4A16Weight)
    assert weight_bytes(weights) == expected_bytes  # packed, never dequantized
    ids = torch.tensor(random_prompts([9, 9], seed=3))
    got = pagedkv.generate(model, ids, **GREEDY)
    assert torch.equal(got, reference.generate(ids, **GREEDY))


def assert_llm_matches(model, reference) -> None:
    """pagedkv.LLM over a quantized checkpoint (chunked prefill beside decodes) gives the greedy
    tokens of `reference` (HF's model with the dequantized weights), each prompt alone."""
    prompts = random_prompts([5, 17, 30], seed=4)
    llm = pagedkv.LLM(model, max_num_seqs=4, max_num_batched_tokens=16)
    outs = llm.generate(prompts, pagedkv.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                        use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        want = reference.generate(torch.tensor([prompt]), **{**GREEDY, "max_new_tokens": 8})
        assert out.token_ids == want[0, len(prompt):].tolist()
    assert_no_leaks(llm)


def test_llm_and_patch_match_hf(tmp_path):
    reference, _ = write_checkpoint(tmp_path, "qwen2", CASES[4][2])
    model = pagedkv.from_pretrained_quantized(tmp_path, dtype=torch.float32, device="cpu")
    assert_llm_matches(model, reference)
    with pytest.raises(RuntimeError, match="from_pretrained_quantized"):
        model(torch.tensor([[3, 4]]))  # HF's own forward: the skeleton holds no weights
    pagedkv.patch(model)
    ids = torch.tensor([random_prompts([17], seed=5)[0]])
    assert torch.equal(model.generate(ids, **GREEDY), reference.generate(ids, **GREEDY))


BAD_CONFIGS = [
    (dict(quant_method="hqq"), "quant_method"),
    (dict(quant_method="awq", bits=8, group_size=128), "bits"),
    (dict(quant_method="awq", bits=4, group_size=48), "group_size"),
    (dict(quant_method="awq", bits=4, group_size=128, version="gemv"), "version"),
    (dict(quant_method="awq", bits=4, group_size=128, zero_point=False), "zero_point"),
    (dict(quant_method="gptq", bits=4, group_size=128, checkpoint_format="marlin"), "checkpoint_format"),
    (dict(quant_method="gptq", bits=4, group_size=128, lm_head=True), "lm_head"),
]


@pytest.mark.parametrize("quant, field", BAD_CONFIGS, ids=[b[1] for b in BAD_CONFIGS])
def test_unsupported_configs_are_refused_naming_the_field(tmp_path, quant, field):
    write_checkpoint(tmp_path, "llama", CASES[0][2])
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = quant
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(pagedkv.UnsupportedModel, match=f"quantization_config.{field}="):
        pagedkv.from_pretrained_quantized(tmp_path, device="cpu")


def test_missing_and_misshapen_tensors_are_named(tmp_path):
    write_checkpoint(tmp_path, "llama", CASES[2][2])
    from safetensors.torch import load_file

    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.scales"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="model.layers.1.mlp.down_proj.scales"):
        pagedkv.from_pretrained_quantized(tmp_path, device="cpu")
    tensors["model.layers.1.mlp.down_proj.scales"] = torch.ones(3, 256, dtype=torch.half)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="model.layers.1.mlp.down_proj.*scales"):
        pagedkv.from_pretrained_quantized(tmp_path, device="cpu")


def assert_cuda_generate_matches(model, reference, dtype: torch.dtype) -> None:
    """pagedkv.generate on CUDA gives `reference`'s greedy tokens (HF's model with the dequantized
    weights): exactly in fp32, up to near ties in 16-bit dtypes."""
    from tolerance import assert_tokens_equal_up_to_near_tie

    ids = torch.tensor(random_prompts([9, 9], seed=3), device="cuda")
    got = pagedkv.generate(model, ids, **GREEDY)
    want = reference.generate(ids, **GREEDY, return_dict_in_generate=True, output_logits=True)
    if dtype == torch.float32:
        assert torch.equal(got, want.sequences)
    else:
        assert_tokens_equal_up_to_near_tie(got, want, ids.shape[1])


@pytest.mark.cuda
@pytest.mark.parametrize("case, arch, quant", [CASES[0], CASES[4]], ids=[CASES[0][0], CASES[4][0]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cuda_generate_matches_hf(tmp_path, case, arch, quant, dtype):
    reference, _ = write_checkpoint(tmp_path, arch, quant)
    model = pagedkv.from_pretrained_quantized(tmp_path, dtype=dtype, device="cuda")
    assert_cuda_generate_matches(model, reference.to("cuda", dtype), dtype)
