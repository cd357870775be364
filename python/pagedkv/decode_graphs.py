"""CUDA graphs of the engine's decode-only steps, one per batch bucket.

A captured step reads its inputs from static tensors: the token ids (copied in before each
replay) and the cache's step-metadata views, whose addresses are fixed for a bucket (they alias
one device buffer that build_metadata rewrites). The graph runs the forward only; the logits
[bucket, V] are left in a static tensor and sampled outside (per-request parameters vary).
"""

from __future__ import annotations

import torch
from torch.profiler import record_function

from pagedkv.models.llama import ForwardMetadata, PagedDecoder
from pagedkv.step_metadata import StepMetadata


class DecodeGraphs:
    def __init__(self, decoder: PagedDecoder, device: torch.device):
        self.decoder = decoder
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        # bucket -> (graph, ids [bucket] int64, logits [bucket, V])
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}

    def run(self, meta: StepMetadata, token_ids: torch.Tensor) -> torch.Tensor:
        """Logits [meta.num_tokens, V] of a decode-only step (one token per row, padded rows
        included) whose metadata was just built; token_ids: [num_tokens] int64 (CPU or device)."""
        bucket = meta.num_tokens
        entry = self._graphs.get(bucket)
        if entry is None:
            entry = self._graphs[bucket] = self._capture(meta)
        graph, ids, logits = entry
        ids.copy_(token_ids, non_blocking=True)
        with record_function("decode_step"):  # the label captured inside the graph is not replayed
            graph.replay()
        return logits

    def _capture(self, meta: StepMetadata):
        ids = torch.zeros(meta.num_tokens, dtype=torch.int64, device=self.device)
        fmeta = ForwardMetadata(positions=meta.positions, slot_mapping=meta.slot_mapping,
                                block_tables=meta.block_tables, context_lens=meta.context_lens)
        # Warm-up outside capture (lazy inits, cuBLAS handles). It writes this step's K/V with
        # token 0; the replay right after rewrites the same slots with the real tokens.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.decoder.forward(ids, fmeta)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.decoder.forward(ids, fmeta)
        return graph, ids, logits
