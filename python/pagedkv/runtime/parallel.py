"""Tensor parallelism over torch.distributed: the collectives a rank's forward and its engine
need. pagedkv.tensor_parallel (runtime/model.py) makes a model's shard; models/sharding.py splits
the weights.

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
Collectives go through torch.distributed (NCCL on CUDA, gloo on the CPU), inside CUDA graphs too,
except the decode step's all-reduces where peer memory serves (runtime/peer_all_reduce.py): there
one launch sums the ranks' partial sums and does the residual add + RMSNorm that follows.

A CUDA graph that captured NCCL calls must be destroyed before its process group: else
destroy_process_group (or the interpreter's exit) waits forever (pytorch/pytorch#115388).
destroy_process_group is wrapped, and an exit hook added, to drop such graphs first.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import weakref
import zlib
from typing import Any

import torch
import torch.distributed as dist

from pagedkv import ops
from pagedkv.runtime.peer_all_reduce import PeerAllReduce


@dataclasses.dataclass(frozen=True, slots=True)
class TensorParallel:
    """This rank's place in the tensor-parallel group and the device its shard lives on."""

    rank: int
    world_size: int
    device: torch.device
    group: dist.ProcessGroup | None = None  # None: the default group
    peer: PeerAllReduce | None = None  # decode-sized all-reduces over peer memory, where it serves

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place."""
        dist.all_reduce(x, group=self.group)
        return x

    def all_reduce_add_rms_norm(self, hidden: torch.Tensor, residual: torch.Tensor,
                                weight: torch.Tensor, epsilon: float) -> None:
        """In place: residual += hidden summed over the ranks; hidden = rms_norm(residual) * weight.
        Every rank takes the same path: the choice depends on shapes only."""
        if self.peer is not None and self.peer.fits(hidden):
            self.peer.add_rms_norm(hidden, residual, weight, epsilon)
        else:
            self.all_reduce_(hidden)
            ops.fused_add_rms_norm(hidden, residual, weight, epsilon)

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

    def check_same(self, what: str, values: list[int], who: str = "pagedkv.generate") -> None:
        """Raise ValueError on every rank unless all ranks passed the same `values` (a digest of
        one call's arguments): ranks that run different calls would wait on each other forever.
        who: the call, for the message."""
        mine = torch.tensor(values, dtype=torch.int64, device=self.device)
        every = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(every, mine, group=self.group)
        differ = [r for r, v in enumerate(every) if not torch.equal(v, every[0])]
        if differ:
            raise ValueError(f"{who}: rank(s) {differ} of the tensor-parallel group got "
                             f"other {what} than rank 0; every rank must make the same call")

    def broadcast_(self, x: torch.Tensor) -> torch.Tensor:
        """x from the group's first rank to all, in place (e.g. sampling seeds)."""
        src = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        dist.broadcast(x, src=src, group=self.group)
        return x


def call_digest(token_lists: list[list[int]], *others: Any) -> list[int]:
    """A few numbers that differ, but for a hash collision, between two calls given other token
    lists or other values (compared by repr): what TensorParallel.check_same compares."""
    return ([len(token_lists), sum(map(len, token_lists)), zlib.crc32(repr(token_lists).encode())]
            + [zlib.crc32(repr(other).encode()) for other in others])


_GRAPHS_WITH_COLLECTIVES: weakref.WeakSet = weakref.WeakSet()


def graphs_hold_collectives(graphs) -> None:
    """Register a runtime.graphs.CudaGraphs whose steps capture NCCL calls: they are dropped before
    any process group is destroyed, and at exit."""
    _wrap_destroy_process_group()
    _GRAPHS_WITH_COLLECTIVES.add(graphs)


def release_collective_graphs() -> None:
    """Drop every registered CUDA graph that captured collectives (a later step captures afresh
    while the process group lives)."""
    held = list(_GRAPHS_WITH_COLLECTIVES)
    if held and torch.cuda.is_initialized():
        try:
            torch.cuda.synchronize()  # no replay still running on a graph about to go
        except RuntimeError:  # a failed context (e.g. a trapped kernel): nothing runs any more
            pass
    for graphs in held:
        graphs.clear()


@functools.cache
def _wrap_destroy_process_group() -> None:
    original = dist.destroy_process_group

    @functools.wraps(original)
    def destroy_process_group(*args, **kwargs):
        release_collective_graphs()
        return original(*args, **kwargs)

    destroy_process_group.pagedkv_original = original
    dist.destroy_process_group = destroy_process_group
    dist.distributed_c10d.destroy_process_group = destroy_process_group
    # Exit handlers run last-registered first: this one before torch's own (registered at import).
    atexit.register(release_collective_graphs)
