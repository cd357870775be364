"""Which rows of the engine's sampler hold which sequences' parameters.

A decode step of an unchanged batch (nothing admitted, finished or preempted since the last step)
samples the same sequences in the same order: the same temperatures, top-k, top-p and seeds, and
each row's RNG offset (its generated token count) one higher. Writing the five parameter rows
from Python lists costs ~100 us a step at 256 rows; moving the offsets on costs one add.
"""

from __future__ import annotations

from pagedkv.engine.request import Sequence
from pagedkv.runtime.sampler import Sampler


class SamplingBatch:
    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler
        self._seqs: list[Sequence] = []
        self._step = -2  # the engine step that last sampled

    def repeats(self, seqs: list[Sequence], step: int) -> bool:
        """True when the step before (step: the engine's step number) sampled the very same
        sequences in the same order: nothing was admitted, finished, preempted or forked since.
        Each of them then got exactly one token since, and none is at its first sample."""
        return step == self._step + 1 and seqs == self._seqs  # Sequence compares by identity

    def prepare(self, seqs: list[Sequence], step: int, repeat: bool) -> Sampler:
        """The sampler with seqs' parameters in its first rows (in order); repeat: what
        repeats(seqs, step) said. A row's RNG offset counts a pending token (sampled in the step
        before, not read back yet) as generated."""
        self._step = step
        if repeat:
            self.sampler.advance_offsets(len(seqs))  # stream-ordered after the last step's sampling
            return self.sampler
        self._seqs = list(seqs)
        params = [s.request.params for s in seqs]
        self.sampler.set_rows([p.temperature for p in params],
                              [p.top_k for p in params], [p.top_p for p in params],
                              [s.seed for s in seqs], [s.num_output + s.pending for s in seqs])
        return self.sampler
