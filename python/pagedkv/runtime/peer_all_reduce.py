"""The all-reduce of a tensor-parallel decode step over peer memory, fused with the residual add
+ RMSNorm that follows it (ops.peer_all_reduce_add_rms_norm), and the buffers it runs on.

Why not NCCL for these: a decode step all-reduces a few KB per rank twice per layer; NCCL and
the norm after it take ~9 us inside a CUDA graph (2 H200s), 0.5 ms of a 2.7 ms TP=2 step of W1.
Here each rank writes its partial sums straight into every peer's buffer and reads the others'
from its own as they arrive (the data is its own signal: no flag, no fence), in one launch that
also adds the residual and normalises.

Each rank allocates one buffer (cudaMalloc, so it can be exported), sends its CUDA IPC handle to
the others and opens theirs. Used only where every rank is a GPU of this host that can address
every other one's memory; TensorParallel.all_reduce_add_rms_norm sends anything larger than the
buffer's slot (prefill chunks, big batches) through NCCL.
"""

from __future__ import annotations

import dataclasses
import datetime
import socket

import torch
import torch.distributed as dist

from pagedkv import ops
from pagedkv._ext import _C

# The largest message (one rank's rows x hidden, bytes) sent through peer memory is this over the
# world size; larger ones go through NCCL. Each rank writes world_size - 1 copies of its message,
# while NCCL's ring moves about 2x at higher latency: on 4 H200s (lab/tp_exit_probe.py, latency
# case) peer memory was 5.3 us against NCCL's 11.7 at 8 KB and level at 1 MB (21.5 / 20.3 us);
# on 2, 10.9 against 16.1 us at 1 MB.
MAX_BYTES_OVER_RANKS = 2 << 20
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
    def buffer_bytes(data_bytes: int, world_size: int) -> int:
        """[epochs | slots of two epochs x world_size ranks] (kernels/peer_buffer_layout.h)."""
        return _C.peer_buffer_header_bytes + 2 * world_size * data_bytes

    @classmethod
    def connect(cls, group: dist.ProcessGroup | None, device: torch.device,
                data_bytes: int | None = None, timeout: datetime.timedelta = DEFAULT_TIMEOUT,
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
        data_bytes = data_bytes or MAX_BYTES_OVER_RANKS // world
        nbytes = cls.buffer_bytes(data_bytes, world)
        own, handle = _C.peer_buffer(nbytes, device.index)
        handles: list = [None] * world
        dist.all_gather_object(handles, handle, group=group)
        buffers = [own if r == rank else _C.open_peer_buffer(h, nbytes, device.index)
                   for r, h in enumerate(handles)]
        return cls(rank, buffers, data_bytes, int(timeout.total_seconds() * 1000))

    @classmethod
    def in_process(cls, world_size: int, device: torch.device, data_bytes: int = 1 << 20,
                   timeout_ms: int = 60_000) -> list[PeerAllReduce]:
        """world_size ranks sharing plain buffers of one process (threads or streams stand in
        for the ranks): the op's tests, on the CPU and on one GPU."""
        nbytes = cls.buffer_bytes(data_bytes, world_size)
        buffers = [torch.full((nbytes,), 0xFF, dtype=torch.uint8, device=device) for _ in range(world_size)]
        for b in buffers:
            b[:_C.peer_buffer_header_bytes] = 0  # epochs; the slots start empty (every byte 0xff)
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
