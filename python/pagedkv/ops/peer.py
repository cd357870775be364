"""Tensor parallelism's all-reduce over peer buffers, fused with the residual add and RMSNorm."""

from __future__ import annotations

import torch

from pagedkv.ops._common import _ops


def peer_all_reduce_add_rms_norm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                 epsilon: float, buffer: torch.Tensor, peer_buffers: list[int],
                                 rank: int, timeout_ms: int) -> None:
    """In place, one launch: ``residual += sum over ranks of input`` (the sum rounded to the
    dtype), then ``input = rms_norm(residual)``. Every rank calls it with its partial sums;
    buffer: this rank's peer buffer (uint8; runtime/peer_all_reduce.py makes them);
    peer_buffers: every rank's buffer address as this rank sees it. A peer that does not come
    within timeout_ms fails the call (CUDA: the context) rather than wait forever."""
    _ops.peer_all_reduce_add_rms_norm(input, residual, weight, epsilon, buffer, peer_buffers, rank, timeout_ms)


@torch.library.register_fake("pagedkv::peer_all_reduce_add_rms_norm")
def _peer_all_reduce_add_rms_norm_fake(input, residual, weight, epsilon, buffer, peer_buffers, rank,
                                       timeout_ms) -> None:
    return None
