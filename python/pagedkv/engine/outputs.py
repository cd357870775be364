"""What pagedkv.LLM reports: per request, the completions, their finish reasons and timings;
for the engine, its counters (EngineStats)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(slots=True)
class EngineStats:
    """Counters since the engine was made."""

    num_steps: int = 0
    num_prompt_tokens_computed: int = 0  # prompt (or recomputed) tokens run through the model
    num_cached_prompt_tokens: int = 0  # prompt tokens found in the prefix cache instead
    num_generated_tokens: int = 0
    num_preemptions: int = 0


@dataclasses.dataclass(slots=True)
class RequestMetrics:
    """time.perf_counter() seconds of a request's life; None until it happens."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclasses.dataclass(slots=True)
class Logprob:
    """A token's log probability under the model's raw distribution, its rank there (1 = the
    most likely) and its text (None without a tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionOutput:
    """One sample of a request: its new token ids, their text (decoded on first access, with the
    engine's tokenizer; None without one; cut at a stop string), why it finished ("stop",
    "length", None = running) and, for "stop", what stopped it (stop_reason: the stop string or
    stop token id; None for EOS). With SamplingParams.logprobs: `logprobs`, one {token id:
    Logprob} per token (the sampled token first, then the top ones), and their cumulative_logprob."""

    __slots__ = ("index", "_token_ids", "_source", "finish_reason", "_tokenizer", "_skip_special", "_text",
                 "stop_reason", "_logprobs")

    def __init__(self, index: int, token_ids: list[int] | None, finish_reason: str | None, tokenizer,
                 skip_special_tokens: bool = True, source: tuple[list[int], int, int] | None = None,
                 *, text: str | None = None, stop_reason: str | int | None = None,
                 logprobs: list[dict[int, Logprob]] | None = None) -> None:
        """token_ids, or source = (tokens, start, end): the ids are tokens[start:end], copied on
        first access (see snapshot); logprobs: a list at least as long (a running sample's, read
        up to its token count)."""
        self.index = index
        self._token_ids = token_ids
        self._source = source
        self.finish_reason = finish_reason
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._text = text
        self.stop_reason = stop_reason
        self._logprobs = logprobs

    @classmethod
    def snapshot(cls, index: int, tokens: list[int], start: int, tokenizer, skip_special_tokens: bool = True,
                 logprobs: list[dict[int, Logprob]] | None = None) -> CompletionOutput:
        """A running sample's new tokens tokens[start:] as they are now. The list of a sequence
        only grows, so the copy waits for the first access: a partial output per request per
        step then costs no copy of every request's tokens."""
        return cls(index, None, None, tokenizer, skip_special_tokens, (tokens, start, len(tokens)),
                   logprobs=logprobs)

    @property
    def token_ids(self) -> list[int]:
        if self._token_ids is None:
            tokens, start, end = self._source
            self._token_ids, self._source = tokens[start:end], None
        return self._token_ids

    @property
    def text(self) -> str | None:
        if self._text is None and self._tokenizer is not None:
            self._text = self._tokenizer.decode(self.token_ids, skip_special_tokens=self._skip_special)
        return self._text

    @property
    def logprobs(self) -> list[dict[int, Logprob]] | None:
        if self._logprobs is None:
            return None
        return self._logprobs[:len(self.token_ids)]

    @property
    def cumulative_logprob(self) -> float | None:
        """The sum of the sampled tokens' logprobs (None without SamplingParams.logprobs)."""
        logprobs = self.logprobs
        return None if logprobs is None else sum(d[t].logprob for t, d in zip(self.token_ids, logprobs))

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (f"CompletionOutput(index={self.index}, text={short_text(self.text)}, "
                f"token_ids={short_ids(self.token_ids)}, finish_reason={self.finish_reason!r})")


def short_text(text: str | None, limit: int = 80) -> str:
    """repr of a text, its head only past `limit` characters (reprs stay a line or two)."""
    if text is None or len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} chars)"


def short_ids(ids: list[int], limit: int = 8) -> str:
    if len(ids) <= limit:
        return repr(ids)
    return f"[{', '.join(map(str, ids[:limit]))}, ...] ({len(ids)} tokens)"


@dataclasses.dataclass(slots=True, repr=False)
class RequestOutput:
    """A request's state after a step (partial) or at its end (finished=True). With n == 1,
    ``token_ids``/``text``/``finish_reason`` are those of the only completion."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_prompt_tokens: int = 0  # prompt tokens found in the prefix cache at first admission

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str | None:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    def __repr__(self) -> str:
        return (f"RequestOutput(request_id={self.request_id!r}, prompt={short_text(self.prompt)}, "
                f"prompt_token_ids={short_ids(self.prompt_token_ids)}, outputs={self.outputs!r}, "
                f"finished={self.finished}, num_cached_prompt_tokens={self.num_cached_prompt_tokens})")


def cut_at_stop(text: str, params) -> tuple[str | None, str | None]:
    """(text up to the first of params.stop found in it, in the list's order (through it with
    include_stop_str_in_output), that stop string), or (None, None) if none is in it."""
    for stop in params.stop:
        at = text.find(stop)
        if at >= 0:
            return text[:at + len(stop) if params.include_stop_str_in_output else at], stop
    return None, None


def finished_completion(seq, request, tokenizer) -> CompletionOutput:
    """A finished sample (engine/request.py's Sequence) with its stop reason and cut text."""
    params = request.params
    text = reason = None
    ids = seq.output_ids
    if seq.finish_reason == "stop" and ids:
        if ids[-1] in request.stop_ids:  # a stop token (an id; None for EOS), as vLLM
            reason = ids[-1] if ids[-1] in params.stop_token_ids else None
        elif params.stop and tokenizer is not None:
            text, reason = cut_at_stop(tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens),
                                       params)
    return CompletionOutput(seq.index, ids, seq.finish_reason, tokenizer, params.skip_special_tokens,
                            text=text, stop_reason=reason, logprobs=seq.logprobs)


def request_output(request, finished: bool, tokenizer) -> RequestOutput:
    """The output of an engine request (engine/request.py's Request) as it stands: finished, or
    partial (running samples' tokens so far, copied when read)."""
    skip = request.params.skip_special_tokens
    completions = [finished_completion(s, request, tokenizer)
                   if finished or s.finish_reason is not None else
                   CompletionOutput.snapshot(s.index, s.token_ids, s.prompt_len, tokenizer, skip, s.logprobs)
                   for s in request.sequences]
    return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids,
                         completions, finished, request.metrics, request.num_cached_prompt_tokens)
