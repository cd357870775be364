"""The RequestOutputs of one step: finished requests (generate's mode) or every request that got a
token (stream's mode), and their delivery, the moment a finished request leaves the engine's table."""

from __future__ import annotations

import collections
import itertools

from pagedkv.engine.outputs import CompletionOutput, RequestOutput, request_output
from pagedkv.engine.request import Request, Sequence


def finish_output(request: Request, now: float, tokenizer) -> RequestOutput:
    if request.metrics.finished_time is None:
        request.metrics.finished_time = now
    return request_output(request, True, tokenizer)


def step_outputs(got: list[Sequence], finished: list[Request], partial: bool, now: float,
                 tokenizer) -> list[RequestOutput]:
    """An output per finished request not yet reported (finished: those, in the order they
    finished) and, if partial, per running request that got a token (got: its samples that did),
    in the order of the step's samples. The common case, a running request of one sample, is
    built inline: at 256 running requests this loop is most of a streaming step's host time."""
    if not partial:
        return [finish_output(request, now, tokenizer) for request in finished]
    done = set(finished)  # by identity (Request has eq=False)
    outputs = []
    append = outputs.append
    # dict.fromkeys: each request once (n > 1 samples of one request sample in one step).
    for request in dict.fromkeys([s.request for s in got]):
        if request in done:
            append(finish_output(request, now, tokenizer))
            done.discard(request)
        elif len(request.sequences) == 1 and request.sequences[0].finish_reason is None:
            seq = request.sequences[0]
            tokens = seq.token_ids
            completion = CompletionOutput(seq.index, None, None, tokenizer,
                                          request.params.skip_special_tokens,
                                          (tokens, seq.prompt_len, len(tokens)), logprobs=seq.logprobs)
            append(RequestOutput(request.request_id, request.prompt, request.prompt_token_ids,
                                 [completion], False, request.metrics, request.num_cached_prompt_tokens))
        else:
            append(request_output(request, False, tokenizer))
    # Finished in an earlier step whose outputs were never returned (an interrupted call).
    outputs += [finish_output(request, now, tokenizer) for request in finished if request in done]
    return outputs


def deliver(requests: dict[str, Request], outputs: list[RequestOutput]) -> list[RequestOutput]:
    """`outputs`, once the requests of the finished ones have left the table. The removal and the
    return are one line with no Python frame inside (map runs dict.pop in C): an interrupt either
    comes before it, and the requests stay to be reported by the next step, or after the caller
    has the outputs. Each finished output is returned exactly once."""
    gone = [out.request_id for out in outputs if out.finished]
    return (collections.deque(map(requests.pop, gone, itertools.repeat(None)), maxlen=0), outputs)[1]
