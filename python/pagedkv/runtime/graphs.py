"""The one place pagedkv captures CUDA graphs.

A captured step reads and writes only tensors that outlive it: its inputs (token ids, metadata,
sampler parameters) are static buffers the host rewrites before each replay, and its outputs
(logits, sampled tokens) stay where the capture left them until the next replay. A step is run
once outside capture first, on a side stream (lazy initialisations and cuBLAS workspaces must
not happen inside a capture), then captured; later uses replay it. All graphs of one runner share
one memory pool: they replay one at a time on one stream, so their intermediates may overlap.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Hashable

import torch
from torch.profiler import record_function


@dataclasses.dataclass(slots=True)
class CapturedStep:
    graph: torch.cuda.CUDAGraph
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
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = step()
        captured = self._steps[key] = CapturedStep(graph, outputs, buffers, self.label)
        return captured

    def clear(self) -> None:
        self._steps.clear()

    def __len__(self) -> int:
        return len(self._steps)
