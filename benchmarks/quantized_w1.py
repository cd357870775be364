"""bench_quantized.py's and bench_moe_quantized.py's checkpoints: an HF model's decoder linears
written in a quantized format's exact on-disk tensors (pagedkv.tools.quant_writers, the writers the
tests check), a mixture-of-experts layer's experts one by one under the names save_pretrained
gives them (mlp.experts.E.gate_proj / up_proj / down_proj), the rest (embedding, norms, routers,
biases, LM head) in bfloat16 as these checkpoints keep them; one safetensors shard a layer and
model.safetensors.index.json, so at most one layer's tensors sit on the host. Quantized on the
model's device (the GPU in the W1 run: seconds, where the CPU takes minutes)."""

from __future__ import annotations

import copy
import dataclasses
import json
import pathlib
from typing import Callable

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from pagedkv.quant.formats import torchao_int4_config
from pagedkv.tools.quant_writers import (ct_config, to_bnb_int8, to_bnb_nf4, to_compressed_tensors_int4, to_finegrained,
                                         to_torchao_int4)

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class Format:
    label: str  # what the table calls it
    quantization_config: dict  # config.json's, as the format's tools write it
    write: Callable[[torch.Tensor], dict[str, torch.Tensor]]  # w [out, in] -> tensors by suffix
    goals: dict[int, float]  # batch -> issue 33's ms/step goal on an H100 (28 layers)


FORMATS = {
    "fp8": Format("FP8 (FineGrainedFP8, 128x128 blocks)",
                  {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
                  lambda w: to_finegrained(w, (128, 128)), {1: 2.9, 8: 3.3}),
    "int4": Format("INT4 (compressed-tensors W4A16, group 128)",
                   ct_config("pack-quantized", {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}),
                   lambda w: to_compressed_tensors_int4(w, 128), {1: 1.8, 8: 2.3}),
    "int4-torchao": Format("INT4 (torchao tile_packed_to_4d, group 128: float zeros)", torchao_int4_config(128),
                           lambda w: to_torchao_int4(w, 128), {1: 1.8, 8: 2.3}),
    "nf4": Format("NF4 (bitsandbytes, double quant)",
                  {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                   "bnb_4bit_use_double_quant": True, "bnb_4bit_compute_dtype": "bfloat16",
                   "bnb_4bit_quant_storage": "uint8"},
                  lambda w: to_bnb_nf4(w, 64, double_quant=True), {1: 2.0}),
    "int8": Format("INT8 (bitsandbytes LLM.int8; pagedkv: weights only)",
                   {"quant_method": "bitsandbytes", "load_in_8bit": True, "llm_int8_threshold": 6.0},
                   to_bnb_int8, {}),  # no goal in issue 33
}


def is_quantized_linear(name: str) -> bool:
    """A decoder linear's weight (model.layers.N.self_attn.q_proj.weight ...), not its bias."""
    module, _, leaf = name.rpartition(".")
    return leaf == "weight" and module.rpartition(".")[2] in LINEARS


def expert_tensors(name: str, p: torch.Tensor, fmt: Format) -> dict[str, torch.Tensor]:
    """transformers' stacked experts (mlp.experts.gate_up_proj [E, 2I, D]: each expert's gate rows,
    then its up rows; mlp.experts.down_proj [E, D, I]) as the checkpoint stores them, expert by
    expert, each projection in the format."""
    base, _, leaf = name.rpartition(".")  # model.layers.N.mlp.experts, gate_up_proj | down_proj
    out = {}
    for e in range(p.shape[0]):
        parts = dict(zip(("gate_proj", "up_proj"), p[e].chunk(2))) if leaf == "gate_up_proj" else {"down_proj": p[e]}
        for proj, w in parts.items():
            out.update({f"{base}.{e}.{proj}.{k}": v for k, v in fmt.write(w.contiguous()).items()})
    return out


def is_stacked_experts(name: str) -> bool:
    return name.rpartition(".")[2] in ("gate_up_proj", "down_proj") and ".experts." in name + "."


def write_checkpoint(model: torch.nn.Module, folder: pathlib.Path, fmt: Format, progress: bool = True) -> int:
    """model's weights as a `fmt` checkpoint in `folder` (config.json with its
    quantization_config, generation_config.json, shards + index). Returns the bytes written."""
    folder.mkdir(parents=True, exist_ok=True)
    params = dict(model.named_parameters())
    weight_map, total = {}, 0

    def save(tensors: dict[str, torch.Tensor], file: str) -> None:
        nonlocal total
        tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
        save_file(tensors, folder / file, metadata={"format": "pt"})
        weight_map.update({k: file for k in tensors})
        total += sum(t.numel() * t.element_size() for t in tensors.values())

    layers = len(model.model.layers)
    for i in tqdm(range(layers), desc=f"writing {fmt.label}", disable=not progress, leave=False):
        prefix = f"model.layers.{i}."
        tensors = {}
        for name, p in params.items():
            if not name.startswith(prefix):
                continue
            if is_quantized_linear(name):
                with torch.no_grad():
                    stored = fmt.write(p.detach())
                tensors.update({f"{name.removesuffix('.weight')}.{k}": v for k, v in stored.items()})
            elif is_stacked_experts(name):
                with torch.no_grad():
                    tensors.update(expert_tensors(name, p.detach(), fmt))
            else:
                tensors[name] = p.detach().to(torch.bfloat16)
        save(tensors, f"model-{i + 1:05d}-of-{layers + 1:05d}.safetensors")
    rest = {n: p.detach().to(torch.bfloat16) for n, p in params.items() if not n.startswith("model.layers.")}
    save(rest, f"model-{layers + 1:05d}-of-{layers + 1:05d}.safetensors")
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    config = copy.deepcopy(model.config)
    config.quantization_config = fmt.quantization_config
    config.dtype = torch.bfloat16
    config.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    return total
