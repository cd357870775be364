"""Timing shared by the benchmarks: CUDA events around CUDA-graph replays (so launch gaps do not
count), warm-up first, median of many repeats; on the CPU, perf_counter medians."""

from __future__ import annotations

import itertools
import statistics
import time
from typing import Callable, Sequence

import torch


def median_time_us(fn: Callable[[], object], device: str, repeats: int = 50, graph: bool = True,
                   calls_per_graph: int = 20) -> float:
    """Median microseconds of one call of fn. On CUDA, with graph=True, fn is captured
    calls_per_graph times back to back in one graph (it must be capturable: no host sync), and
    one replay is timed and divided: a graph of one short kernel would time the host's launch
    latency, not the kernel."""
    if device == "cpu":
        fn()
        samples = []
        for _ in range(max(5, repeats // 10)):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e6)
        return statistics.median(samples)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm-up: module load, handles, allocator
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    run, calls = fn, 1
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(calls_per_graph):
                fn()
        run, calls = g.replay, calls_per_graph
    run()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        run()
        end.record()
        end.synchronize()
        samples.append(begin.elapsed_time(end) * 1e3 / calls)
    return statistics.median(samples)


def copy_bandwidth_gbs(device: str, nbytes: int = 1 << 30) -> float:
    """Measured device-to-device copy bandwidth, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    us = median_time_us(lambda: dst.copy_(src), device, repeats=20, graph=False)
    return 2 * nbytes / (us * 1e-6) / 1e9


def copies_past_l2(nbytes: int, device: str) -> int:
    """How many copies of an input of nbytes to rotate among so that together they are > 4x the
    L2 cache: a call then reads its input from memory, as it would inside a model step (where
    the other layers' weights evict it), not from the L2 the previous repeat filled."""
    if device == "cpu":
        return 1
    l2 = torch.cuda.get_device_properties(torch.device(device)).L2_cache_size
    return max(1, -(-4 * l2 // nbytes))


def rotating(calls: Sequence[Callable[[], object]]) -> tuple[Callable[[], object], int]:
    """One callable that runs calls[0], calls[1], ... in turn (each reading its own copy of the
    inputs), and a calls_per_graph for median_time_us that is a multiple of len(calls), so every
    timed replay reads every copy equally often."""
    turn = itertools.cycle(calls)
    return (lambda: next(turn)()), len(calls) * max(1, 20 // len(calls))
