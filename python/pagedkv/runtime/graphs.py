"""The one place pagedkv captures CUDA graphs.

A captured step reads and writes only tensors that outlive it: its inputs (token ids, metadata,
sampler parameters) are static buffers the host rewrites before each replay, and its outputs
(logits, sampled tokens) stay where the capture left them until the next replay. A step is run
once outside capture first, on a side stream (lazy initialisations and cuBLAS workspaces must
not happen inside a capture), then captured; later uses replay it. All graphs of one runner share
one memory pool: they replay one at a time on one stream, so their intermediates may overlap.

A capture must not be broken by what else runs meanwhile: Python's cyclic garbage collector is
off during it (collecting an unreachable engine would destroy its graphs, and destroying a graph
while a stream captures invalidates the capture and every later CUDA call of the process), and
the capture is thread-local (another thread's CUDA calls, e.g. another engine's, are allowed).
An exception inside the capture (a KeyboardInterrupt included) ends it, and the step is captured
afresh next time.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
from typing import Any, Callable, Hashable

import torch
from torch.profiler import record_function

from pagedkv.runtime.graph_branches import BranchedGraph

logger = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class CapturedStep:
    graph: torch.cuda.CUDAGraph | BranchedGraph
    outputs: Any  # what the step returned during capture: the tensors each replay rewrites
    buffers: Any  # what the caller keeps with the graph (its static inputs)
    label: str

    def replay(self) -> Any:
        with record_function(self.label):  # the labels recorded inside a capture are not replayed
            self.graph.replay()
        return self.outputs


class CudaGraphs:
    def __init__(self, label: str = "decode_step") -> None:
        self.label = label
        self.pool = torch.cuda.graph_pool_handle()
        self._steps: dict[Hashable, CapturedStep] = {}

    def get(self, key: Hashable) -> CapturedStep | None:
        return self._steps.get(key)

    def capture(self, key: Hashable, step: Callable[[], Any], buffers: Any = None) -> CapturedStep:
        """Warm `step` up outside capture, capture it under `key`, and return it (not replayed:
        the capture itself runs nothing, so the caller replays it for the step at hand)."""
        home = _warmed_up(step)
        graph = torch.cuda.CUDAGraph()
        reserved = torch.cuda.memory_reserved()  # what the graphs' pool grows by (no sync)
        outputs = _captured(graph, self.pool, step, home)
        captured = self._steps[key] = CapturedStep(graph, outputs, buffers, self.label)
        logger.info("captured CUDA graph %s for %r (%d held); memory reserved grew by %.1f MB",
                    self.label, key, len(self._steps), (torch.cuda.memory_reserved() - reserved) / 1e6)
        return captured

    def capture_branched(self, key: Hashable, head: Callable[[], None], if_true: Callable[[], None],
                         if_false: Callable[[], None], flag: torch.Tensor) -> CapturedStep:
        """As capture(), for a step of head(), then if_true() or if_false() as the bool CUDA
        scalar `flag` (written by head) says, picked on the device (runtime/graph_branches.py).
        The warm-up runs all three, so each must be harmless then whatever the flag."""
        home = _warmed_up(head, if_true, if_false)
        reserved = torch.cuda.memory_reserved()
        graph = BranchedGraph(self.pool, head, if_true, if_false, flag,
                              lambda g, pool, step: _captured(g, pool, step, home))
        captured = self._steps[key] = CapturedStep(graph, None, None, self.label)
        logger.info("captured branched CUDA graph %s for %r (%d held); memory reserved grew by %.1f MB",
                    self.label, key, len(self._steps), (torch.cuda.memory_reserved() - reserved) / 1e6)
        return captured

    def clear(self) -> None:
        self._steps.clear()

    def __len__(self) -> int:
        return len(self._steps)


def _warmed_up(*steps: Callable[[], Any]) -> torch.cuda.Stream:
    """Runs steps once, in order, on a side stream ordered after the current one (lazy
    initialisations and cuBLAS workspaces happen outside any capture); returns the current
    ("home") stream, which waits for them."""
    home = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(home)
    try:
        torch.cuda.set_stream(side)
        for step in steps:
            step()
    finally:
        torch.cuda.set_stream(home)
    home.wait_stream(side)
    return home


def _captured(graph: torch.cuda.CUDAGraph, pool, step: Callable[[], Any], home: torch.cuda.Stream) -> Any:
    """step()'s outputs, captured into `graph`. If anything interrupts the capture, the capture is
    ended and `home` made current again before the exception goes on: a `with` statement does
    not guarantee it (an exception raised as the block ends, e.g. a KeyboardInterrupt arriving
    then, skips __exit__), and a stream left capturing fails every later CUDA call."""
    capture = torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local")
    collecting = gc.isenabled()
    try:
        gc.disable()
        with capture:
            return step()
    except BaseException:
        if torch.cuda.is_current_stream_capturing():
            try:
                capture.__exit__(None, None, None)  # ends the capture; its graph is dropped
            except Exception:  # noqa: BLE001 - an invalid capture still ends; the first error goes on
                pass
        if torch.cuda.current_stream() != home:
            torch.cuda.set_stream(home)
        raise
    finally:
        if collecting:
            gc.enable()
