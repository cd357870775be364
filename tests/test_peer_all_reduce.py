"""ops.peer_all_reduce_add_rms_norm: the tensor-parallel all-reduce over peer memory fused with
the residual add + RMSNorm, against plain PyTorch. Ranks are threads of this process on the CPU
and streams of one GPU on CUDA, sharing buffers the way GPUs of one host share them through CUDA
IPC (runtime/peer_all_reduce.py); several GPUs: tests/test_tensor_parallel.py's NCCL cases."""

from __future__ import annotations

import threading

import pytest
import torch

from conftest import DEVICES
from pagedkv import ops
from pagedkv.runtime.peer_all_reduce import PeerAllReduce
from tolerance import assert_close_to_baseline

EPS = 1e-6


def reference(inputs: list[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor):
    """HF's order of rounding: the summed product in the dtype, the residual add in the dtype,
    then LlamaRMSNorm. Returns (hidden, residual)."""
    dtype = residual.dtype
    summed = torch.stack([x.double() for x in inputs]).sum(0).to(dtype)
    new_residual = (summed.double() + residual.double()).to(dtype)
    h = new_residual.double()
    normed = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(dtype)
    return (weight.double() * normed.double()).to(dtype), new_residual


def run_ranks(ranks: list[PeerAllReduce], inputs, residuals, weight) -> None:
    """Every rank's call at once: threads on the CPU, one stream per rank on CUDA."""
    if inputs[0].is_cuda:
        streams = [torch.cuda.Stream() for _ in ranks]
        for rank, stream in zip(ranks, streams):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                rank.add_rms_norm(inputs[rank.rank], residuals[rank.rank], weight, EPS)
        for stream in streams:
            torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        return
    errors = []

    def call(rank):
        try:
            rank.add_rms_norm(inputs[rank.rank], residuals[rank.rank], weight, EPS)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=call, args=(rank,)) for rank in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("hidden", [64, 1000, 4096, 8192])
def test_sum_add_norm_on_every_rank(device, dtype, world_size, hidden):
    """Calls of several row counts one after another (blocks with and without rows, both data
    areas, epochs advancing): each rank gets the reference's result, and all ranks the same bits
    as the unfused path (the sum rounded, then ops.fused_add_rms_norm)."""
    if hidden * torch.finfo(dtype).bits // 8 % 16:
        pytest.skip("rows must be a multiple of 16 bytes")
    ranks = PeerAllReduce.in_process(world_size, torch.device(device), data_bytes=64 * 8192 * 4)
    weight = torch.rand(hidden, dtype=dtype, device=device) + 0.5
    for rows in (1, 3, 40, 2, 64):
        inputs = [torch.randn(rows, hidden, dtype=dtype, device=device) for _ in range(world_size)]
        residual = torch.randn(rows, hidden, dtype=dtype, device=device) * 2
        expected_hidden, expected_residual = reference(inputs, residual, weight)
        summed = torch.stack([x.float() for x in inputs]).sum(0).to(dtype)
        unfused_residual = residual.clone()
        ops.fused_add_rms_norm(summed, unfused_residual, weight, EPS)
        outs = [x.clone() for x in inputs]
        residuals = [residual.clone() for _ in range(world_size)]
        run_ranks(ranks, outs, residuals, weight)
        for r in range(world_size):
            assert torch.equal(residuals[r], unfused_residual), (rows, r)
            assert torch.equal(outs[r], summed), (rows, r)
        assert_close_to_baseline(outs[0], baseline=summed, reference=expected_hidden.double(), name="hidden")
        assert_close_to_baseline(residuals[0], baseline=unfused_residual, reference=expected_residual.double(),
                                 name="residual")


@pytest.mark.parametrize("device", DEVICES)
def test_messages_larger_than_the_data_area_are_refused(device):
    ranks = PeerAllReduce.in_process(1, torch.device(device), data_bytes=1024)
    x = torch.randn(5, 64, device=device)  # 1280 bytes
    assert not ranks[0].fits(x)
    with pytest.raises(RuntimeError, match="input holds 1280 bytes, more than the peer buffer's data area of 1024"):
        ranks[0].add_rms_norm(x, torch.randn_like(x), torch.ones(64, device=device), EPS)


def test_bad_arguments_are_named():
    ranks = PeerAllReduce.in_process(2, torch.device("cpu"), data_bytes=4096)
    x, w = torch.randn(2, 64), torch.ones(64)
    own = ranks[0].buffers[0]
    for addresses, rank, match in (
        ([own.data_ptr()] * 9, 0, "peer_buffers names 9 ranks; allowed: 1 to 8"),
        (ranks[0].addresses, 2, r"rank 2 is not in \[0, 2\)"),
        (ranks[0].addresses[::-1], 0, r"peer_buffers\[0\] must be this rank's own buffer's address"),
    ):
        with pytest.raises(RuntimeError, match=match):
            ops.peer_all_reduce_add_rms_norm(x, x.clone(), w, EPS, own, addresses, rank, 1000)
    with pytest.raises(RuntimeError, match="rows of a multiple of 16 bytes"):
        ops.peer_all_reduce_add_rms_norm(torch.randn(2, 6), torch.randn(2, 6), torch.ones(6), EPS, own,
                                         ranks[0].addresses, 0, 1000)


def test_a_missing_rank_is_an_error_not_a_hang():
    """Rank 1 never calls: rank 0 gives up after its timeout, naming the rank it waited for."""
    ranks = PeerAllReduce.in_process(2, torch.device("cpu"), data_bytes=4096, timeout_ms=50)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="all-reduce of rank 0 waited over 50 ms for rank 1: the "
                                           "tensor-parallel ranks are out of step"):
        ranks[0].add_rms_norm(x, torch.randn_like(x), torch.ones(64), EPS)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_nan_with_the_empty_markers_bits_is_sent_as_nan(device, dtype):
    """A slot element is ready when it stops holding the empty marker (every bit set, a NaN):
    a partial sum with exactly those bits must still arrive (as another NaN), not wait forever."""
    ranks = PeerAllReduce.in_process(2, torch.device(device), data_bytes=4096, timeout_ms=5000)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    inputs = [torch.randn(2, 64, dtype=dtype, device=device) for _ in range(2)]
    inputs[1].view(bits)[0, 5] = -1  # all bits set
    residuals = [torch.zeros(2, 64, dtype=dtype, device=device) for _ in range(2)]
    weight = torch.ones(64, dtype=dtype, device=device)
    run_ranks(ranks, inputs, residuals, weight)
    for r in range(2):
        assert residuals[r][0, 5].isnan() and not residuals[r][1].isnan().any()
