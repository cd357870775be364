"""An HF model as pagedkv runs it: its weights taken once (QKV and gate/up fused in place; one
rank's shard under tensor parallelism), its rotary table, where and in what dtype it runs.
Made on first use and kept on the HF model, so generate() and every pagedkv.LLM of one model
share one copy of the weights; each of them binds its own KV cache to it (runtime/runner.py).

    torch.distributed.init_process_group("nccl")           # e.g. under torchrun
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16)  # on the CPU
    pagedkv.tensor_parallel(model)                         # this rank's shard -> cuda:LOCAL_RANK
    out = pagedkv.generate(model, input_ids.to(f"cuda:{local_rank}"), max_new_tokens=64)
    llm = pagedkv.LLM(model, ...)                          # or serve many requests

Under tensor parallelism every rank makes the same calls with the same arguments and gets the
same tokens back. Megatron's split (models/sharding.py) costs each layer two all-reduces and no
other exchange; each rank's KV cache holds its own kv heads only; the LM head's logits are
all-gathered, so every rank samples the same token from the same logits. Collectives go
through torch.distributed (NCCL on CUDA, gloo on the CPU), inside CUDA graphs too.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from typing import Any

import torch
import torch.distributed as dist

from pagedkv.layers.rotary import build_cos_sin_cache
from pagedkv.models.llama import DecoderWeights, extract_weights
from pagedkv.models.registry import check_supported
from pagedkv.models.sharding import shard_weights
from pagedkv.runtime.parallel import TensorParallel

PREPARED_ATTR = "_pagedkv_model"  # the attribute of the HF model that holds its PreparedModel


@dataclasses.dataclass(eq=False)
class PreparedModel:
    weights: DecoderWeights
    cos_sin: torch.Tensor  # [max_positions, rot_dim] fp32, from the model's own rotary embedding
    device: torch.device  # where the forward runs (a shard's device may differ from the HF model's)
    dtype: torch.dtype
    max_positions: int
    tp: TensorParallel | None
    # generate()'s fixed-batch runner with its cache (runtime/fixed_batch.py), made on first call.
    fixed_batch: Any = None
    # generate() calls on one model from several threads run one at a time (they share the cache).
    lock: threading.RLock = dataclasses.field(default_factory=threading.RLock)

    @classmethod
    def of(cls, model, tp: TensorParallel | None = None) -> PreparedModel:
        check_supported(model)
        param = next(model.parameters())
        device = param.device if tp is None else tp.device
        weights = extract_weights(model)
        if tp is not None:
            weights = shard_weights(weights, tp.rank, tp.world_size, tp.device)
        max_positions = int(model.config.max_position_embeddings)
        cos_sin = build_cos_sin_cache(model.config, max_positions, device,
                                      rotary_emb=model.model.rotary_emb)
        return cls(weights, cos_sin, device, param.dtype, max_positions, tp)


_PREPARING = threading.Lock()  # two threads' first calls take a model's weights once


def prepared(model) -> PreparedModel:
    """The model's PreparedModel, made on first use and kept on the model."""
    state = getattr(model, PREPARED_ATTR, None)
    if state is None:
        with _PREPARING:
            state = getattr(model, PREPARED_ATTR, None)
            if state is None:
                state = PreparedModel.of(model)
                setattr(model, PREPARED_ATTR, state)
    return state


def device_of(model) -> torch.device:
    """Where pagedkv runs `model`: its prepared device (a tensor-parallel shard's may differ from
    the HF model's own), else the model's."""
    state = getattr(model, PREPARED_ATTR, None)
    return state.device if state is not None else next(model.parameters()).device


def _default_device(world_rank: int) -> torch.device:
    if not torch.cuda.is_available():
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", world_rank % torch.cuda.device_count()))
    return torch.device("cuda", local)


def tensor_parallel(model, group: dist.ProcessGroup | None = None,
                    device: torch.device | str | None = None):
    """Shard `model` over the ranks of `group` (default: the whole world) for pagedkv.generate
    and pagedkv.LLM.

    Every rank calls this, then generate() (input_ids on `device`) or an LLM's methods with the
    same arguments; every rank returns the same tokens. `model` may stay where it was loaded (the CPU, typically): this
    rank's shard is copied to `device` (default cuda:LOCAL_RANK, or the CPU without CUDA). Needs
    torch.distributed initialised. Returns the model."""
    check_supported(model)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("pagedkv.tensor_parallel: torch.distributed is not initialised; call "
                           "torch.distributed.init_process_group first (e.g. run under torchrun)")
    device = torch.device(device) if device is not None else _default_device(dist.get_rank())
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    backend = dist.get_backend(group)
    allowed = {"cuda": ("nccl",), "cpu": ("gloo",)}.get(device.type)
    if allowed is None or backend not in allowed:
        raise ValueError(f"pagedkv.tensor_parallel: device {device} with the {backend!r} backend is not "
                         "supported; allowed: a CUDA device with 'nccl', or the CPU with 'gloo'")
    if getattr(model, PREPARED_ATTR, None) is not None:
        raise ValueError("pagedkv.tensor_parallel: pagedkv already runs this model (a generate() "
                         "call, an LLM or an earlier tensor_parallel took its weights); shard a "
                         "freshly loaded model instead")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL binds each rank to the current device
    tp = TensorParallel(rank=dist.get_rank(group), world_size=dist.get_world_size(group),
                        device=device, group=group)
    setattr(model, PREPARED_ATTR, PreparedModel.of(model, tp))
    return model
