"""ops.peer_all_reduce_add_rms_norm: the tensor-parallel all-reduce over peer memory fused with
the residual add + RMSNorm, against plain PyTorch.

On the CPU the ranks are threads of this process sharing plain buffers. On CUDA, one rank per GPU
in its own process with real CUDA IPC buffers (PeerAllReduce.connect; needs 2+ GPUs); on one GPU
only world size 1. Streams of one GPU cannot stand in for ranks: two streams may share a
hardware queue, and a rank's kernel that waits for a peer queued behind it waits forever (seen
on an H200: one such test hung until its timeout trapped)."""

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


def summed_in_rank_order(inputs: list[torch.Tensor]) -> torch.Tensor:
    """The ranks' partial sums added as the op adds them: fp32, rank 0 first, rounded once."""
    total = torch.zeros_like(inputs[0], dtype=torch.float32)
    for x in inputs:
        total = total + x.float()
    return total.to(inputs[0].dtype)


def run_ranks(ranks: list[PeerAllReduce], inputs, residuals, weight) -> None:
    """Every rank's call at once: one thread per rank (the CPU), or the one rank (CUDA)."""
    if inputs[0].is_cuda:
        assert len(ranks) == 1, "one GPU holds one rank (see the module's docstring)"
        ranks[0].add_rms_norm(inputs[0], residuals[0], weight, EPS)
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


RANKS_ON = [("cpu", 1), ("cpu", 2), ("cpu", 4), pytest.param("cuda", 1, marks=pytest.mark.cuda)]


@pytest.mark.parametrize("device, world_size", RANKS_ON)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
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
        summed = summed_in_rank_order(inputs)
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_nan_with_the_empty_markers_bits_is_sent_as_nan(dtype):
    """A slot element is ready when it stops holding the empty marker (every bit set, a NaN):
    a partial sum with exactly those bits must still arrive (as another NaN), not wait forever.
    (CUDA: test_ranks_on_several_gpus sends one too.)"""
    device = "cpu"
    ranks = PeerAllReduce.in_process(2, torch.device(device), data_bytes=4096, timeout_ms=5000)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    inputs = [torch.randn(2, 64, dtype=dtype, device=device) for _ in range(2)]
    inputs[1].view(bits)[0, 5] = -1  # all bits set
    residuals = [torch.zeros(2, 64, dtype=dtype, device=device) for _ in range(2)]
    weight = torch.ones(64, dtype=dtype, device=device)
    run_ranks(ranks, inputs, residuals, weight)
    for r in range(2):
        assert residuals[r][0, 5].isnan() and not residuals[r][1].isnan().any()


def _gpu_rank(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    """One rank of test_ranks_on_several_gpus: its own GPU, its CUDA IPC buffers, calls of several
    shapes and dtypes; saves what it got and what the unfused path gives on its GPU."""
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        device = torch.device("cuda", rank)
        peer = PeerAllReduce.connect(None, device)
        results = []
        for dtype in (torch.float32, torch.bfloat16):
            for rows, hidden in ((1, 4096), (3, 64), (40, 1000), (2, 3584)):
                generator = torch.Generator().manual_seed(rows * hidden)  # the same on every rank
                inputs = [torch.randn(rows, hidden, generator=generator).to(dtype) for _ in range(world_size)]
                residual = (torch.randn(rows, hidden, generator=generator) * 2).to(dtype)
                weight = (torch.rand(hidden, generator=generator) + 0.5).to(dtype)
                if rows == 3:  # a partial sum with the empty marker's bits (a NaN)
                    inputs[world_size - 1].view(torch.int16 if dtype == torch.bfloat16 else torch.int32)[1, 7] = -1
                inputs, residual, weight = [x.to(device) for x in inputs], residual.to(device), weight.to(device)
                out, res = inputs[rank].clone(), residual.clone()
                peer.add_rms_norm(out, res, weight, EPS)
                summed, unfused_residual = summed_in_rank_order(inputs), residual.clone()
                ops.fused_add_rms_norm(summed, unfused_residual, weight, EPS)
                results.append(dict(out=out.cpu(), res=res.cpu(), summed=summed.cpu(),
                                    unfused_residual=unfused_residual.cpu()))
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs 2 GPUs (device kinds nvidia-h100-x2 / nvidia-h200-x2)")
def test_ranks_on_several_gpus(tmp_path):
    """Up to 4 GPUs, one process each, real CUDA IPC buffers: every rank gets the unfused path's
    bits (the sum in rank order rounded, then fused_add_rms_norm), and all ranks the same."""
    import torch.multiprocessing as mp

    world = min(4, torch.cuda.device_count())
    mp.spawn(_gpu_rank, args=(world, str(tmp_path / "rendezvous"), str(tmp_path)), nprocs=world, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for case, first in enumerate(ranks[0]):
        for r, got in enumerate(ranks):
            got = got[case]
            assert torch.equal(got["out"].nan_to_num(), first["summed"].nan_to_num()), (case, r)
            assert torch.equal(got["res"].nan_to_num(), first["unfused_residual"].nan_to_num()), (case, r)
