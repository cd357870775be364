"""The read-back of samples whose requests want more than the stop-id rule: stop strings (checked
on the output text, vLLM's rule) and logprobs (from the step's table, see
runtime/row_processing.py). The engine calls it only for steps that sampled such a request, so
the read-back of every other step is unchanged.

Each sequence records how many of its output tokens were read here (num_watched); its logprobs
list holds one entry per such token. A fault between a token's append and this read leaves the
token unread: engine/repair.py then drops it (logprobs: it is sampled again, to the same value)
or applies the stop rule to the whole text (stop strings).
"""

from __future__ import annotations

from pagedkv.engine.outputs import Logprob
from pagedkv.engine.request import Request, Sequence, Status
from pagedkv.engine.scheduler import Scheduler

# Tokens decoded past a stop string's length: margin for tokens that decode to no character
# (a UTF-8 sequence cut between tokens).
STOP_MARGIN = 8


def stop_in_tail(seq: Sequence, tokenizer) -> bool:
    """Whether the output's text ends with a stop string in its last tokens: those that can hold
    one (a stop string of c characters spans at most c tokens that decode to something)."""
    params = seq.request.params
    start = max(seq.prompt_len, len(seq.token_ids) - max(map(len, params.stop)) - STOP_MARGIN)
    tail = tokenizer.decode(seq.token_ids[start:], skip_special_tokens=params.skip_special_tokens)
    return any(stop in tail for stop in params.stop)


def stop_in_text(seq: Sequence, tokenizer) -> bool:
    """Whether a stop string is anywhere in the output's text (the repair's check)."""
    params = seq.request.params
    text = tokenizer.decode(seq.output_ids, skip_special_tokens=params.skip_special_tokens)
    return any(stop in text for stop in params.stop)


def logprob_entry(row: list[float], k: int, tokenizer) -> dict[int, Logprob]:
    """One output token's logprobs from its row of the step's table (token, its logprob, its
    rank, K top ids, K top logprobs): the sampled token first, then the k most likely."""
    width = (len(row) - 3) // 2

    def text(token: int) -> str | None:
        return None if tokenizer is None else tokenizer.decode([token])

    token = int(row[0])
    entry = {token: Logprob(row[1], int(row[2]), text(token))}
    for j in range(k):
        top = int(row[3 + j])
        if top not in entry:
            entry[top] = Logprob(row[3 + width + j], j + 1, text(top))
    return entry


def read_watched(watched: list[tuple[Sequence, int]], table: list[list[float]] | None,
                 scheduler: Scheduler, finished: list[Request], tokenizer) -> None:
    """After a step's tokens were appended: the logprobs of each watched sequence's new token
    (row lp_row of table; -1: none asked) and its stop-string check. A sequence whose text now
    holds a stop string finishes with "stop" (also one the token limit finished just now)."""
    for seq, lp_row in watched:
        if seq.num_output <= seq.num_watched:  # its sample was dropped: it had finished before
            continue
        seq.num_watched = seq.num_output
        params = seq.request.params
        if lp_row >= 0:
            if seq.logprobs is None:
                seq.logprobs = []
            seq.logprobs.append(logprob_entry(table[lp_row], params.logprobs, tokenizer))
        if params.stop and seq.finish_reason != "stop" and stop_in_tail(seq, tokenizer):
            if seq.status is Status.FINISHED:  # at its token limit in this very read
                seq.finish_reason = "stop"
            else:
                scheduler.finish(seq, "stop")
                if seq.request.finished:
                    finished.append(seq.request)


def settle(seq: Sequence, tokenizer) -> str | None:
    """For the repair: drop an output token whose logprobs were never read (it is sampled again),
    and "stop" if a token never checked completed a stop string. Returns that reason or None."""
    params = seq.request.params
    reason = None
    if params.logprobs is not None:
        keep = seq.prompt_len + len(seq.logprobs or ())
        if len(seq.token_ids) > keep:
            del seq.token_ids[keep:]
            seq.finish_reason, seq.status = None, Status.WAITING
    elif params.stop and seq.num_output > seq.num_watched and stop_in_text(seq, tokenizer):
        reason = "stop"
    seq.num_watched = seq.num_output
    return reason
