"""Which rows of the engine's sampler hold which sequences' parameters.

A decode step of an unchanged batch (nothing admitted, finished or preempted since the last step)
samples the same sequences in the same order: the same temperatures, top-k, top-p and seeds, and
each row's RNG offset (its generated token count) one higher. Writing the five parameter rows
from Python lists costs ~100 us a step at 256 rows; moving the offsets on costs one add.
"""

from __future__ import annotations

from pagedkv.engine.request import Sequence
from pagedkv.runtime.sampler import Sampler


def _offset(seq: Sequence) -> int:
    """A row's RNG offset: the tokens the sequence generated, a pending one (sampled in the step
    before, not read back yet) included."""
    return seq.num_output + seq.pending


class SamplingBatch:
    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler
        self._seqs: list[Sequence] = []
        self._step = -2  # the engine step that last sampled
        self._first_offset = 0  # _seqs[0]'s offset then

    def repeats(self, seqs: list[Sequence], step: int) -> bool:
        """True when the step before (step: the engine's step number) sampled the very same
        sequences in the same order: nothing was admitted, finished, preempted or forked since,
        and that step did not fail after it wrote the rows (a failed step's samples never count:
        its sequences are recomputed with the offsets they had). Each of them then got exactly
        one token since, and none is at its first sample."""
        if not seqs or step != self._step + 1 or seqs != self._seqs:  # Sequence compares by identity
            return False
        # A step's samples become pending all together once it has sampled (LaunchedStep), so
        # the first row tells whether the step before got its tokens.
        return _offset(seqs[0]) == self._first_offset + 1

    def prepare(self, seqs: list[Sequence], step: int, repeat: bool) -> Sampler:
        """The sampler with seqs' parameters in its first rows (in order); repeat: what
        repeats(seqs, step) said."""
        if repeat:
            self.sampler.advance_offsets(len(seqs))  # stream-ordered after the last step's sampling
        else:
            self._seqs = []  # the rows are rewritten: nothing repeats them until that succeeded
            params = [s.request.params for s in seqs]
            self.sampler.set_rows([p.temperature for p in params],
                                  [p.top_k for p in params], [p.top_p for p in params],
                                  [s.seed for s in seqs], [_offset(s) for s in seqs])
            self._seqs = list(seqs)
        self._step = step
        self._first_offset = _offset(seqs[0])
        return self.sampler
