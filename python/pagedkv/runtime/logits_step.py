"""generate()'s processed decode step: each row feeds the token the host chose and the step
returns the forward's logits. HF's logits processors, stopping criteria and token selection run
on the host between steps (hf/processed_decode.py), so this step has no sampler: it is the fast
path's decode step (runtime/fixed_batch.py) less its sampling. The on-device advance (positions,
slots, context lengths) comes first, then the forward; on CUDA both replay as one CUDA graph per
(rows, max_blocks), captured once and kept with the runner like the fast path's graphs.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.profiler import record_function

from pagedkv.runtime.decode_state import DecodeState
from pagedkv.runtime.runner import ModelRunner, capture_step


@dataclasses.dataclass(frozen=True, slots=True)
class LogitsStepKey:
    """What a captured logits step bakes in besides its buffers."""

    rows: int
    max_blocks: int


class LogitsStep:
    """step(tokens [B]) -> logits [B, V] of the next position of each of the B rows (B <= rows;
    rows beyond B are a CUDA-graph bucket's padding, skipped by the kernels). The result may
    view a graph's output: read it before the next call."""

    def __init__(self, runner: ModelRunner, rows: int, max_blocks: int, block_size: int, graphs: bool):
        key = LogitsStepKey(rows, max_blocks)
        captured = runner.graphs.get(key) if graphs else None
        if captured is not None:
            self.state, self.fed, _ = captured.buffers
            self._run = captured.replay
            return
        device = runner.device
        state = DecodeState.allocate(rows, max_blocks, None, block_size, device,
                                     rope=runner.model.rope is not None)
        fed = torch.zeros(rows, dtype=torch.int64, device=device)  # [rows] the token each row feeds
        offsets = torch.zeros(rows, dtype=torch.int64, device=device)  # [rows] moved on; no sampler reads them

        def step() -> torch.Tensor:
            with record_function("decode_step"):
                state.advance(fed, offsets)
                return runner.decoder.forward(state.tokens, state.metadata())  # [rows, V]

        self.state, self.fed = state, fed
        # Captured while every row is padding (fresh state: context 0, slot -1), so the capture's
        # warm-up run writes nothing to the cache.
        # Every tensor the graph reads or writes stays with it: a freed `offsets` would be memory
        # of some later tensor that each replay's advance adds 1 to.
        # A fallback model's step that cannot be captured runs eagerly (capture_step).
        captured = capture_step(runner, key, step, buffers=(state, fed, offsets)) if graphs else None
        self._run = step if captured is None else captured.replay

    def start(self, prompt_lens: list[int], tables: list[list[int]], rope_base: int = 0) -> None:
        """Rows at their prompts' last tokens, with each row's blocks (generation's included);
        rope_base: a length-dependent rope's base S of the call (DecodeState.start)."""
        table_host = torch.zeros(len(tables), self.state.block_tables.shape[1], dtype=torch.int32)
        for r, table in enumerate(tables):
            table_host[r, :len(table)] = torch.tensor(table, dtype=torch.int32)
        self.state.start(torch.tensor(prompt_lens, dtype=torch.int32), table_host, rope_base)

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: [B] int64 on the model's device -> logits [B, V]."""
        n = tokens.shape[0]
        self.fed[:n].copy_(tokens)
        return self._run()[:n]
