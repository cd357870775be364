"""Which rows of the engine's sampler hold which sequences' parameters.

A decode step of an unchanged batch (nothing admitted, finished or preempted since the last step)
samples the same sequences in the same order: the same temperatures, top-k, top-p and seeds, and
each row's RNG offset (its generated token count) one higher. Writing the five parameter rows
from Python lists costs ~100 us a step at 256 rows; moving the offsets on costs one add.

Requests with penalties, min_p, logprobs or stop strings (`special`, registered when queued)
also get their rows set in the sampler's RowProcessing, and `watched` names the rows whose
read-back does more (engine/watched.py). While no such request is live, a step does neither.
"""

from __future__ import annotations

from pagedkv.engine.request import Request, Sequence, Status
from pagedkv.runtime.row_processing import PenaltyRow, RowProcessing
from pagedkv.runtime.sampler import Sampler


def _offset(seq: Sequence) -> int:
    """A row's RNG offset: the tokens the sequence generated, a pending one (sampled in the step
    before, not read back yet) included."""
    return seq.num_output + seq.pending


class SamplingBatch:
    def __init__(self, sampler: Sampler, vocab_size: int, special: set[Request] | None = None,
                 processing: RowProcessing | None = None) -> None:
        self.sampler = sampler
        self.vocab_size = vocab_size
        self._seqs: list[Sequence] = []
        self._step = -2  # the engine step that last sampled
        self._first_offset = 0  # _seqs[0]'s offset then
        self.special: set[Request] = special or set()  # queued requests that may need rows processed
        self.processing = processing  # allocated on first use
        self.watched: list[tuple[Sequence, int]] = []  # (sequence, its logprob row or -1) of the rows

    def fresh(self) -> SamplingBatch:
        """A batch that reuses nothing of this one's rows (after a fault: they may never have run),
        with the same sampler, special requests and processing tensors (their slots forgotten)."""
        if self.processing is not None:
            self.processing.clear()
        self.sampler.processing = None
        return SamplingBatch(self.sampler, self.vocab_size, self.special, self.processing)

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
            if self.special or self.watched or self.sampler.processing is not None:
                self._special_rows(seqs)
            self._seqs = list(seqs)
        self._step = step
        self._first_offset = _offset(seqs[0])
        return self.sampler

    def _special_rows(self, seqs: list[Sequence]) -> None:
        """Set the processing of the special requests' rows (penalties, min_p on sampled rows,
        logprobs) and the watched rows, forgetting requests whose samples have all finished."""
        self.special = {r for r in self.special if any(s.status is not Status.FINISHED for s in r.sequences)}
        penalties, min_p, logprobs, watched = [], [], [], []
        for i, seq in enumerate(seqs):
            if seq.request not in self.special:
                continue
            p = seq.request.params
            if p.penalized:
                penalties.append(PenaltyRow(i, seq.seq_id, seq.token_ids, seq.prompt_len, seq.pending,
                                            p.repetition_penalty, p.presence_penalty, p.frequency_penalty))
            if p.min_p > 0 and p.temperature > 0:
                min_p.append((i, p.min_p, p.temperature))
            if p.logprobs is not None:
                watched.append((seq, len(logprobs)))
                logprobs.append((i, p.logprobs))
            elif p.stop:
                watched.append((seq, -1))
        self.watched = watched
        if not (penalties or min_p or logprobs):
            if self.processing is not None:
                self.processing.set_rows([], [], [])  # frees the slots
            self.sampler.processing = None
            return
        if self.processing is None:
            self.processing = RowProcessing(self.vocab_size, self.sampler.device)
        self.processing.set_rows(penalties, min_p, logprobs)
        self.sampler.processing = self.processing
