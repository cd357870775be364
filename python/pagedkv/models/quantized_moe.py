"""A quantized checkpoint's mixture-of-experts layers (Qwen2-MoE, Qwen3-MoE, OLMoE, Mixtral) read
into MoEWeights: the router as stored (checkpoints leave it unquantized), each expert's gate, up
and down projections read through their format's reader and stacked over the experts as
layers/moe_quantized.py's Fp8Experts (FineGrainedFP8, compressed-tensors FP8) or Int4Experts (AWQ,
GPTQ, compressed-tensors W4A16). Checkpoints store the experts one by one under their family's
names:

    Qwen2-MoE, Qwen3-MoE, OLMoE   mlp.gate, mlp.experts.{e}.{gate,up,down}_proj
    Mixtral                       block_sparse_moe.gate, block_sparse_moe.experts.{e}.{w1,w3,w2}
                                  (w1 the gate, w3 the up, w2 the down projection)
"""

from __future__ import annotations

import dataclasses

import torch

from pagedkv.layers.moe import MoEWeights
from pagedkv.layers.moe_quantized import QuantizedExperts, pack_int4_experts, stack_fp8_experts
from pagedkv.quant.fp8 import Fp8Weight
from pagedkv.quant.int4 import Int4Weight

# model_type -> (the MoE block's name in a layer, the expert projections' names: gate, up, down)
EXPERT_NAMES = {"mixtral": ("block_sparse_moe", ("w1", "w3", "w2"))}
DEFAULT_NAMES = ("mlp", ("gate_proj", "up_proj", "down_proj"))


def read_moe(skeleton: MoEWeights, reader, layer: str, model_type: str, read_linear, device: torch.device,
             dtype: torch.dtype) -> MoEWeights:
    """The MoE weights of checkpoint layer `layer` ("model.layers.{i}") for the skeleton's MoEWeights
    (moe_weights() of the HF skeleton: its routing settings, its meta tensors' shapes). read_linear
    (prefix) -> the projection's quantized canonical form (models/quantized_checkpoint.py).
    Experts a checkpoint left unquantized (all of a layer's) are read dense, into the 3D layout of
    HF's experts. ValueError naming a missing or misshapen tensor, or a layer's experts that are
    quantized in part."""
    block, (gate_name, up_name, down_name) = EXPERT_NAMES.get(model_type, DEFAULT_NAMES)
    router_name = f"{layer}.{block}.gate.weight"
    if router_name not in reader.files:
        raise ValueError(f"pagedkv: the checkpoint has no {router_name!r} (the layer's router)")
    if reader.shape(router_name) != tuple(skeleton.router.shape):
        raise ValueError(f"pagedkv: tensor {router_name!r} in {reader.where(router_name)} has shape "
                         f"{list(reader.shape(router_name))}; the config makes it {list(skeleton.router.shape)}")
    router = reader.read(router_name).to(device=device, dtype=dtype).contiguous()
    num_experts, two_inter, hidden = skeleton.gate_up.shape
    inter = two_inter // 2

    def experts(name: str, shape: tuple[int, int]) -> QuantizedExperts | torch.Tensor:
        found = []
        for e in range(num_experts):
            prefix = f"{layer}.{block}.experts.{e}.{name}"
            w = read_linear(prefix)
            if not isinstance(w, (Fp8Weight, Int4Weight, torch.Tensor)):
                raise ValueError(f"pagedkv: {prefix} is stored as {type(w).__name__}; quantized experts are read "
                                 "in FP8 or int4 only (or left unquantized)")
            if isinstance(w, torch.Tensor) != isinstance(found[0] if found else w, torch.Tensor):
                raise ValueError(f"pagedkv: {prefix} is stored {'un' if isinstance(w, torch.Tensor) else ''}"
                                 f"quantized and expert 0's {name} is not: one layer's experts must be alike")
            stored = tuple((w if isinstance(w, torch.Tensor) else w.weight if isinstance(w, Fp8Weight) else w.q).shape)
            if stored != shape:
                raise ValueError(f"pagedkv: {prefix} holds a {list(stored)} weight; the config makes it {list(shape)}")
            found.append(w)
        what = f"{layer}.{block}.experts.*.{name}"
        if isinstance(found[0], torch.Tensor):  # left unquantized (e.g. bitsandbytes, which quantizes attention only)
            return torch.stack(found).to(device=device, dtype=dtype)  # [E, R, C]
        if isinstance(found[0], Fp8Weight):
            if len({w.block for w in found}) > 1:
                raise ValueError(f"pagedkv: {what} have scale blocks {sorted({w.block for w in found})}; one "
                                 "layer's must share one")
            stacked = stack_fp8_experts([w.weight for w in found], [w.scales for w in found], found[0].block, what)
        else:
            if len({w.group_size for w in found}) > 1:
                raise ValueError(f"pagedkv: {what} have group sizes {sorted({w.group_size for w in found})}; one "
                                 "layer's must share one")
            stacked = pack_int4_experts([w.q for w in found], [w.scales for w in found], [w.zeros for w in found],
                                        found[0].group_size, [w.perm for w in found], what)
        on_device = {f.name: getattr(stacked, f.name).to(device) for f in dataclasses.fields(stacked)
                     if isinstance(getattr(stacked, f.name), torch.Tensor)}
        return dataclasses.replace(stacked, **on_device)

    gate = experts(gate_name, (inter, hidden))
    up = experts(up_name, (inter, hidden))
    down = experts(down_name, (hidden, inter))
    dense = [isinstance(t, torch.Tensor) for t in (gate, up, down)]
    if any(dense) and not all(dense):
        raise ValueError(f"pagedkv: {layer}.{block}'s experts are quantized in some projections only; "
                         "supported: all three quantized, or none")
    if all(dense):  # HF's 3D layout: the dense experts' own kernels
        gate_up, down = torch.cat([gate, up], dim=1).contiguous(), down.contiguous()  # [E, 2I, D], [E, D, I]
    else:
        gate_up = (gate, up)
    shared_gate = None
    if skeleton.shared_gate is not None:  # Qwen2-MoE's sigmoid gate of its shared expert
        name = f"{layer}.{block}.shared_expert_gate.weight"
        if name not in reader.files:
            raise ValueError(f"pagedkv: the checkpoint has no {name!r} (the shared expert's gate)")
        shared_gate = reader.read(name).to(device=device, dtype=dtype).reshape(skeleton.shared_gate.shape).contiguous()
    return dataclasses.replace(skeleton, router=router, gate_up=gate_up, down=down, shared_gate=shared_gate)
