"""A step the engine has launched on the device and not read back yet.

The engine keeps the device busy by launching step N+1 before it reads step N's samples: N+1 is
scheduled with N's samplers `pending` (their token counts, its value is unknown on the host), and
its rows that feed those tokens read them on the device from N's sampler output. Reading N back
then waits only for N, while N+1 already runs.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from pagedkv.engine.request import Sequence, Status
from pagedkv.engine.sampling_batch import SamplingBatch
from pagedkv.engine.speculative_rows import VerifyRows
from pagedkv.runtime.runner import PendingTokens


@dataclasses.dataclass(slots=True, eq=False)
class LaunchedStep:
    samplers: list[Sequence]  # the sequences that sampled, in sample-row order
    repeat: bool  # the same samplers as the step before (SamplingBatch.repeats)
    samples: torch.Tensor | None = None  # [S] int64 on the device: the sampler's output
    host: torch.Tensor | None = None  # [S] int64 on the host (pinned on CUDA), valid once `copied`
    copied: torch.cuda.Event | None = None
    # Rows whose read-back does more (engine/watched.py): (sequence, its row of `logprobs`, or -1)
    watched: list[tuple[Sequence, int]] = dataclasses.field(default_factory=list)
    logprobs: torch.Tensor | None = None  # [W, 3 + 2k] float64 on the host, valid once `copied`
    verify: VerifyRows | None = None  # speculative decoding's verification rows (engine/speculation.py)

    @classmethod
    def sampled(cls, samplers: list[Sequence], repeat: bool, samples: torch.Tensor,
                batch: SamplingBatch, verify: VerifyRows | None = None) -> LaunchedStep:
        """Start the copy of samples [S] (and of the logprob table of the batch's sampler, if it
        made one) to the host, stream-ordered after the sampler; the samplers are pending until
        it is read."""
        for seq in samplers:
            seq.pending += 1
        watched = batch.watched
        table = batch.sampler.processing.step_logprobs if watched and batch.sampler.processing else None
        if samples.device.type != "cuda":
            return cls(samplers, repeat, samples, samples.clone(), None, watched,
                       None if table is None else table.clone(), verify)
        host = torch.empty(samples.shape, dtype=samples.dtype, pin_memory=True)
        host.copy_(samples, non_blocking=True)
        if table is not None:
            table = torch.empty(table.shape, dtype=table.dtype, pin_memory=True).copy_(table, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return cls(samplers, repeat, samples, host, copied, watched, table, verify)

    def read(self, abort: Callable[[str], None]) -> list[int]:
        """The samples, in sample-row order; waits for the device (only for this step). A -1
        (ops.sample: a sampled row's logits held NaN or inf) of a running sequence aborts its
        request with abort(request_id) and raises; read again, the others' samples are intact."""
        if self.verify is not None:
            self.verify.read(abort)
        if self.host is None:
            return []
        if self.copied is not None:
            self.copied.synchronize()
        tokens = self.host.tolist()
        if -1 in tokens:
            invalid = list(dict.fromkeys(seq.request.request_id for seq, t in zip(self.samplers, tokens)
                                         if t < 0 and seq.status is not Status.FINISHED))
            for request_id in invalid:
                abort(request_id)
            if invalid:
                raise RuntimeError(f"pagedkv.LLM: request(s) {invalid} have NaN or infinite logits, so "
                                   "sampling (temperature > 0) has no distribution to draw from (HF's "
                                   "generate raises too); they were aborted, the other requests go on")
        return tokens

    def read_logprobs(self) -> list[list[float]] | None:
        """The logprob table's rows (after read(), which waited for the copy)."""
        return None if self.logprobs is None else self.logprobs.tolist()

    def has_live_samples(self) -> bool:
        """Whether any sampler is still unfinished: if none, nothing needs reading back."""
        return any(s.status is not Status.FINISHED for s in self.samplers)


def pending_inputs(decodes: list[Sequence], before: LaunchedStep) -> PendingTokens | None:
    """Where the decode rows whose token `before` sampled find it on the device; None if no row's
    token is pending. The common case, the same sequences in the same order at the front, is a
    slice copy."""
    m = len(before.samplers)
    if m == 0:
        return None
    if decodes[:m] == before.samplers:  # Sequence compares by identity
        return PendingTokens(before.samples, m)
    row_of = {seq: i for i, seq in enumerate(before.samplers)}
    rows = [i for i, seq in enumerate(decodes) if seq.pending]
    if not rows:
        return None
    return PendingTokens(before.samples, len(rows), rows, [row_of[decodes[i]] for i in rows])
