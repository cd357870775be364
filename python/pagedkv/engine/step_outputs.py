"""The RequestOutputs of one read-back step: finished requests (generate's mode) or every request
that got a token (stream's mode). A finished request leaves the engine's table here."""

from __future__ import annotations

from pagedkv.engine.outputs import CompletionOutput, RequestOutput, request_output
from pagedkv.engine.request import Request, Sequence


def finish_output(request: Request, now: float, requests: dict[str, Request], tokenizer) -> RequestOutput:
    request.metrics.finished_time = now
    del requests[request.request_id]
    return request_output(request, True, tokenizer)


def finished_outputs(ended: list[Request], now: float, requests: dict[str, Request],
                     tokenizer) -> list[RequestOutput]:
    """An output per request whose every sample has finished (ended: requests with a sample that
    ended in this step)."""
    outputs = []
    for request in dict.fromkeys(ended):  # a request once, even if several samples ended
        if request.finished:
            outputs.append(finish_output(request, now, requests, tokenizer))
    return outputs


def partial_outputs(got: list[Sequence], ended: list[Request], now: float,
                    requests: dict[str, Request], tokenizer) -> list[RequestOutput]:
    """An output per request that got a token (got: its samples that did), in the order of the
    step's samples. The common case, a running request of one sample, is built inline: at 256
    running requests this loop is most of a streaming step's host time."""
    ended_set = set(ended)
    outputs = []
    append = outputs.append
    # dict.fromkeys: each request once (n > 1 samples of one request sample in one step).
    for request in dict.fromkeys([s.request for s in got]):
        if request in ended_set and request.finished:
            append(finish_output(request, now, requests, tokenizer))
        elif len(request.sequences) == 1 and request.sequences[0].finish_reason is None:
            seq = request.sequences[0]
            tokens = seq.token_ids
            completion = CompletionOutput(seq.index, None, None, tokenizer,
                                          request.params.skip_special_tokens,
                                          (tokens, seq.prompt_len, len(tokens)))
            append(RequestOutput(request.request_id, request.prompt, request.prompt_token_ids,
                                 [completion], False, request.metrics, request.num_cached_prompt_tokens))
        else:
            append(request_output(request, False, tokenizer))
    return outputs
