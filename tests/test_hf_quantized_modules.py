"""HF models that transformers loaded quantized (bitsandbytes NF4, compressed-tensors W4A16 and
FP8, FineGrainedFP8's FP8Linear) run by pagedkv.generate from their modules' packed tensors
(models/hf_quantized.py): the tokens of from_pretrained_quantized on the same checkpoint, and of
HF's generate where its CPU forward computes with the dequantized weights. Other quantized
modules are refused naming their class; in-place writes to the packed tensors are seen."""

from __future__ import annotations

import pytest
import torch

import pagedkv
from int8_formats import bnb_int8_dequantize
from models import tiny_model
from test_engine import random_prompts
from test_quantized_formats import write_checkpoint
from pagedkv.quant.fp8 import Fp8Weight
from pagedkv.quant.int8 import Int8Weight
from pagedkv.quant.linear import W4A16Weight
from pagedkv.quant.linear_nf4 import Nf4Packed

GREEDY = dict(max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def ids(seed: int = 3) -> torch.Tensor:
    return torch.tensor(random_prompts([9, 9], seed=seed))


def bnb_model(folder, double_quant: bool, arch: str = "qwen2", seed: int = 0, device: str = "cpu", **config):
    """(an fp32 tiny model, it loaded by transformers + bitsandbytes as NF4 from a folder)."""
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    reference = tiny_model(arch, seed=seed)
    reference.save_pretrained(folder)
    quant = dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=double_quant,
                 bnb_4bit_compute_dtype=torch.float32) | config
    hf = AutoModelForCausalLM.from_pretrained(folder, quantization_config=BitsAndBytesConfig(**quant),
                                              device_map=device, dtype=torch.float32)
    return reference, hf


def runs_as_its_checkpoint(hf, folder, cls: type) -> torch.Tensor:
    """pagedkv's greedy tokens on `hf` (a model loaded quantized), after checking that its linears
    are held as `cls` and that from_pretrained_quantized on the folder hf.save_pretrained writes
    gives the same tokens."""
    hf.save_pretrained(folder)
    got = pagedkv.generate(hf, ids(), **GREEDY)
    assert_packed(hf, cls)
    from_folder = pagedkv.from_pretrained_quantized(folder, dtype=torch.float32, device="cpu")
    assert torch.equal(got, pagedkv.generate(from_folder, ids(), **GREEDY))
    return got


def load_dequantized(reference, hf, kind: str, dequantize) -> None:
    """Each `kind` module of hf (a bitsandbytes class name) into reference's linear of its name, as
    dequantize(module) computes its weight."""
    for name, module in hf.named_modules():
        if type(module).__name__ == kind:
            reference.get_submodule(name).weight.data.copy_(dequantize(module))


def assert_packed(model, cls: type) -> None:
    layer = model._pagedkv_model.weights.layers[0]
    for w in (layer.qkv, layer.o, layer.gate_up, layer.down):  # fused, or parts where blocks differ
        assert all(isinstance(p, cls) for p in (w if isinstance(w, tuple) else [w])), w


@pytest.mark.parametrize("double_quant", [True, False])
def test_bnb_nf4_model_runs_as_its_checkpoint(tmp_path, double_quant):
    """Equal to from_pretrained_quantized on the folder save_pretrained wrote, and to HF on the
    weights bitsandbytes dequantizes (its CPU forward is those only without double quantization:
    test_quantized_loaders.py); again after HF's own forward ran (it may repack on the CPU)."""
    bnb = pytest.importorskip("bitsandbytes.functional")

    reference, hf = bnb_model(tmp_path / "fp32", double_quant)
    got = runs_as_its_checkpoint(hf, tmp_path / "nf4", Nf4Packed)
    load_dequantized(reference, hf, "Linear4bit", lambda m: bnb.dequantize_4bit(m.weight.data, m.weight.quant_state))
    assert torch.equal(got, reference.generate(ids(), **GREEDY))
    state = hf._pagedkv_model
    hf_tokens = hf.generate(ids(), **GREEDY)
    if not double_quant:
        assert torch.equal(got, hf_tokens)
    again = pagedkv.generate(hf, ids(), **GREEDY)
    if getattr(hf.model.layers[0].mlp.down_proj.weight.quant_state, "packing_format_for_cpu", False):
        # bitsandbytes' forward repacked the layers in place for its AVX512-BF16 CPU kernel (absmax
        # rounded to bf16: other weights): read again, never the old ones
        assert hf._pagedkv_model is not state
    else:
        assert torch.equal(again, got)


@pytest.mark.parametrize("case", ["ct-w4a16-g128-llama", "ct-w4a16-channel-qwen3", "ct-fp8-channel-qwen2",
                                  "ct-fp8-block-qwen3"])
def test_compressed_tensors_model_runs_as_its_checkpoint(tmp_path, case):
    """Compressed modules read packed; equal to from_pretrained_quantized and to HF's generate
    (whose forward decompresses the modules: pagedkv then runs the decompressed weights)."""
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    write_checkpoint(tmp_path, case)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    got = pagedkv.generate(hf, ids(), **GREEDY)
    assert_packed(hf, W4A16Weight if "w4a16" in case else Fp8Weight)
    from_folder = pagedkv.from_pretrained_quantized(tmp_path, dtype=torch.float32, device="cpu")
    assert torch.equal(got, pagedkv.generate(from_folder, ids(), **GREEDY))
    assert torch.equal(got, hf.generate(ids(), **GREEDY))
    assert torch.equal(pagedkv.generate(hf, ids(), **GREEDY), got)  # now decompressed, dense


def fp8_model(folder, case: str, device: str = "cpu"):
    """The HF model transformers builds from a FineGrainedFP8 folder on a GPU (FP8Linear layers
    holding the stored tensors), built by hand: on the CPU transformers dequantizes instead."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import FP8Linear

    reference, _ = write_checkpoint(folder, case)
    config = AutoConfig.from_pretrained(folder)
    block = config.quantization_config["weight_block_size"]
    del config.quantization_config
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for name, module in list(hf.named_modules()):
        if name.rpartition(".")[2] in LINEARS:
            parent, _, leaf = name.rpartition(".")
            setattr(hf.get_submodule(parent), leaf, FP8Linear(module.in_features, module.out_features, block_size=block,
                                                              has_bias=module.bias is not None))
    hf.load_state_dict(load_file(folder / "model.safetensors"), strict=False)
    hf.config.quantization_config = FineGrainedFP8Config(weight_block_size=block)
    return reference, hf.to(device).eval()


@pytest.mark.parametrize("case", ["fp8-block128-llama", "fp8-per-tensor-llama", "fp8-block96x64-qwen2"])
def test_fp8linear_model_runs_as_its_checkpoint(tmp_path, case):
    """FP8Linear's own forward needs a GPU (triton): against the dequantized weights instead."""
    reference, hf = fp8_model(tmp_path, case)
    got = pagedkv.generate(hf, ids(), **GREEDY)
    assert_packed(hf, Fp8Weight)
    from_folder = pagedkv.from_pretrained_quantized(tmp_path, dtype=torch.float32, device="cpu")
    assert torch.equal(got, pagedkv.generate(from_folder, ids(), **GREEDY))
    assert torch.equal(got, reference.generate(ids(), **GREEDY))


def test_bnb_int8_model_runs_as_its_checkpoint(tmp_path):
    """A model transformers + bitsandbytes quantized to LLM.int8 on loading: pagedkv reads its
    Linear8bitLt modules' int8 weights and SCB, the tokens of from_pretrained_quantized on the
    folder save_pretrained wrote and of HF on bitsandbytes' dequantized weights (pagedkv does not
    quantize activations as bitsandbytes' forward does); a write to SCB is seen."""
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    reference = tiny_model("llama")
    reference.save_pretrained(tmp_path / "fp32")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "fp32", quantization_config=BitsAndBytesConfig(
        load_in_8bit=True), device_map="cpu", dtype=torch.float32)
    got = runs_as_its_checkpoint(hf, tmp_path / "int8", Int8Weight)
    load_dequantized(reference, hf, "Linear8bitLt",
                     lambda m: bnb_int8_dequantize({"weight": m.weight.data, "SCB": m.weight.SCB}))
    assert torch.equal(got, reference.generate(ids(), **GREEDY))
    state = hf._pagedkv_model
    hf.model.layers[0].mlp.down_proj.weight.SCB.mul_(4)  # in place: the weights pagedkv held are stale
    pagedkv.generate(hf, ids(), **GREEDY)
    assert hf._pagedkv_model is not state


def test_bnb_int8_model_runs_after_its_own_forward(tmp_path):
    """bitsandbytes' first forward moves a Linear8bitLt's SCB from its weight to its state
    (init_8bit_state): a model HF already generated with is still LLM.int8 to pagedkv, which
    gives the tokens it gave before that forward, and held weights stay valid across it."""
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    tiny_model("llama").save_pretrained(tmp_path)

    def load():
        return AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=BitsAndBytesConfig(
            load_in_8bit=True), device_map="cpu", dtype=torch.float32)

    held = load()
    before = pagedkv.generate(held, ids(), **GREEDY)
    state = held._pagedkv_model
    held.generate(ids(), **GREEDY)  # HF's own LLM.int8 forward, after pagedkv read the weights
    assert torch.equal(pagedkv.generate(held, ids(), **GREEDY), before)
    assert held._pagedkv_model is state  # the same tensors, only moved: nothing read again
    hf = load()
    hf.generate(ids(), **GREEDY)  # before pagedkv ever saw it
    assert hf.model.layers[0].self_attn.q_proj.weight.SCB is None  # moved to the state
    assert pagedkv.unsupported_reason(hf) is None
    assert torch.equal(pagedkv.generate(hf, ids(), **GREEDY), before)
    state = hf._pagedkv_model
    hf.model.layers[0].mlp.down_proj.state.SCB.mul_(4)  # where SCB now lives: a write is seen
    pagedkv.generate(hf, ids(), **GREEDY)
    assert hf._pagedkv_model is not state


@pytest.mark.parametrize("quant, names", [
    (dict(load_in_8bit=True, llm_int8_has_fp16_weight=True), ["Linear8bitLt", "llm_int8_has_fp16_weight"]),
    (dict(load_in_4bit=True, bnb_4bit_quant_type="fp4"), ["Linear4bit", "bnb_4bit_quant_type='fp4'"]),
])
def test_other_quantized_modules_are_refused_naming_the_class(tmp_path, quant, names):
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    tiny_model("llama").save_pretrained(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=BitsAndBytesConfig(**quant),
                                              device_map="cpu", dtype=torch.float32)
    reason = pagedkv.unsupported_reason(hf)
    assert all(n in reason for n in names) and "Linear4bit with quant_type 'nf4'" in reason, reason
    with pytest.raises(pagedkv.UnsupportedModel, match=names[0]):
        pagedkv.generate(hf, ids(), **GREEDY)
    assert getattr(hf, "_pagedkv_model", None) is None  # nothing held


def test_quantized_lm_head_is_refused(tmp_path):
    _, hf = bnb_model(tmp_path, False, arch="llama", llm_int8_skip_modules=[])
    assert type(hf.lm_head).__name__ == "Linear4bit"
    reason = pagedkv.unsupported_reason(hf)
    assert "lm_head is a Linear4bit" in reason and "decoder-layer linears only" in reason, reason


def test_bnb_in_place_write_gives_the_new_weights_tokens(tmp_path):
    """The packed tensors and quant_state written in place (no new tensor): pagedkv reads them
    again, never runs the old ones."""
    _, hf = bnb_model(tmp_path / "a", True)
    _, other = bnb_model(tmp_path / "b", True, seed=1)
    old = pagedkv.generate(hf, ids(), **GREEDY)
    new = pagedkv.generate(other, ids(), **GREEDY)
    assert not torch.equal(old, new)
    with torch.no_grad():
        for name, a in hf.named_modules():
            if type(a).__name__ != "Linear4bit":
                continue
            b = other.get_submodule(name)
            a.weight.copy_(b.weight)
            sa, sb = a.weight.quant_state, b.weight.quant_state
            for t, u in ((sa.absmax, sb.absmax), (sa.offset, sb.offset), (sa.state2.absmax, sb.state2.absmax)):
                t.copy_(u)
    for name, p in other.named_parameters():
        if p.dtype == torch.float32:
            hf.get_parameter(name).data.copy_(p)
    assert torch.equal(pagedkv.generate(hf, ids(), **GREEDY), new)


def test_compressed_tensors_in_place_write_gives_the_new_weights_tokens(tmp_path):
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    write_checkpoint(tmp_path, "ct-w4a16-g128-llama")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    old = pagedkv.generate(hf, ids(), **GREEDY)
    packed = hf.model.layers[1].mlp.down_proj.weight_packed
    with torch.no_grad():
        packed.copy_(packed.flip(0))
    changed = pagedkv.generate(hf, ids(), **GREEDY)
    assert not torch.equal(changed, old)
    fresh = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        fresh.model.layers[1].mlp.down_proj.weight_packed.copy_(packed)
    assert torch.equal(changed, pagedkv.generate(fresh, ids(), **GREEDY))


@pytest.mark.cuda
@pytest.mark.parametrize("double_quant", [True, False])
def test_cuda_bnb_nf4_model_runs_as_its_checkpoint(tmp_path, double_quant):
    _, hf = bnb_model(tmp_path / "fp32", double_quant, device="cuda")
    hf.save_pretrained(tmp_path / "nf4")
    prompt = ids().cuda()
    got = pagedkv.generate(hf, prompt, **GREEDY)
    assert_packed(hf, Nf4Packed)
    from_folder = pagedkv.from_pretrained_quantized(tmp_path / "nf4", dtype=torch.float32, device="cuda")
    assert torch.equal(got, pagedkv.generate(from_folder, prompt, **GREEDY))


@pytest.mark.cuda
@pytest.mark.parametrize("case", ["fp8-block128-llama", "fp8-per-tensor-llama"])
def test_cuda_fp8_model_transformers_loads_runs_as_its_checkpoint(tmp_path, case):
    """On a GPU transformers loads a FineGrainedFP8 folder as FP8Linear layers."""
    from transformers import AutoModelForCausalLM

    write_checkpoint(tmp_path, case)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16, device_map="cuda").eval()
    assert type(hf.model.layers[0].self_attn.q_proj).__name__ == "FP8Linear"
    prompt = ids().cuda()
    got = pagedkv.generate(hf, prompt, **GREEDY)
    assert_packed(hf, Fp8Weight)
    from_folder = pagedkv.from_pretrained_quantized(tmp_path, dtype=torch.bfloat16, device="cuda")
    assert torch.equal(got, pagedkv.generate(from_folder, prompt, **GREEDY))
