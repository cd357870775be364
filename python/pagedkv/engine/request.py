"""The state of a request inside pagedkv.LLM: a Request (what the user asked) and one
Sequence per sample (what the scheduler runs and the cache holds).

A sequence's ``token_ids`` are its prompt then its generated tokens. ``num_computed`` of them
have K/V in the cache (computed, or found in the prefix cache). While it runs, a sequence is:
- prefilling: more than one token left to compute (its prompt, or prompt + output after a
  preemption), computed in chunks;
- decoding: exactly one token left (the last sampled one), fed in the next step.

A sequence that sampled in a step whose tokens are not read back yet is ``pending``: its token
counts as its last (the engine schedules the next step on the device while this one runs, and
that step reads the token on the device); ``pending_in_cache`` when a cache slot is reserved for it.
"""

from __future__ import annotations

import dataclasses
import enum
import time

from pagedkv.engine.outputs import RequestMetrics
from pagedkv.engine.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # sample i uses seed + i
    metrics: RequestMetrics
    sequences: list["Sequence"] = dataclasses.field(default_factory=list)  # by sample index
    num_cached_prompt_tokens: int = 0
    # The finish rule's inputs, folded once by the engine: a sample ends on one of stop_ids
    # (stop ids, and EOS unless ignore_eos) or at max_len tokens (prompt + max_tokens, at most
    # max_model_len).
    stop_ids: frozenset[int] = frozenset()
    max_len: int = 0

    @property
    def finished(self) -> bool:
        return len(self.sequences) == self.params.n and all(
            s.status is Status.FINISHED for s in self.sequences)


@dataclasses.dataclass(slots=True, eq=False)
class Sequence:
    seq_id: int  # the id in the KV cache
    request: Request
    index: int  # sample index within the request
    token_ids: list[int]
    prompt_len: int
    status: Status = Status.WAITING
    num_computed: int = 0
    in_cache: bool = False
    pending_forks: int = 0  # samples still to fork from this one once its prompt is computed
    pending: int = 0  # sampled tokens on their way back from the device (at most 1 when scheduling)
    pending_in_cache: bool = False  # its cache slot was reserved with KVCache.PENDING_TOKEN
    finish_reason: str | None = None
    # Requests with stop strings or logprobs (engine/watched.py): the output tokens read back so
    # far, and one {token id: Logprob} per output token.
    num_watched: int = 0
    logprobs: list[dict] | None = None

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def num_left(self) -> int:
        """Tokens to compute before the next sample (a pending one included)."""
        return len(self.token_ids) + self.pending - self.num_computed

    @property
    def is_decoding(self) -> bool:
        return self.in_cache and self.num_left == 1

    @property
    def seed(self) -> int:
        return self.request.seed + self.index


def new_request(request_id: str, text: str | None, ids: list[int], params: SamplingParams, seed: int,
                eos_ids: frozenset[int], max_model_len: int, seq_id: int) -> Request:
    """A request and its first sequence (seq_id), not queued yet; eos_ids: the model's EOS ids
    unless the request ignores them."""
    request = Request(request_id, text, ids, params, seed, RequestMetrics(arrival_time=time.perf_counter()),
                      stop_ids=frozenset(params.stop_token_ids) | eos_ids,
                      max_len=min(len(ids) + params.max_tokens, max_model_len))
    request.sequences.append(Sequence(seq_id, request, 0, list(ids), len(ids), pending_forks=params.n - 1))
    return request
