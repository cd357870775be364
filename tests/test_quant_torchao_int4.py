"""torchao int4 weight-only (Int4WeightOnlyConfig, tile_packed_to_4d: tinygemm's layout):
the layout read back against a literal transcription of torch's packing kernel (and, on CUDA,
torch's own `_convert_weight_to_int4pack`), the linear_w4a16 op with float zeros against a
plain-PyTorch linear with the dequantized weight, checkpoints written in the exact on-disk form
(transformers' flattened torchao tensors) run by from_pretrained_quantized with the tokens of HF on
the dequantized model, and on CUDA an HF model quantized by torchao itself, run by pagedkv and
saved then read back."""

from __future__ import annotations

import copy
import dataclasses
import json
import pathlib

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import pagedkv
from conftest import DEVICES
from models import tiny_model
from pagedkv.quant import Int4Weight, dequantize, linear_w4a16_weight, pack_w4a16
from pagedkv.quant.formats import quant_format, torchao_int4_config
from pagedkv.quant.torchao_int4 import from_torchao_tile_packed, pack_tile_packed, unpack_tile_packed
from pagedkv.tools.quant_writers import tinygemm_qparams, to_torchao_int4
from tolerance import assert_close_to_baseline, assert_tokens_equal_up_to_near_tie

GREEDY = dict(max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def tinygemm_quantize(w: torch.Tensor, group_size: int) -> Int4Weight:
    """w [N, K] -> its tinygemm quantization (the writer's qparams) as an Int4Weight with float zeros."""
    q, scale, zero = tinygemm_qparams(w, group_size)
    return Int4Weight(q=q, scales=scale, zeros=zero, group_size=group_size, perm=None)


def torch_kernel_pack(q: torch.Tensor) -> torch.Tensor:
    """A literal transcription of torch's matrix_to_m16n8k16_Bint4_layout (8 inner k-tiles) over
    torchao's input: q [N, K] (N % 8 == 0, K % 1024 == 0) -> bytes [N][K / 2] (even column in the
    high nibble: torchao's `q[:, ::2] << 4 | q[:, 1::2]`) -> int32 [N / 8][K / 128][32][4]."""
    data = (q[:, ::2].int() << 4 | q[:, 1::2].int()).tolist()
    n_tiles, k_outer = q.shape[0] // 8, q.shape[1] // 128
    out = torch.zeros((n_tiles, k_outer, 32, 4), dtype=torch.int64)
    for n_tile in range(n_tiles):
        for ko in range(k_outer):
            for t in range(32):
                for inner in range(0, 8, 2):
                    n0 = n_tile * 8 + t // 4
                    base0 = (ko * 8 + inner) * 16 // 2
                    base1 = base0 + 8
                    ks = [base0 + t % 4, base0 + t % 4 + 4, base1 + t % 4, base1 + t % 4 + 4]
                    v = [data[n0][k] for k in ks]
                    pack = ((v[3] & 0xF) << 28 | (v[2] & 0xF) << 24 | (v[1] & 0xF) << 20 | (v[0] & 0xF) << 16
                            | (v[3] & 0xF0) << 8 | (v[2] & 0xF0) << 4 | (v[1] & 0xF0) | (v[0] & 0xF0) >> 4)
                    out[n_tile, ko, t, inner // 2] = pack
    return torch.where(out >= 2 ** 31, out - 2 ** 32, out).to(torch.int32)


def test_layout_is_torchs_packing_kernel():
    q = torch.randint(0, 16, (16, 1024), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    packed = pack_tile_packed(q)
    assert packed.shape == (2, 8, 32, 4) and packed.dtype == torch.int32
    assert torch.equal(packed, torch_kernel_pack(q))
    assert torch.equal(unpack_tile_packed(packed, 16, 1024), q)


@pytest.mark.parametrize("out_features,in_features", [(8, 1024), (40, 1280), (13, 256), (96, 2048)])
def test_unpack_inverts_pack_and_drops_padding(out_features, in_features):
    q = torch.randint(0, 16, (out_features, in_features), dtype=torch.uint8)
    packed = pack_tile_packed(q)
    assert packed.shape == (-(-out_features // 8), -(-in_features // 1024) * 8, 32, 4)
    assert torch.equal(unpack_tile_packed(packed, out_features, in_features), q)


@pytest.mark.cuda
@pytest.mark.parametrize("out_features,in_features", [(64, 1024), (24, 3072)])
def test_layout_matches_torchs_own_op(out_features, in_features):
    """torch's CUDA packing op and its tinygemm product against the reader and linear_w4a16."""
    q = torch.randint(0, 16, (out_features, in_features), dtype=torch.uint8, device="cuda")
    ours = pack_tile_packed(q)
    theirs = torch.ops.aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).contiguous(), 8)
    assert torch.equal(ours, theirs)
    w = tinygemm_quantize(torch.randn(out_features, in_features, device="cuda") * 0.05, 128)
    w.q = q
    scale_and_zero = torch.stack([w.scales.t(), w.zeros.t()], dim=-1).contiguous()  # [K / g, N, 2]
    x = torch.randn(3, in_features, device="cuda", dtype=torch.bfloat16)
    tinygemm = torch.ops.aten._weight_int4pack_mm(x, theirs, 128, scale_and_zero)
    layer = pack_w4a16(from_torchao_tile_packed(theirs, scale_and_zero, out_features, in_features, 128))
    assert_close_to_baseline(linear_w4a16_weight(x, layer), baseline=tinygemm,
                             reference=F.linear(x.double(), dequantize(w, torch.float64)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("in_features,out_features", [(256, 72), (1024, 33)])
@pytest.mark.parametrize("rows", [1, 3, 8, 17])
def test_linear_w4a16_float_zeros(device, dtype, group_size, in_features, out_features, rows):
    """(q - 8) * scale + zero, scales and zeros bf16 (what torchao stores), on every path: the
    tensor-core kernel (bf16 x), the CUDA-core kernel (fp16 x), cuBLAS (fp32 x, 17 rows)."""
    w = tinygemm_quantize(torch.randn(out_features, in_features) * 0.05, group_size)
    layer = pack_w4a16(w)
    assert layer.zeros.dtype == torch.bfloat16
    layer = dataclasses.replace(layer, packed=layer.packed.to(device), scales=layer.scales.to(device),
                                zeros=layer.zeros.to(device))
    x = torch.randn(rows, in_features, dtype=dtype, device=device)
    out = torch.full((rows, out_features), float("nan"), dtype=dtype, device=device)
    linear_w4a16_weight(x, layer, out=out)
    assert_close_to_baseline(out, baseline=F.linear(x, dequantize(w, dtype).to(device)),
                             reference=F.linear(x.double(), dequantize(w, torch.float64).to(device)))


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [1, 5, 8])
def test_float_zeros_on_every_launch_plan(rows):
    """The tensor-core kernel's float-zero format at each tile count's plan, the last tile partial."""
    from test_quant_int4 import launch_plan_widths

    for out_features in launch_plan_widths():
        w = tinygemm_quantize(torch.randn(out_features, 384) * 0.05, 128)
        layer = pack_w4a16(w)
        layer = dataclasses.replace(layer, packed=layer.packed.cuda(), scales=layer.scales.cuda(),
                                    zeros=layer.zeros.cuda())
        x = torch.randn(rows, 384, dtype=torch.bfloat16, device="cuda")
        assert_close_to_baseline(linear_w4a16_weight(x, layer),
                                 baseline=F.linear(x, dequantize(w, torch.bfloat16).cuda()),
                                 reference=F.linear(x.double(), dequantize(w, torch.float64).cuda()))


def test_reader_names_misshapen_tensors():
    w = tinygemm_quantize(torch.randn(16, 256), 64)
    qdata = pack_tile_packed(w.q)
    sz = torch.stack([w.scales.t(), w.zeros.t()], dim=-1)  # [4, 16, 2]: K 256 is padded to 1024 (16 groups)
    padded = torch.zeros(16, 16, 2, dtype=torch.bfloat16)
    padded[:4] = sz
    read = from_torchao_tile_packed(qdata, padded, 16, 256, 64)
    assert torch.equal(read.q, w.q) and torch.equal(read.scales, w.scales) and torch.equal(read.zeros, w.zeros)
    with pytest.raises(ValueError, match=r"scale_and_zero must be \[16, 16, 2\] torch.bfloat16"):
        from_torchao_tile_packed(qdata, sz, 16, 256, 64)
    with pytest.raises(ValueError, match=r"qdata must be \[2, 8, 32, 4\] torch.int32 for a \[16, 256\] weight"):
        from_torchao_tile_packed(qdata[:1], padded, 16, 256, 64)
    with pytest.raises(ValueError, match=r"group_size 96 must divide in_features 256"):
        from_torchao_tile_packed(qdata, padded, 16, 256, 96)


def test_config_checks_name_the_field():
    assert quant_format(torchao_int4_config(64)).name == "torchao int4"
    enum_form = torchao_int4_config()
    enum_form["quant_type"]["default"]["_data"]["int4_packing_format"] = {"_type": "Int4PackingFormat",
                                                                          "_data": "TILE_PACKED_TO_4D"}
    assert quant_format(enum_form).group_size == 128
    with pytest.raises(ValueError, match=r"int4_packing_format='plain' is not supported"):
        quant_format(torchao_int4_config(packing="plain"))
    with pytest.raises(ValueError, match=r"group_size=48 is not supported; supported: 32, 64, 128, 256"):
        quant_format(torchao_int4_config(48))
    other = torchao_int4_config()
    other["quant_type"]["default"]["_type"] = "Int8WeightOnlyConfig"
    with pytest.raises(ValueError, match=r"'Int8WeightOnlyConfig version 2' is not supported"):
        quant_format(other)
    with pytest.raises(ValueError, match=r"quant_type='int4_weight_only' is not supported"):
        quant_format(dict(torchao_int4_config(), quant_type="int4_weight_only"))
    with pytest.raises(ValueError, match=r"include_input_output_embeddings=True is not supported"):
        quant_format(dict(torchao_int4_config(), include_input_output_embeddings=True))


def write_checkpoint(folder: pathlib.Path, arch: str, group_size: int) -> torch.nn.Module:
    """A tiny random model's decoder linears quantized as torchao stores them (the other tensors
    bf16, as torchao quantizes bf16 models); returns the plain HF model (fp32) holding the
    dequantized weights and the bf16-rounded rest."""
    model = tiny_model(arch)
    reference = copy.deepcopy(model)
    tensors, metadata = {}, {}
    for name, module in model.named_modules():
        if name.rpartition(".")[2] not in LINEARS:
            continue
        w = tinygemm_quantize(module.weight.detach(), group_size)
        n, k = w.q.shape
        tensors.update({f"{name}.{key}": t for key, t in to_torchao_int4(module.weight.detach(), group_size).items()})
        metadata[f"{name}.weight"] = json.dumps({"_type": "Int4TilePackedTo4dTensor", "_data": {
            "block_size": [1, group_size], "shape": [n, k]}, "_tensor_data_names": ["qdata", "scale_and_zero"]})
        reference.get_submodule(name).weight.data.copy_(dequantize(w, torch.float32))
    for name, p in model.named_parameters():
        if name.rpartition(".")[0].rpartition(".")[2] in LINEARS and name.endswith(".weight"):
            continue
        tensors[name] = p.detach().to(torch.bfloat16)
        reference.get_parameter(name).data.copy_(tensors[name].float())
        metadata[name] = json.dumps({"_type": "Tensor"})
    metadata["tensor_names"] = json.dumps(sorted(n for n in metadata))
    save_file(tensors, folder / "model.safetensors", metadata=metadata)
    model.config.quantization_config = torchao_int4_config(group_size)
    model.config.torch_dtype = "bfloat16"
    model.config.to_json_file(folder / "config.json")
    return reference


@pytest.mark.parametrize("arch,group_size", [("llama", 64), ("qwen3", 32)])
def test_checkpoint_tokens_equal_hf_on_the_dequantized_model(tmp_path, arch, group_size):
    reference = write_checkpoint(tmp_path, arch, group_size)
    model = pagedkv.from_pretrained_quantized(tmp_path, dtype=torch.float32)
    ids = torch.randint(3, reference.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    assert torch.equal(pagedkv.generate(model, ids, **GREEDY), reference.generate(ids, **GREEDY))


class Int4TilePackedTo4dTensor(torch.Tensor):
    """A stand-in of torchao's tinygemm int4 weight (the class name, its inner tensors, block_size,
    __tensor_flatten__; no compute), so the CPU runs the path of a model torchao quantized."""

    tensor_data_names = ["qdata", "scale_and_zero"]

    @staticmethod
    def __new__(cls, qdata, scale_and_zero, block_size, shape):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.bfloat16, device=qdata.device)

    def __init__(self, qdata, scale_and_zero, block_size, shape):
        self.qdata, self.scale_and_zero, self.block_size = qdata, scale_and_zero, block_size

    def __tensor_flatten__(self):
        return self.tensor_data_names, [self.block_size, self.shape]

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:  # nn.Parameter's
            return cls(args[0].qdata, args[0].scale_and_zero, args[0].block_size, args[0].shape)
        raise NotImplementedError(f"the stand-in computes nothing: {func}")


def torchao_quantized(arch: str, group_size: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(a tiny model whose decoder linears hold stand-in tinygemm weights, as quantize_ leaves
    them; the plain model holding their dequantized weights)."""
    model = tiny_model(arch)
    reference = copy.deepcopy(model)
    for name, module in model.named_modules():
        if name.rpartition(".")[2] in LINEARS:
            w = module.weight.detach()
            stored = to_torchao_int4(w, group_size)
            fake = Int4TilePackedTo4dTensor(stored["_weight_qdata"], stored["_weight_scale_and_zero"],
                                            [1, group_size], w.shape)
            module.weight = torch.nn.Parameter(fake, requires_grad=False)
            reference.get_submodule(name).weight.data.copy_(dequantize(tinygemm_quantize(w, group_size)))
    return model, reference


@pytest.mark.parametrize("with_config", [True, False], ids=["transformers", "quantize_"])
def test_model_torchao_quantized_runs_from_its_packed_tensors(with_config):
    """A model transformers quantized with torchao (its quantization_config set), or torchao's
    quantize_ alone (none): pagedkv reads the weights' inner tensors, with the tokens of HF on
    the dequantized model; an in-place write to an inner tensor is seen by the next call."""
    model, reference = torchao_quantized("llama", 64)
    if with_config:
        model.config.quantization_config = torchao_int4_config(64)
    ids = torch.randint(3, reference.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(3))
    before = pagedkv.generate(model, ids, **GREEDY)
    assert torch.equal(before, reference.generate(ids, **GREEDY))
    layer = model.model.layers[0].mlp.down_proj
    with torch.no_grad():
        layer.weight.scale_and_zero[..., 0].mul_(2)  # every scale doubled: W = (q - 8) 2s + z
        reference.model.layers[0].mlp.down_proj.weight.copy_(dequantize(from_torchao_tile_packed(
            layer.weight.qdata, layer.weight.scale_and_zero, *layer.weight.shape, 64)))
    after = reference.generate(ids, **GREEDY)
    assert not torch.equal(after, before)  # the write changes the tokens
    assert torch.equal(pagedkv.generate(model, ids, **GREEDY), after)


def test_llm_on_the_torchao_model():
    """pagedkv.LLM on the torchao-quantized model (chunked prefill beside decodes): HF's tokens on
    the dequantized model, each prompt alone, nothing leaked."""
    from test_quantized_checkpoints import assert_llm_matches

    model, reference = torchao_quantized("qwen3", 32)
    model.config.quantization_config = torchao_int4_config(32)
    assert_llm_matches(model, reference)


def test_mixed_group_sizes_are_refused_naming_the_layer():
    model, _ = torchao_quantized("llama", 64)
    w = model.model.layers[1].self_attn.o_proj.weight
    model.model.layers[1].self_attn.o_proj.weight = torch.nn.Parameter(
        Int4TilePackedTo4dTensor(w.qdata, w.scale_and_zero, [1, 128], w.shape), requires_grad=False)
    with pytest.raises(pagedkv.UnsupportedModel, match=r"model.layers.1.self_attn.o_proj is a Linear .*block_size "
                       r"\[1, 128\]; the config's group_size makes it \[1, 64\]"):
        pagedkv.generate(model, torch.tensor([[5, 6, 7]]), max_new_tokens=2)


def test_a_torchao_subclass_weight_pagedkv_cannot_read_is_refused():
    """A weight of some other tensor subclass on pagedkv's own forward: a named refusal, not a
    failure deep in the weight copy (torchao's quantize_ with a config pagedkv does not read)."""
    model = tiny_model("llama")

    class Marked(torch.Tensor):  # a subclass pagedkv knows nothing about
        pass

    layer = model.model.layers[1].mlp.up_proj
    layer.weight = torch.nn.Parameter(layer.weight.detach().as_subclass(Marked), requires_grad=False)
    with pytest.raises(pagedkv.UnsupportedModel, match=r"model.layers.1.mlp.up_proj.weight is a Marked from "
                       r"test_quant_torchao_int4 \(a tensor subclass"):
        pagedkv.generate(model, torch.tensor([[5, 6, 7]]), max_new_tokens=2)


@pytest.mark.cuda
def test_hf_model_quantized_by_torchao(tmp_path):
    """An HF model transformers quantized with torchao itself (Int4WeightOnlyConfig,
    tile_packed_to_4d) on load: pagedkv runs it from its packed tensors with HF's tokens up to
    near-ties; the checkpoint its save_pretrained writes, read by from_pretrained_quantized and by
    transformers, gives pagedkv's tokens again."""
    pytest.importorskip("torchao")
    from torchao.quantization import Int4WeightOnlyConfig
    from transformers import AutoModelForCausalLM, TorchAoConfig

    tiny_model("llama", dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16")
    config = TorchAoConfig(quant_type=Int4WeightOnlyConfig(group_size=64, int4_packing_format="tile_packed_to_4d"))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", quantization_config=config, device_map="cuda",
                                                 dtype=torch.bfloat16)
    assert type(model.model.layers[0].self_attn.q_proj.weight).__name__ == "Int4TilePackedTo4dTensor"
    ids = torch.randint(3, model.config.vocab_size, (2, 9), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(0))
    ours = pagedkv.generate(model, ids, **GREEDY)
    hf = model.generate(ids, **GREEDY, output_logits=True, return_dict_in_generate=True)
    assert_tokens_equal_up_to_near_tie(ours, hf, ids.shape[1])
    model.save_pretrained(tmp_path / "int4")
    loaded = pagedkv.from_pretrained_quantized(tmp_path / "int4", device="cuda")
    assert torch.equal(pagedkv.generate(loaded, ids, **GREEDY), ours)
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "int4", device_map="cuda")
    assert torch.equal(pagedkv.generate(again, ids, **GREEDY), ours)


@pytest.mark.cuda
def test_model_quantized_by_torchao_quantize_alone():
    """torchao's quantize_ without transformers (no quantization_config): pagedkv reads the format
    from the weights themselves, with HF's tokens up to near-ties."""
    pytest.importorskip("torchao")
    from torchao.quantization import Int4WeightOnlyConfig, quantize_

    model = tiny_model("qwen3", dtype=torch.bfloat16, device="cuda")
    quantize_(model.model.layers, Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d"))
    assert not getattr(model.config, "quantization_config", None)
    ids = torch.randint(3, model.config.vocab_size, (3, 6), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(2))
    ours = pagedkv.generate(model, ids, **GREEDY)
    hf = model.generate(ids, **GREEDY, output_logits=True, return_dict_in_generate=True)
    assert_tokens_equal_up_to_near_tie(ours, hf, ids.shape[1])
