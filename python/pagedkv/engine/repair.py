"""The engine's state rebuilt after a call that an exception (a KeyboardInterrupt, a device fault)
stopped midway, when anything between the scheduler's lists, the sequences' counters, the cache's
reservations and the prefix cache may disagree.

Only what is certain is kept: the request table (a request is in it from the moment it is queued
until its finished output is returned), each sequence's tokens (a token is appended in one
step), and whether a sequence has finished (by its finish reason, or the finish rule applied to
its tokens). Everything else starts over: every sequence the cache holds is freed and its blocks
leave the prefix cache (their K/V may never have been written), and every unfinished sequence
waits to be recomputed from its tokens. Tokens sampled but not read back are sampled again, to
the same values: a token depends only on its logits, its request's seed and its position.
So is a token whose logprobs were not read (engine/watched.py's settle).
"""

from __future__ import annotations

from pagedkv.engine.request import Request, Sequence, Status
from pagedkv.engine.scheduler import Scheduler
from pagedkv.engine.watched import settle


def end_reason(seq: Sequence) -> str | None:
    """The finish rule of the read-back, applied to the tokens a sequence has: "stop" if its last
    generated token is a stop token, "length" at its request's max_len, else None."""
    request = seq.request
    if seq.num_output > 0 and seq.token_ids[-1] in request.stop_ids:
        return "stop"
    if len(seq.token_ids) >= request.max_len:
        return "length"
    return None


def rebuild(requests: dict[str, Request], scheduler: Scheduler, tokenizer=None) -> list[Request]:
    """Reset the scheduler to: nothing running, every unfinished sequence of `requests` waiting
    (in arrival order) with nothing computed. Returns the requests that have finished (their
    outputs are still to be returned). Safe to run again if it is itself interrupted."""
    waiting: list[Sequence] = []
    finished: list[Request] = []
    for request in list(requests.values()):
        seqs = request.sequences
        for seq in seqs:
            seq.pending, seq.pending_in_cache, seq.in_cache, seq.num_computed = 0, False, False, 0
            watched = settle(seq, tokenizer) if request.params.special else None
            reason = seq.finish_reason or watched or end_reason(seq)
            if reason is not None or seq.status is Status.FINISHED:
                seq.finish_reason, seq.status = reason, Status.FINISHED
            else:
                seq.status = Status.WAITING
                waiting.append(seq)
        # Samples still to fork from the first one (it forks them when it samples first).
        seqs[0].pending_forks = request.params.n - len(seqs)
        if request.finished:
            finished.append(request)
    scheduler.reset(waiting)
    return finished
