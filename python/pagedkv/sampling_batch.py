"""The per-row sampling parameters of a step's samples as tensors on the device, kept while the
same sequences sample step after step.

A decode step of an unchanged batch (nothing admitted, finished or preempted since the last step)
needs the same temperatures, top-k, top-p and seeds, and each row's RNG offset (its generated
token count) one higher. Building the five tensors from Python lists costs ~100 us a step at 256
rows; reusing them costs one add.
"""

from __future__ import annotations

import torch

from pagedkv.request import Sequence

# temperatures float32, top_k int32, top_p float32, seeds int64, offsets int64; [S] each
SamplingTensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class SamplingBatch:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._seqs: list[Sequence] = []
        self._step = -2  # the engine step that last asked
        self._tensors: SamplingTensors | None = None

    def repeats(self, seqs: list[Sequence], step: int) -> bool:
        """True when the step before (step: the engine's step number) sampled the very same
        sequences in the same order: nothing was admitted, finished, preempted or forked since.
        Each of them then got exactly one token since, and none is at its first sample."""
        return step == self._step + 1 and seqs == self._seqs  # Sequence compares by identity

    def tensors(self, seqs: list[Sequence], step: int, repeat: bool) -> SamplingTensors | None:
        """The parameters of seqs' rows (in order), or None when every row is greedy; repeat:
        what repeats(seqs, step) said (the rows' offsets are then one higher than last time)."""
        self._step = step
        if repeat:
            if self._tensors is not None:
                self._tensors[4].add_(1)  # stream-ordered after the last step's sampling read it
            return self._tensors
        self._seqs = list(seqs)
        params = [s.request.params for s in seqs]
        if all(p.greedy for p in params):
            self._tensors = None
            return None

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

        self._tensors = (tensor([p.temperature for p in params], torch.float32),
                         tensor([p.top_k for p in params], torch.int32),
                         tensor([p.top_p for p in params], torch.float32),
                         tensor([s.seed for s in seqs], torch.int64),
                         tensor([s.num_output for s in seqs], torch.int64))
        return self._tensors
