"""pagedkv.from_pretrained_quantized on FP8 and int4 checkpoints of mixture-of-experts models (Qwen3-MoE with a
dense layer between MoE ones, Qwen2-MoE with its shared expert, Mixtral's own names, OLMoE's 64
experts):
tiny random models written in the exact on-disk layout (the experts one by one, as transformers'
save_pretrained and the "-FP8" / AWQ / GPTQ releases store them; FineGrainedFP8 block and
per-tensor scales, compressed-tensors per channel, AWQ, GPTQ with desc_act). pagedkv's greedy tokens equal HF's on the same model holding the
DEQUANTIZED weights, on both of the experts' paths (a step's pairs gathered, or each hit expert
once), through generate and LLM; transformers loading the same FineGrainedFP8 folder (it
dequantizes on a machine without a GPU) gives them too; experts a checkpoint left unquantized
(bitsandbytes quantizes attention only) are read dense; experts quantized in part are named."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import pagedkv
from fp8_formats import compressed_tensors_dequantize, finegrained_dequantize, to_compressed_tensors
from int4_formats import awq_dequantize, gptq_dequantize, quantize, to_awq, to_gptq
from int8_formats import bnb_int8_dequantize
from nf4_formats import bnb_dequantize
from pagedkv.layers import moe
from pagedkv.layers.moe_quantized import Fp8Experts, Int4Experts
from pagedkv.runtime.model import weight_bytes
from pagedkv.tools.quant_writers import ct_config, to_bnb_int8, to_bnb_nf4, to_finegrained
from test_engine import random_prompts
from test_moe import CASES as MOE_CASES, tiny
from test_quantized_checkpoints import assert_cuda_generate_matches, assert_llm_matches

GREEDY = dict(max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
# The projections a checkpoint quantizes: attention, experts (and Mixtral's w1/w2/w3), dense MLPs.
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")
FINEGRAINED = {"quant_method": "fp8", "activation_scheme": "dynamic"}
# id -> (the tiny model, quantization_config, the scales: a FineGrainedFP8 block (None: per tensor)
# or "channel" (compressed-tensors))
FORMATS = {
    "fp8-block32x64-qwen3_moe": ("qwen3_moe", {**FINEGRAINED, "weight_block_size": [32, 64]}, (32, 64)),
    "fp8-block128-qwen2_moe": ("qwen2_moe", {**FINEGRAINED, "weight_block_size": [128, 128]}, (128, 128)),
    "fp8-per-tensor-mixtral": ("mixtral", {**FINEGRAINED, "weight_block_size": None}, None),
    "ct-fp8-channel-qwen3_moe": ("qwen3_moe", ct_config("float-quantized", {
        "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}), "channel"),
    # 64 experts of width 64, top-8, q/k norms over all heads
    "fp8-block64-olmoe": ("olmoe", {**FINEGRAINED, "weight_block_size": [64, 64]}, (64, 64)),
    "awq-g32-qwen2_moe": ("qwen2_moe", {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
                                        "version": "gemm"}, "awq"),
    # each projection its own random column order (desc_act), the historical zero offset
    "gptq-desc_act-qwen3_moe": ("qwen3_moe", {"quant_method": "gptq", "bits": 4, "group_size": 32,
                                              "desc_act": True, "sym": False}, "gptq"),
    # bitsandbytes quantizes linear modules only: attention and the shared expert, not the experts
    "bnb-nf4-qwen2_moe": ("qwen2_moe", {"quant_method": "bitsandbytes", "load_in_4bit": True,
                                        "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True}, "nf4"),
    "bnb-int8-qwen3_moe": ("qwen3_moe", {"quant_method": "bitsandbytes", "load_in_8bit": True}, "int8"),
}
# the held form of a case's experts (else Fp8Experts): int4, or dense where left unquantized
FORMS = {"awq": Int4Experts, "gptq": Int4Experts, "bnb": torch.Tensor}


def olmoe():
    from test_olmo3_olmoe import tiny as tiny_olmoe
    return tiny_olmoe("olmoe")


def write_checkpoint(folder: pathlib.Path, case: str) -> torch.nn.Module:
    """The tiny MoE model of `case` written to `folder` in its format (the projections quantized,
    the rest in bfloat16). Returns a plain HF model in fp32 holding the dequantized weights and
    the bfloat16-rounded rest (HF's own loading of a folder of them)."""
    name, quant, scheme = FORMATS[case]
    model = olmoe() if name == "olmoe" else tiny(name)
    dense_folder = folder / "dequantized"
    model.save_pretrained(dense_folder)  # the on-disk names: the experts one by one
    with safe_open(str(dense_folder / "model.safetensors"), "pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}
    tensors, dequantized = {}, {}
    for key, value in stored.items():
        module, _, leaf = key.rpartition(".")
        expert = ".experts." in module
        if leaf == "weight" and module.rpartition(".")[2] in QUANTIZED and not (expert and scheme in ("nf4", "int8")):
            if scheme == "int8":
                parts = to_bnb_int8(value)
                dequantized[key] = bnb_int8_dequantize(parts)
            elif scheme == "nf4":
                parts = to_bnb_nf4(value, block_size=32, double_quant=True)
                dequantized[key] = bnb_dequantize(parts)
            elif scheme == "awq":
                parts = to_awq(*quantize(value, 32))
                dequantized[key] = awq_dequantize(**parts, group_size=32)
            elif scheme == "gptq":
                parts = to_gptq(value, 32, zero_offset=True, desc_act=True)
                dequantized[key] = gptq_dequantize(**parts, zero_offset=True)
            elif scheme == "channel":
                parts = to_compressed_tensors(value, "channel")
                dequantized[key] = compressed_tensors_dequantize(**parts)
            else:
                parts = to_finegrained(value, scheme)
                dequantized[key] = finegrained_dequantize(**parts, block=scheme)
            tensors.update({f"{module}.{k}": v for k, v in parts.items()})
        else:
            tensors[key] = value.to(torch.bfloat16)
            dequantized[key] = tensors[key].float()
    save_file(tensors, folder / "model.safetensors")
    save_file({k: v.contiguous() for k, v in dequantized.items()}, dense_folder / "model.safetensors",
              metadata={"format": "pt"})
    config = json.loads((dense_folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    model.generation_config.save_pretrained(folder)
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(dense_folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("block", [(32, 64), (128, 128), (1, 256), (96, 256), (20, 48)])
def test_dequantize_experts_is_each_experts_own_dequantization(block):
    """Whole blocks (broadcast) and partial edge blocks (expanded) alike: expert e's weight as
    quant.fp8 dequantizes it, in the order of the ids asked for (repeats included)."""
    from pagedkv.layers.moe_quantized import dequantize_experts
    from pagedkv.quant.fp8 import dequantize_fp8, from_finegrained_fp8

    experts = [from_finegrained_fp8(**to_finegrained(torch.randn(96, 256), block), block_size=block)
               for _ in range(4)]
    stacked = Fp8Experts(torch.stack([e.weight for e in experts]), torch.stack([e.scales for e in experts]), block)
    ids = torch.tensor([2, 0, 2, 3])
    want = torch.stack([dequantize_fp8(experts[e]) for e in ids.tolist()])
    for dtype in (torch.float32, torch.bfloat16, torch.float16):  # the fp32 product rounded once
        assert torch.equal(dequantize_experts(stacked, ids, dtype), want.to(dtype))


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("desc_act", [False, True])
def test_dequantize_int4_experts_is_each_experts_own_dequantization(desc_act, scale_dtype):
    """Packed two values a byte, each expert its own column order (GPTQ desc_act) or none; in
    every dtype the fp32 value rounded once (the scales' own dtype takes a shorter way)."""
    from pagedkv.layers.moe_quantized import dequantize_all, dequantize_experts, pack_int4_experts
    from pagedkv.quant.int4 import dequantize, from_gptq

    orders = [desc_act, desc_act, False, desc_act]  # with desc_act, one expert without a column order
    experts = [from_gptq(**to_gptq(torch.randn(96, 256), 32, zero_offset=False, desc_act=order), group_size=32,
                         zero_offset=False) for order in orders]
    for e in experts:
        e.scales = e.scales.to(scale_dtype)
    assert [e.perm is not None for e in experts] == orders
    stacked = pack_int4_experts([e.q for e in experts], [e.scales for e in experts], [e.zeros for e in experts], 32,
                                [e.perm for e in experts], "test")
    ids = torch.tensor([2, 0, 2, 3, 1])
    got = dequantize_experts(stacked, ids, torch.float32)
    assert torch.equal(got, torch.stack([dequantize(experts[e]) for e in ids.tolist()]))
    for dtype in (torch.bfloat16, torch.float16):
        assert torch.equal(dequantize_experts(stacked, ids, dtype), got.to(dtype))
    every = torch.stack([dequantize(e) for e in experts])
    for chunk in (1, 3, 4, 16):  # dequantize_all, chunk experts at a time (the last chunk short)
        assert torch.equal(dequantize_all(stacked, torch.float32, chunk), every)


@pytest.mark.parametrize("path", ["pairs gathered", "each expert once", "experts in chunks", "expert ops off"])
@pytest.mark.parametrize("case", list(FORMATS))
def test_generate_matches_hf_on_the_dequantized_model(tmp_path, case, path, monkeypatch):
    """Decode steps gather their pairs (FP8 and int4 experts: the quantized expert ops; "expert ops
    off": the dequantizing path they replace), or every step takes each hit expert once ("experts
    in chunks": a quantized prefill's dequantized temporary one expert large)."""
    form = FORMS.get(case.split("-")[0], Fp8Experts)
    if path == "expert ops off":
        if form is torch.Tensor:
            pytest.skip("dense experts")
        monkeypatch.setattr(moe, "quantized_kernels_take", lambda *args: False)
    monkeypatch.setattr(moe, "GROUPED_MIN_PAIRS", 10**9 if path in ("pairs gathered", "expert ops off") else 0)
    if path == "experts in chunks":
        monkeypatch.setattr(moe, "PREFILL_DEQUANTIZED_BYTES", 1)
    reference = write_checkpoint(tmp_path, case)
    model = pagedkv.from_pretrained_quantized(tmp_path, dtype=torch.float32, device="cpu")
    layers = model._pagedkv_model.weights.layers
    experts = [layer.moe for layer in layers if layer.moe is not None]
    assert experts and all(isinstance(m.down, form) and all(isinstance(g, form) for g in m.gate_up) for m in experts)
    if form is not torch.Tensor:
        held = [m.down.weight if form is Fp8Experts else m.down.packed for m in experts]
        assert all(t.dtype in (torch.float8_e4m3fn, torch.uint8) for t in held)  # never dequantized
    ids = torch.tensor(random_prompts([9, 9], seed=3))
    assert torch.equal(pagedkv.generate(model, ids, **GREEDY), reference.generate(ids, **GREEDY))


def test_weight_bytes_count_the_fp8_experts(tmp_path):
    """The bytes pagedkv holds: each stored e4m3 weight a byte a value, every other tensor (scales
    included) in the fp32 it runs in; nothing dequantized."""
    write_checkpoint(tmp_path, "fp8-block32x64-qwen3_moe")
    model = pagedkv.from_pretrained_quantized(tmp_path, dtype=torch.float32, device="cpu")
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        stored = [f.get_tensor(k) for k in f.keys()]
    expected = sum(t.numel() * (1 if t.dtype == torch.float8_e4m3fn else 4) for t in stored)
    assert weight_bytes(model._pagedkv_model.weights) == expected


@pytest.mark.parametrize("case", ["fp8-block128-qwen2_moe", "fp8-per-tensor-mixtral"])
def test_llm_matches_hf(tmp_path, case):
    reference = write_checkpoint(tmp_path, case)
    model = pagedkv.from_pretrained_quantized(tmp_path, dtype=torch.float32, device="cpu")
    assert_llm_matches(model, reference)


@pytest.mark.parametrize("case", ["fp8-block64-olmoe", "fp8-per-tensor-mixtral"])
def test_matches_transformers_loading_the_same_folder(tmp_path, case):
    """transformers reads the FineGrainedFP8 folder itself (dequantizing it: no GPU here). Its CPU
    dequantization takes whole blocks only, so not the 32x64 blocks' partial edges of qwen3_moe's
    [256, 96] down projections."""
    from transformers import AutoModelForCausalLM

    if torch.cuda.is_available():
        pytest.skip("transformers dequantizes FP8 only where no GPU is present")
    write_checkpoint(tmp_path, case)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    model = pagedkv.from_pretrained_quantized(tmp_path, dtype=torch.float32, device="cpu")
    ids = torch.tensor(random_prompts([7, 7], seed=6))
    assert torch.equal(pagedkv.generate(model, ids, **GREEDY), hf.generate(ids, **GREEDY))


def test_experts_quantized_in_part_are_named(tmp_path):
    """One expert's projection left unquantized among quantized ones, or a layer whose gate and up
    are quantized but whose down is not: ValueError naming the tensor or the layer."""
    write_checkpoint(tmp_path, "fp8-block32x64-qwen3_moe")
    path = tmp_path / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        original = {k: f.get_tensor(k) for k in f.keys()}
    tensors = dict(original)
    prefix = "model.layers.0.mlp.experts.3.up_proj"
    tensors[f"{prefix}.weight"] = torch.randn(MOE_CASES["qwen3_moe"][1]["moe_intermediate_size"], 256)
    del tensors[f"{prefix}.weight_scale_inv"]
    save_file(tensors, path)
    with pytest.raises(ValueError, match=rf"{prefix} is stored unquantized and expert 0's up_proj is not"):
        pagedkv.from_pretrained_quantized(tmp_path, dtype=torch.float32, device="cpu")
    tensors = dict(original)
    for e in range(MOE_CASES["qwen3_moe"][1]["num_experts"]):
        name = f"model.layers.0.mlp.experts.{e}.down_proj"
        tensors[f"{name}.weight"] = torch.randn(256, MOE_CASES["qwen3_moe"][1]["moe_intermediate_size"])
        del tensors[f"{name}.weight_scale_inv"]
    save_file(tensors, path)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp's experts are quantized in some projections only"):
        pagedkv.from_pretrained_quantized(tmp_path, dtype=torch.float32, device="cpu")


def test_llm_int8_experts_are_named(tmp_path):
    """Experts stored in LLM.int8 (transformers leaves them unquantized; a checkpoint written
    otherwise) are refused naming the tensor and what is read."""
    write_checkpoint(tmp_path, "bnb-int8-qwen3_moe")
    path = tmp_path / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    prefix = "model.layers.0.mlp.experts.0.gate_proj"
    tensors.update({f"{prefix}.{k}": v for k, v in to_bnb_int8(tensors.pop(f"{prefix}.weight").float()).items()})
    save_file(tensors, path)
    with pytest.raises(ValueError, match=rf"{prefix} in .*LLM.int8 experts are not read"):
        pagedkv.from_pretrained_quantized(tmp_path, dtype=torch.float32, device="cpu")


@pytest.mark.cuda
@pytest.mark.parametrize("case", ["fp8-block128-qwen2_moe", "fp8-block32x64-qwen3_moe", "gptq-desc_act-qwen3_moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_hf(tmp_path, case, dtype):
    """On the GPU the decode steps (the pairs' experts gathered and dequantized: device ops only)
    replay as CUDA graphs."""
    reference = write_checkpoint(tmp_path, case).to(device="cuda", dtype=dtype)
    model = pagedkv.from_pretrained_quantized(tmp_path, dtype=dtype, device="cuda")
    assert_cuda_generate_matches(model, reference, dtype)
