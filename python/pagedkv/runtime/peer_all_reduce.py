"""The all-reduce of a tensor-parallel decode step over peer memory, fused with the residual add
+ RMSNorm that follows it (ops.peer_all_reduce_add_rms_norm), and the buffers it runs on.

Why not NCCL for these: a decode step all-reduces a few KB per rank twice per layer, and NCCL
takes 15-20 us for each inside a CUDA graph (2 H200s, session 17), about what the layer's whole
weight read takes at TP=2. One-shot over NVLink: each rank copies its partial sums into its own
buffer, signals every peer, waits for their signals and sums every rank's copy, in one launch
that also adds the residual and normalises.

Each rank allocates one buffer (cudaMalloc, so it can be exported), sends its CUDA IPC handle to
the others and opens theirs. Used only where every rank is a GPU of this host that can address
every other one's memory; TensorParallel.all_reduce_add_rms_norm sends anything larger than the
buffer's data area (prefill chunks, big batches) through NCCL.
"""

from __future__ import annotations

import dataclasses
import datetime
import socket

import torch
import torch.distributed as dist

from pagedkv import ops
from pagedkv._ext import _C

# Largest message (one rank's rows x hidden, bytes) sent through peer memory; larger ones go
# through NCCL. One-shot moves world_size x the message into every rank; NCCL's ring moves about
# 2x, at higher latency: for decode-sized messages latency is what counts.
MAX_BYTES = 1 << 20
DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)  # NCCL's default for a collective


@dataclasses.dataclass(eq=False)
class PeerAllReduce:
    """One rank's view of the group's peer buffers."""

    rank: int
    buffers: list[torch.Tensor]  # every rank's buffer (uint8) as this rank addresses it
    data_bytes: int  # one data area's bytes: the largest message
    timeout_ms: int  # a peer missing this long fails the call instead of hanging
    addresses: list[int] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.addresses = [b.data_ptr() for b in self.buffers]

    @staticmethod
    def buffer_bytes(data_bytes: int) -> int:
        return _C.peer_buffer_header_bytes + 2 * data_bytes

    @classmethod
    def connect(cls, group: dist.ProcessGroup | None, device: torch.device,
                data_bytes: int = MAX_BYTES, timeout: datetime.timedelta = DEFAULT_TIMEOUT,
                ) -> PeerAllReduce | None:
        """This rank's buffers, or None on every rank unless every rank is a GPU of this host
        that can read every other rank's memory. A collective: every rank of `group` calls it."""
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        places: list = [None] * world
        dist.all_gather_object(places, (socket.gethostname(), device.index), group=group)
        host = places[rank][0]
        usable = all(h == host and (d == device.index or torch.cuda.can_device_access_peer(device, d))
                     for h, d in places)
        verdicts: list = [None] * world
        dist.all_gather_object(verdicts, usable, group=group)
        if not all(verdicts):
            return None
        nbytes = cls.buffer_bytes(data_bytes)
        own, handle = _C.peer_buffer(nbytes, device.index)
        handles: list = [None] * world
        dist.all_gather_object(handles, handle, group=group)
        buffers = [own if r == rank else _C.open_peer_buffer(h, nbytes, device.index)
                   for r, h in enumerate(handles)]
        return cls(rank, buffers, data_bytes, int(timeout.total_seconds() * 1000))

    @classmethod
    def in_process(cls, world_size: int, device: torch.device, data_bytes: int = MAX_BYTES,
                   timeout_ms: int = 60_000) -> list[PeerAllReduce]:
        """world_size ranks sharing plain buffers of one process (threads or streams stand in
        for the ranks): the op's tests, on the CPU and on one GPU."""
        nbytes = cls.buffer_bytes(data_bytes)
        buffers = [torch.zeros(nbytes, dtype=torch.uint8, device=device) for _ in range(world_size)]
        return [cls(r, buffers, data_bytes, timeout_ms) for r in range(world_size)]

    def fits(self, hidden: torch.Tensor) -> bool:
        """Whether `hidden` [..., D] can go through peer memory: decided from its shape and
        dtype only, so that every rank (same shapes) decides alike."""
        size = hidden.element_size()
        return hidden.numel() * size <= self.data_bytes and hidden.shape[-1] * size % 16 == 0

    def add_rms_norm(self, hidden: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     epsilon: float) -> None:
        """residual += hidden summed over the ranks; hidden = rms_norm(residual) * weight."""
        ops.peer_all_reduce_add_rms_norm(hidden, residual, weight, epsilon, self.buffers[self.rank],
                                         self.addresses, self.rank, self.timeout_ms)
