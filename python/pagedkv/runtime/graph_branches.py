"""A data-dependent branch inside a captured CUDA graph: two conditional IF nodes (CUDA 12.4+),
captured through torch.cuda.CUDAGraph's capture-to-node methods, so that a replayed graph runs
only the branch a device-side flag picks, with no host sync.

A prompt-lookup round (runtime/lookup_rounds.py) uses it: when no row found a proposal the round
runs one decode row per sequence instead of k + 1 rows. On input-grounded prompts about a fifth
of the rounds find none (lab/measurements.md, session 30), and on a small model a 1-row forward
costs ~0.6x a k + 1-row one (the CUDA-core GEMV path instead of the tensor-core one, fewer
attention and norm rows).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_METHODS = ("get_currently_capturing_graph", "begin_capture_to_if_node", "end_capture_to_conditional_node")


def branches_supported() -> bool:
    """Whether this torch can capture conditional nodes (torch.cuda.CUDAGraph's methods)."""
    return all(hasattr(torch.cuda.CUDAGraph, name) for name in _METHODS)


def run_branches(flag: torch.Tensor, if_true: Callable[[], None], if_false: Callable[[], None]) -> None:
    """On a stream being captured: IF(flag) if_true, IF(not flag) if_false, each captured into
    its own conditional node (flag: a bool CUDA scalar, read when the graph is replayed). The
    branches communicate only through buffers they write in place (a node has no outputs).
    Not capturing (the warm-up run before a capture): both run, one after the other, so that
    each branch's kernels, workspaces and allocations have run once before they are captured;
    the caller makes them harmless then (runtime/lookup_rounds.py captures with every row done)."""
    if not (flag.is_cuda and torch.cuda.is_current_stream_capturing()):
        if_true()
        if_false()
        return
    graph = torch.cuda.CUDAGraph.get_currently_capturing_graph()
    for condition, branch in ((flag, if_true), (torch.logical_not(flag), if_false)):
        graph.begin_capture_to_if_node(condition)
        try:
            branch()
        finally:
            graph.end_capture_to_conditional_node()
