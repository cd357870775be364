"""Tensor parallelism over torch.distributed: each rank runs its slice of every layer.

    torch.distributed.init_process_group("nccl")           # e.g. under torchrun
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16)  # on the CPU
    pagedkv.tensor_parallel(model)                         # this rank's shard -> cuda:LOCAL_RANK
    out = pagedkv.generate(model, input_ids.to(f"cuda:{local_rank}"), max_new_tokens=64)
    llm = pagedkv.LLM(model, ...)                          # or serve many requests

Every rank makes the same calls with the same arguments and gets the same tokens back.

Megatron's split of a Llama-family layer, so each layer costs two all-reduces and no other
exchange: QKV and gate/up are split by output rows (each rank owns Hq/n query heads, Hkv/n kv
heads and I/n of the MLP), O and down by input columns (each rank's partial sum, all-reduced).
The KV cache of a rank holds its own kv heads only. The LM head is split by vocabulary rows and
its logits all-gathered, so every rank samples the same token from the same logits.
Collectives go through torch.distributed (NCCL on CUDA, gloo on the CPU), inside CUDA graphs too.
"""

from __future__ import annotations

import dataclasses
import math
import os

import torch
import torch.distributed as dist

from pagedkv.models.llama import DecoderWeights, LayerWeights
from pagedkv.support import UnsupportedModel, check_supported


@dataclasses.dataclass(frozen=True, slots=True)
class TensorParallel:
    """This rank's place in the tensor-parallel group and the device its shard lives on."""

    rank: int
    world_size: int
    device: torch.device
    group: dist.ProcessGroup | None = None  # None: the default group

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place."""
        dist.all_reduce(x, group=self.group)
        return x

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Every rank's logits [R, Vs] of its vocabulary rows -> all logits [R, vocab_size]."""
        rows, shard = logits.shape
        gathered = logits.new_empty((self.world_size * rows, shard))  # [n * R, Vs], rank-major
        dist.all_gather_into_tensor(gathered, logits.contiguous(), group=self.group)
        full = gathered.view(self.world_size, rows, shard).transpose(0, 1).reshape(rows, -1)
        return full[:, :vocab_size].contiguous()

    def all_true(self, flag: bool) -> bool:
        """True on every rank when `flag` is true on every rank (so all ranks raise together)."""
        return bool(self.min_over_ranks(int(flag)))

    def min_over_ranks(self, value: int) -> int:
        """The smallest of the ranks' `value`s, on every rank."""
        x = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(x, op=dist.ReduceOp.MIN, group=self.group)
        return int(x.item())

    def check_same(self, what: str, values: list[int]) -> None:
        """Raise ValueError on every rank unless all ranks passed the same `values` (a digest of
        one call's arguments): ranks that run different calls would wait on each other forever."""
        mine = torch.tensor(values, dtype=torch.int64, device=self.device)
        every = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(every, mine, group=self.group)
        differ = [r for r, v in enumerate(every) if not torch.equal(v, every[0])]
        if differ:
            raise ValueError(f"pagedkv.generate: rank(s) {differ} of the tensor-parallel group got "
                             f"other {what} than rank 0; every rank must make the same call")

    def broadcast_(self, x: torch.Tensor) -> torch.Tensor:
        """x from the group's first rank to all, in place (e.g. sampling seeds)."""
        src = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        dist.broadcast(x, src=src, group=self.group)
        return x


def _rows(t: torch.Tensor | None, start: int, count: int) -> torch.Tensor | None:
    return None if t is None else t[start:start + count]


def shard_weights(w: DecoderWeights, rank: int, world_size: int, device: torch.device) -> DecoderWeights:
    """Rank `rank` of `world_size`'s slice of the model's weights, copied to `device`. Raises
    UnsupportedModel naming the size that does not split evenly."""
    n, hd = world_size, w.head_dim
    inter = w.layers[0].down.shape[1]
    for what, size in (("num_attention_heads", w.num_heads), ("num_key_value_heads", w.num_kv_heads),
                       ("intermediate_size", inter)):
        if size % n:
            raise UnsupportedModel(f"pagedkv.tensor_parallel: {what} = {size} does not split over "
                                   f"{n} ranks; the world size must divide it (and the other "
                                   f"head and MLP sizes: heads {w.num_heads}/{w.num_kv_heads}, "
                                   f"intermediate {inter})")
    hq, hkv, i_rank = w.num_heads // n, w.num_kv_heads // n, inter // n
    q_size, kv_size = w.num_heads * hd, w.num_kv_heads * hd

    def to_device(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device).contiguous()

    def qkv_rows(t: torch.Tensor | None) -> torch.Tensor | None:
        """This rank's query heads, then its kv heads' K rows and V rows (QKV weight or bias)."""
        if t is None:
            return None
        return torch.cat([_rows(t, rank * hq * hd, hq * hd),
                          _rows(t, q_size + rank * hkv * hd, hkv * hd),
                          _rows(t, q_size + kv_size + rank * hkv * hd, hkv * hd)])

    layers = []
    for layer in w.layers:
        gate_up = torch.cat([_rows(layer.gate_up, rank * i_rank, i_rank),
                             _rows(layer.gate_up, inter + rank * i_rank, i_rank)])
        layers.append(LayerWeights(
            input_norm=to_device(layer.input_norm),
            qkv=to_device(qkv_rows(layer.qkv)), qkv_bias=to_device(qkv_rows(layer.qkv_bias)),
            q_norm=to_device(layer.q_norm), k_norm=to_device(layer.k_norm),
            o=to_device(layer.o[:, rank * hq * hd:(rank + 1) * hq * hd]),
            # The all-reduce sums the ranks' partial O products: the bias joins one of them.
            o_bias=to_device(layer.o_bias) if rank == 0 else None,
            post_norm=to_device(layer.post_norm),
            gate_up=to_device(gate_up),
            down=to_device(layer.down[:, rank * i_rank:(rank + 1) * i_rank]),
        ))
    # Vocabulary rows in equal shards (all_gather needs equal sizes): the last is zero-padded.
    shard = math.ceil(w.vocab_size / n)
    lm_head = w.lm_head.new_zeros((shard, w.lm_head.shape[1]))
    mine = _rows(w.lm_head, rank * shard, shard)
    lm_head[:mine.shape[0]] = mine
    return dataclasses.replace(
        w, embed=to_device(w.embed), layers=layers, final_norm=to_device(w.final_norm),
        lm_head=to_device(lm_head), num_heads=hq, num_kv_heads=hkv)


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
    from pagedkv.runner import ModelRunner  # the runner imports this module's TensorParallel

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
    if getattr(model, "_pagedkv_runner", None) is not None:
        raise ValueError("pagedkv.tensor_parallel: pagedkv already runs this model (a generate() "
                         "call or an earlier tensor_parallel made its runner); shard a freshly "
                         "loaded model instead")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL binds each rank to the current device
    tp = TensorParallel(rank=dist.get_rank(group), world_size=dist.get_world_size(group),
                        device=device, group=group)
    model._pagedkv_runner = ModelRunner(model, tp=tp)
    return model
