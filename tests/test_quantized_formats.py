"""pagedkv.from_pretrained_quantized beyond AWQ/GPTQ: FP8 (transformers' FineGrainedFP8 with
block, UE8M0 and per-tensor scales; compressed-tensors float-quantized per channel, per tensor
and per block), bitsandbytes NF4 (with and without double quantization) and LLM.int8, and
compressed-tensors W4A16 (pack-quantized) checkpoints of tiny Llama-family models, written from random weights in
the exact on-disk layouts (pagedkv.tools.quant_writers, tests/fp8_formats.py, int4_formats.py). pagedkv's
greedy tokens equal HF's generate on a plain HF model holding the DEQUANTIZED weights (each
format's own formula); weight_bytes counts the packed bytes; transformers' own loading of an
FP8 folder (it dequantizes on the CPU) gives the same tokens; every unsupported field value is
refused naming the field."""

from __future__ import annotations

import copy
import json
import pathlib

import pytest
import torch
from safetensors.torch import save_file

import pagedkv
from fp8_formats import compressed_tensors_dequantize, finegrained_dequantize, to_compressed_tensors
from int4_formats import compressed_tensors_int4_dequantize
from models import tiny_model
from int8_formats import bnb_int8_dequantize
from nf4_formats import bnb_dequantize
from pagedkv.quant import Fp8Weight, Int8Weight, Nf4Packed, W4A16Weight
from pagedkv.runtime.model import weight_bytes
from pagedkv.tools.quant_writers import ct_config, to_bnb_int8, to_bnb_nf4, to_compressed_tensors_int4, to_finegrained
from test_engine import random_prompts
from test_quantized_checkpoints import assert_cuda_generate_matches, assert_llm_matches

GREEDY = dict(max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # parts of QKV or gate/up


def fp8_block(block, ue8m0=False):
    def write(w):
        stored = to_finegrained(w, block, ue8m0)
        return stored, finegrained_dequantize(**stored, block=block)
    return write


def ct_fp8(strategy, block=None):
    def write(w):
        stored = to_compressed_tensors(w, strategy, torch.bfloat16, block)
        return stored, compressed_tensors_dequantize(**stored, block=block)
    return write


def nf4(double_quant):
    def write(w):
        state = to_bnb_nf4(w, block_size=64, double_quant=double_quant)  # keys "weight", "weight.absmax", ...
        return state, bnb_dequantize(state)
    return write


def int8(weight_format):
    def write(w):
        state = to_bnb_int8(w, weight_format)  # keys "weight", "SCB"[, "weight_format"]
        return state, bnb_int8_dequantize(state)
    return write


def int8_bytes(shape, stored, fused):
    return shape[0] * shape[1] + 4 * shape[0]  # int8 values, an fp32 absmax a row


def ct_int4(group):
    def write(w):
        stored = to_compressed_tensors_int4(w, w.shape[1] if group == -1 else group)
        return stored, compressed_tensors_int4_dequantize(**stored)
    return write


def fp8_bytes(shape, stored, fused):
    scale = stored.get("weight_scale_inv", stored.get("weight_scale"))
    scales = shape[0] if scale.numel() == 1 and fused else scale.numel()  # per tensor, fused: one a row
    return shape[0] * shape[1] + 4 * scales  # e4m3 bytes, fp32 scales


def nf4_bytes(shape, stored, fused):
    return shape[0] * shape[1] // 2 + 4 * shape[0] * shape[1] // 64


def int4_bytes(group):
    def count(shape, stored, fused):
        g = shape[1] if group == -1 else group
        return shape[0] * shape[1] // 2 + 3 * shape[0] * shape[1] // g  # bf16 scale + uint8 zero a group
    return count


# id -> (arch, quantization_config, writer(w) -> (stored tensors by suffix, dequantized W), bytes,
#        the layer's QKV form: one packed weight, or parts)
FORMATS = {
    "fp8-block128-llama": ("llama", {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}, fp8_block((128, 128)), fp8_bytes, "one"),
    "fp8-ue8m0-qwen3": ("qwen3", {"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"},
                        fp8_block((128, 128), ue8m0=True), fp8_bytes, "one"),
    "fp8-block96x64-qwen2": ("qwen2", {"quant_method": "fp8", "weight_block_size": [96, 64]},
                             fp8_block((96, 64)), fp8_bytes, "parts"),  # blocks straddle q|k, gate|up
    "fp8-per-tensor-llama": ("llama", {"quant_method": "fp8", "weight_block_size": None}, fp8_block(None),
                             fp8_bytes, "one"),
    "ct-fp8-channel-qwen2": ("qwen2", ct_config("float-quantized", {"num_bits": 8, "type": "float",
                                                                    "strategy": "channel"}),
                             ct_fp8("channel"), fp8_bytes, "one"),
    "ct-fp8-tensor-llama": ("llama", ct_config("float-quantized", {"num_bits": 8, "type": "float",
                                                                   "strategy": "tensor"}),
                            ct_fp8("tensor"), fp8_bytes, "one"),
    "ct-fp8-block-qwen3": ("qwen3", ct_config("float-quantized", {"num_bits": 8, "type": "float", "strategy": "block",
                                                                  "block_structure": [128, 128]}),
                           ct_fp8("block", (128, 128)), fp8_bytes, "one"),
    "bnb-nf4-double-llama": ("llama", {"quant_method": "bitsandbytes", "load_in_4bit": True,
                                       "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True},
                             nf4(True), nf4_bytes, "one"),
    "bnb-nf4-qwen2": ("qwen2", {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                                "bnb_4bit_use_double_quant": False}, nf4(False), nf4_bytes, "one"),
    "bnb-int8-llama": ("llama", {"quant_method": "bitsandbytes", "load_in_8bit": True, "llm_int8_threshold": 6.0},
                       int8(True), int8_bytes, "one"),
    "bnb-int8-qwen2": ("qwen2", {"quant_method": "bitsandbytes", "load_in_8bit": True}, int8(False), int8_bytes,
                       "one"),
    "ct-w4a16-g128-llama": ("llama", ct_config("pack-quantized", {"num_bits": 4, "type": "int", "strategy": "group",
                                                                 "group_size": 128}),
                            ct_int4(128), int4_bytes(128), "one"),
    "ct-w4a16-channel-qwen3": ("qwen3", ct_config("pack-quantized", {"num_bits": 4, "type": "int",
                                                                    "strategy": "channel"}),
                               ct_int4(-1), int4_bytes(-1), "one"),
}
FORMS = {"fp8": Fp8Weight, "bnb": Nf4Packed, "bnb-int8": Int8Weight, "ct-fp8": Fp8Weight, "ct-w4a16": W4A16Weight}


def form(case: str) -> type:
    return next(cls for prefix, cls in sorted(FORMS.items(), key=lambda kv: -len(kv[0])) if case.startswith(prefix))


def write_checkpoint(folder: pathlib.Path, case: str, dense_dtype: torch.dtype = torch.bfloat16
                     ) -> tuple[torch.nn.Module, int]:
    """A tiny random model of `case` written to `folder` in its format (the rest in dense_dtype,
    as these checkpoints are). Returns (a plain HF model in fp32 holding the dequantized
    weights and the dense_dtype-rounded rest; the bytes pagedkv should hold in fp32)."""
    arch, quant, write, count, _ = FORMATS[case]
    model = tiny_model(arch)
    reference = copy.deepcopy(model)
    tensors, expected = {}, 0
    for name, module in model.named_modules():
        leaf = name.rpartition(".")[2]
        if leaf not in LINEARS:
            continue
        stored, dequantized = write(module.weight.detach())
        tensors.update({f"{name}.{k}": v for k, v in stored.items()})
        reference.get_submodule(name).weight.data.copy_(dequantized)
        expected += count(tuple(module.weight.shape), stored, leaf in FUSED)
    if case.startswith("bnb-nf4"):
        expected += 16 * 4 * 4 * len(model.model.layers)  # a codebook per packed weight: QKV, O, gate/up, down
    for name, p in model.named_parameters():
        if name.rpartition(".")[0].rpartition(".")[2] in LINEARS and name.endswith(".weight"):
            continue
        tensors[name] = p.detach().to(dense_dtype)
        reference.get_parameter(name).data.copy_(tensors[name].float())
        expected += p.numel() * 4
    save_file(tensors, folder / "model.safetensors")
    model.config.quantization_config = quant
    model.config.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    return reference.eval(), expected


@pytest.mark.parametrize("case", list(FORMATS))
def test_generate_matches_hf_on_the_dequantized_model(tmp_path, case):
    reference, expected_bytes = write_checkpoint(tmp_path, case)
    model = pagedkv.from_pretrained_quantized(tmp_path, dtype=torch.float32, device="cpu")
    weights = model._pagedkv_model.weights
    layer, cls = weights.layers[0], form(case)
    assert isinstance(layer.o, cls) and isinstance(layer.down, cls)
    for fused in (layer.qkv, layer.gate_up):
        if FORMATS[case][4] == "parts":
            assert isinstance(fused, tuple) and all(isinstance(p, cls) for p in fused)
        else:
            assert isinstance(fused, cls)
    assert weight_bytes(weights) == expected_bytes  # packed, never dequantized
    ids = torch.tensor(random_prompts([9, 9], seed=3))
    got = pagedkv.generate(model, ids, **GREEDY)
    assert torch.equal(got, reference.generate(ids, **GREEDY))


@pytest.mark.parametrize("case", ["fp8-block128-llama", "bnb-nf4-double-llama", "bnb-int8-llama",
                                  "ct-w4a16-g128-llama"])
def test_bf16_activations_match_hf_up_to_near_ties(tmp_path, case):
    from tolerance import assert_tokens_equal_up_to_near_tie

    reference, _ = write_checkpoint(tmp_path, case)
    reference = reference.to(torch.bfloat16)
    model = pagedkv.from_pretrained_quantized(tmp_path, dtype=torch.bfloat16, device="cpu")
    ids = torch.tensor(random_prompts([9, 9], seed=5))
    got = pagedkv.generate(model, ids, **GREEDY)
    want = reference.generate(ids, **GREEDY, return_dict_in_generate=True, output_logits=True)
    assert_tokens_equal_up_to_near_tie(got, want, ids.shape[1])


@pytest.mark.parametrize("case", ["fp8-block96x64-qwen2", "bnb-nf4-qwen2", "bnb-int8-qwen2", "ct-fp8-channel-qwen2"])
def test_llm_matches_hf(tmp_path, case):
    reference, _ = write_checkpoint(tmp_path, case)
    model = pagedkv.from_pretrained_quantized(tmp_path, dtype=torch.float32, device="cpu")
    assert_llm_matches(model, reference)


@pytest.mark.parametrize("case", ["fp8-block128-llama", "fp8-ue8m0-qwen3", "fp8-per-tensor-llama"])
def test_fp8_matches_transformers_loading_the_same_folder(tmp_path, case):
    """transformers loads a FineGrainedFP8 folder on a machine without a GPU by dequantizing it
    (in fp32 here: the same products as the format's formula): the same tokens as pagedkv.
    (Its CPU dequantization takes whole blocks only: not fp8-block96x64's partial edge blocks.)"""
    from transformers import AutoModelForCausalLM

    if torch.cuda.is_available():
        pytest.skip("transformers dequantizes FP8 only where no GPU is present")
    write_checkpoint(tmp_path, case)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert "FP8" not in type(hf.model.layers[0].self_attn.q_proj).__name__  # dequantized
    model = pagedkv.from_pretrained_quantized(tmp_path, dtype=torch.float32, device="cpu")
    ids = torch.tensor(random_prompts([7, 7], seed=6))
    assert torch.equal(pagedkv.generate(model, ids, **GREEDY), hf.generate(ids, **GREEDY))


def _ct(fmt: str, weights: dict, acts=None, **top) -> dict:
    return {**ct_config(fmt, weights, acts), **top}


INT4_CT = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}
FP8_CT = {"num_bits": 8, "type": "float", "strategy": "channel"}
FP8_DYNAMIC = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}
STATIC = {**FP8_DYNAMIC, "strategy": "tensor", "dynamic": False}
BAD_CONFIGS = [
    ({"quant_method": "hqq"}, "quant_method"),
    ({"quant_method": "fp8", "activation_scheme": "static"}, "activation_scheme"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
    ({"quant_method": "fp8", "scale_fmt": "e5m2"}, "scale_fmt"),
    ({"quant_method": "fp8", "modules_to_convert": ["embed_tokens"]}, "modules_to_convert"),
    ({"quant_method": "bitsandbytes", "load_in_8bit": True, "load_in_4bit": True}, "load_in_4bit"),
    ({"quant_method": "bitsandbytes", "load_in_8bit": True, "llm_int8_has_fp16_weight": True},
     "llm_int8_has_fp16_weight"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "fp4"}, "bnb_4bit_quant_type"),
    ({"quant_method": "bitsandbytes"}, "load_in_4bit"),
    (_ct("marlin-24", INT4_CT), "format"),
    (_ct("pack-quantized", INT4_CT, sparsity_config={"format": "sparse-24"}), "sparsity_config"),
    (_ct("pack-quantized", INT4_CT, kv_cache_scheme={"num_bits": 8}), "kv_cache_scheme"),
    (_ct("pack-quantized", INT4_CT, quantization_status="frozen"), "quantization_status"),
    (_ct("pack-quantized", {**INT4_CT, "num_bits": 8}), "config_groups.group_0.weights.num_bits"),
    (_ct("pack-quantized", {**INT4_CT, "symmetric": False}), "config_groups.group_0.weights.symmetric"),
    (_ct("pack-quantized", {**INT4_CT, "group_size": 48}), "config_groups.group_0.weights.group_size"),
    (_ct("pack-quantized", {**INT4_CT, "actorder": "group"}), "config_groups.group_0.weights.actorder"),
    (_ct("pack-quantized", {**INT4_CT, "strategy": "tensor"}), "config_groups.group_0.weights.strategy"),
    (_ct("pack-quantized", INT4_CT, FP8_DYNAMIC), "config_groups.group_0.input_activations"),
    (_ct("float-quantized", {**FP8_CT, "type": "int"}), "config_groups.group_0.weights.type"),
    (_ct("float-quantized", FP8_CT, FP8_DYNAMIC), "config_groups.group_0.input_activations"),
    (_ct("float-quantized", FP8_CT, STATIC), "config_groups.group_0.input_activations"),
    (_ct("float-quantized", {**FP8_CT, "strategy": "block"}), "config_groups.group_0.weights.block_structure"),
    ({**ct_config("float-quantized", FP8_CT), "config_groups": {}}, "config_groups"),
]


@pytest.mark.parametrize("quant, field", BAD_CONFIGS, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD_CONFIGS)])
def test_unsupported_configs_are_refused_naming_the_field(tmp_path, quant, field):
    write_checkpoint(tmp_path, "fp8-block128-llama")
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = quant
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(pagedkv.UnsupportedModel, match=f"quantization_config.{field}=.*supported: "):
        pagedkv.from_pretrained_quantized(tmp_path, device="cpu")


def test_bad_tensors_are_named(tmp_path):
    """A compressed-tensors layer with a zero point (asymmetric) despite a symmetric config, a bnb
    NF4 layer without its absmax and an LLM.int8 layer with a short SCB are refused naming the
    layer and the tensor."""
    write_checkpoint(tmp_path, "ct-w4a16-g128-llama")
    from safetensors.torch import load_file

    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight_zero_point"] = torch.zeros(64, 2, dtype=torch.int32)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.*weight_zero_point"):
        pagedkv.from_pretrained_quantized(tmp_path, device="cpu")
    write_checkpoint(tmp_path, "bnb-nf4-qwen2")
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.0.self_attn.k_proj.weight.absmax"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="model.layers.0.self_attn.k_proj.*absmax"):
        pagedkv.from_pretrained_quantized(tmp_path, device="cpu")
    write_checkpoint(tmp_path, "bnb-int8-llama")
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.1.self_attn.o_proj.SCB"] = tensors["model.layers.1.self_attn.o_proj.SCB"][:3]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.layers.1.self_attn.o_proj.*SCB must be 256 float32 row absmaxes"):
        pagedkv.from_pretrained_quantized(tmp_path, device="cpu")


@pytest.mark.cuda
@pytest.mark.parametrize("case", ["fp8-block128-llama", "ct-fp8-channel-qwen2", "bnb-nf4-double-llama",
                                  "bnb-int8-llama", "ct-w4a16-g128-llama"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_generate_matches_hf(tmp_path, case, dtype):
    reference, _ = write_checkpoint(tmp_path, case)
    model = pagedkv.from_pretrained_quantized(tmp_path, dtype=dtype, device="cuda")
    assert_cuda_generate_matches(model, reference.to("cuda", dtype), dtype)


def test_a_model_loaded_quantized_is_refused_pointing_to_its_checkpoint():
    """An HF model whose linears transformers replaced by quantized ones (FP8Linear: it exists on
    the CPU; bitsandbytes' Linear4bit alike) is refused naming the layer and the way that runs it,
    not told to merge adapters."""
    from transformers.integrations.finegrained_fp8 import FP8Linear

    model = tiny_model("llama")
    model.model.layers[1].mlp.down_proj = FP8Linear(512, 256, block_size=(128, 128))
    reason = pagedkv.unsupported_reason(model)
    assert "model.layers.1.mlp.down_proj is a FP8Linear" in reason and "a quantized layer" in reason
    assert "pagedkv.from_pretrained_quantized(folder)" in reason and "merge" not in reason
    with pytest.raises(pagedkv.UnsupportedModel, match="from_pretrained_quantized"):
        pagedkv.generate(model, torch.tensor([[3, 4, 5]]), **GREEDY)
    model.model.layers[1].mlp.down_proj = torch.nn.Linear(512, 256, bias=False)
    assert pagedkv.unsupported_reason(model) is None
