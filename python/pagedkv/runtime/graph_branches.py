"""A data-dependent branch inside a replayed CUDA graph, picked on the device: no host sync.

Three graphs are captured with torch (head, if_true, if_false; their intermediates in the
runner's graph pool, kept alive here) and pagedkv._C.BranchedGraph (csrc/kernels/graph_branch.cu)
builds one graph of them: the head, a kernel that reads the bool flag the head wrote, and a
conditional IF/ELSE node (CUDA 12.8+) whose two bodies are the branches. torch's own
capture-to-conditional-node methods would do the same inside one capture, but the device's
torch (2.11) does not have them.

A prompt-lookup round (runtime/lookup_rounds.py) uses it: when no row found a proposal the round
runs one decode row per sequence instead of k + 1 rows. On the input-grounded prompts about a
fifth of the rounds find none (lab/measurements.md, session 30), and on a small model a 1-row
forward costs ~0.6x a k + 1-row one (the CUDA-core GEMV instead of the tensor-core one, fewer
attention and norm rows). Measured (H100, session 30): the average round time did not drop
measurably (1.30-1.35 ms branched, 1.30-1.34 unbranched, k 15); the saving on no-proposal
rounds seems to be eaten by the boundaries between the three graphs (no programmatic-dependent-
launch overlap across them). Whether it stays on is for a per-branch profile to decide.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedkv._ext import _C


def branches_supported() -> bool:
    """Whether graphs can branch here: a CUDA build of pagedkv and a torch that keeps a captured
    graph's cudaGraph_t (CUDAGraph(keep_graph=True).raw_cuda_graph())."""
    return (getattr(_C, "with_cuda", False) and hasattr(_C, "BranchedGraph")
            and hasattr(torch.cuda.CUDAGraph, "raw_cuda_graph"))


class BranchedGraph:
    """head(), then if_true() where flag (a bool CUDA scalar the head writes) is set, else
    if_false(), replayed as one graph launch."""

    def __init__(self, pool, head: Callable[[], None], if_true: Callable[[], None],
                 if_false: Callable[[], None], flag: torch.Tensor, capture) -> None:
        """capture(graph, pool, step): graphs.py's capture of step into graph. The warm-up (run
        by the caller) must have run all three steps."""
        self.graphs = []  # [head, if_true, if_false]: their pool memory lives as long as they do
        for step in (head, if_true, if_false):
            graph = torch.cuda.CUDAGraph(keep_graph=True)
            capture(graph, pool, step)
            self.graphs.append(graph)
        self.flag = flag
        self._launch = _C.BranchedGraph(*(g.raw_cuda_graph() for g in self.graphs), flag)

    def replay(self) -> None:
        self._launch.replay()
