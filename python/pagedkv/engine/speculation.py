"""Speculative decoding in pagedkv.LLM: prompt lookup per request, or one shared draft model.

    llm = pagedkv.LLM(model, prompt_lookup_num_tokens=4)            # HF's n-gram lookup
    llm = pagedkv.LLM(model, assistant_model=draft, num_assistant_tokens=4)  # a draft model
    SamplingParams(prompt_lookup_num_tokens=0)  # this request without it (or another k)

Each step, after the scheduler reserved the decode rows' slots, every speculating decode row gets
a proposal (Scheduler(propose=...)): up to k tokens, never more than its request's remaining
tokens minus one nor the step's left budget, its slots reserved (shrunk to what fits). The step
runs verification rows (last token + proposal, k_i + 1 query tokens) beside ordinary decode rows
and prefill chunks. Without a prefill chunk (ModelRunner.run_decode_rows) each of its tokens runs
as a decode row of its own, replayed on CUDA as a CUDA graph per row and token bucket
(PAGEDKV_VERIFY_GRAPHS=0: eagerly); with one, the step is prefill-shaped and eager
(ModelRunner.run). Then each verification row accepts (greedy: the longest prefix equal to the
target's greedy tokens, taken as the sampler takes them, then the next greedy token; sampling:
speculative_rows.py), gives the rejected slots back (KVCache.truncate) and appends its tokens one
by one under the read-back's stop rule (stop ids, max_tokens, stop strings). Ordinary rows sample
as in any step, so a request that proposes nothing in a step gets the token it would get without
speculation.

A step's acceptance decides the next step's rows, so with speculation the engine runs its steps
serially (no overlap_steps).
"""

from __future__ import annotations

import torch

from pagedkv.engine.draft import EngineDraft
from pagedkv.engine.request import Request, Sequence, Status
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.engine.scheduler import Scheduler
from pagedkv.engine.speculative_rows import VerifyRows, sample_verify
from pagedkv.engine.watched import stop_in_tail
from pagedkv.runtime.draft_model import check_draft
from pagedkv.runtime.prompt_lookup import LookupStats, NgramIndex
from pagedkv.runtime.runner import to_device
from pagedkv.runtime.sampler import Sampler

# A step proposes only while it decodes at most this many sequences: on an H100 prompt lookup on
# SmolLM2 gave 1.87x one request at a time, 1.53x at 8 and 0.65x at 23 (lab/measurements.md,
# sessions 29-30): past a few rows a step's weight read is shared already, and the k + 1 rows a
# sequence verifies cost more than the tokens they save.
SPECULATIVE_MAX_BATCH = 8

# Per-request options a speculating request cannot have: (SamplingParams test, its name).
_REFUSED = ((lambda p: p.n > 1, "n > 1"), (lambda p: p.logprobs is not None, "logprobs"),
            (lambda p: p.repetition_penalty != 1, "repetition_penalty"),
            (lambda p: p.presence_penalty != 0, "presence_penalty"),
            (lambda p: p.frequency_penalty != 0, "frequency_penalty"), (lambda p: p.min_p > 0, "min_p"))


def _count(name: str, value, low: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"pagedkv.LLM: {name} must be an int >= {low}, got {value!r}")
    return value


def speculation_for(model, state, cache, options: dict, overlap_steps: bool | None, graphs: bool,
                    limits: tuple[int, int, int], max_batch: int | None = SPECULATIVE_MAX_BATCH) -> Speculation | None:
    """The engine's Speculation from LLM's options (prompt_lookup_num_tokens,
    max_matching_ngram_size, assistant_model, num_assistant_tokens), limits (max_num_seqs,
    max_num_batched_tokens, max_model_len) and speculative_max_batch; None without any;
    ValueError naming what is refused."""
    prompt_lookup_num_tokens, max_matching_ngram_size, assistant_model, num_assistant_tokens = options.values()
    if max_batch is not None:
        _count("speculative_max_batch", max_batch, 1)
    max_num_seqs, max_num_batched_tokens, max_model_len = limits
    k = _count("prompt_lookup_num_tokens", prompt_lookup_num_tokens, 0)
    if assistant_model is None:
        for name, value in (("max_matching_ngram_size", max_matching_ngram_size),
                            ("num_assistant_tokens", num_assistant_tokens)):
            if value is not None and not (name == "max_matching_ngram_size" and k):
                raise ValueError(f"pagedkv.LLM: {name} needs " + ("prompt_lookup_num_tokens >= 1" if
                                 name == "max_matching_ngram_size" else "an assistant_model"))
        if not k:
            return None
    elif k or max_matching_ngram_size is not None:
        raise ValueError("pagedkv.LLM: prompt_lookup_num_tokens / max_matching_ngram_size and assistant_model "
                         "are two ways to propose tokens; pass one")
    if overlap_steps:
        raise ValueError("pagedkv.LLM: overlap_steps=True cannot run with speculative decoding (a step's "
                         "acceptance decides the next step's rows); leave overlap_steps unset")
    if state.rope is not None or state.tp is not None:
        raise ValueError("pagedkv.LLM: speculative decoding is not supported yet " + (
            "with a length-dependent rope" if state.rope is not None else "under tensor parallelism"))
    draft = None
    if assistant_model is not None:
        check_draft(model, assistant_model)  # DraftRefused, a ValueError naming why
        config = getattr(assistant_model, "generation_config", None)
        k = num_assistant_tokens if num_assistant_tokens is not None else getattr(config, "num_assistant_tokens", None)
        k = 20 if k is None else k  # HF's default (transformers >= 5.2x leaves the field None)
        k = _count("num_assistant_tokens", k, 1)
        draft = EngineDraft(assistant_model, cache, max_num_seqs, max_num_batched_tokens, max_model_len, graphs)
    ngram = _count("max_matching_ngram_size", 2 if max_matching_ngram_size is None else max_matching_ngram_size, 1)
    return Speculation(k, ngram, draft, cache, max_num_batched_tokens, state.device, max_batch)


def check_request(spec: Speculation | None, params: SamplingParams) -> None:
    """Refuse, naming it, a request's speculative option the engine does not run, and what a
    speculating request asks for that speculation cannot honour."""
    lookup = spec is not None and spec.draft is None
    for name, allowed in (("prompt_lookup_num_tokens", lookup), ("max_matching_ngram_size", lookup),
                          ("num_assistant_tokens", spec is not None and not lookup)):
        value = getattr(params, name)
        if value is not None and not allowed and not (value == 0 and name != "max_matching_ngram_size"):
            raise ValueError(f"pagedkv.LLM: SamplingParams.{name} needs an engine made with " + (
                "prompt_lookup_num_tokens >= 1" if name != "num_assistant_tokens" else "an assistant_model"))
    if spec is None or not spec.k_of(params):
        return
    refused = [name for test, name in _REFUSED if test(params)]
    if refused:
        option = "prompt_lookup_num_tokens" if lookup else "num_assistant_tokens"
        raise ValueError(f"pagedkv.LLM: {', '.join(refused)} cannot run with speculative decoding; set "
                         f"SamplingParams({option}=0) to run this request without it")


def decode_rows(decodes: list[Sequence], decode_tokens: list[int], proposals: dict[Sequence, list[int]]
                ) -> tuple[list[int], list[int], list[int], list[Sequence], VerifyRows | None]:
    """A step's decode rows: (tokens, query lengths, logits rows, ordinary samplers, the rows that
    verify a proposal or None). A row with a proposal feeds its last token and the proposal and
    gets the logits of each; the others feed their last token and sample it."""
    if not proposals:
        return list(decode_tokens), [1] * len(decodes), list(range(len(decodes))), list(decodes), None
    tokens: list[int] = []
    lens: list[int] = []
    logits_rows: list[int] = []
    samplers: list[Sequence] = []
    rows = VerifyRows()
    for seq, last in zip(decodes, decode_tokens):
        proposal = proposals.get(seq)
        if proposal:
            rows.seqs.append(seq)
            rows.proposals.append(proposal)
            rows.logits_rows += range(len(logits_rows), len(logits_rows) + len(proposal) + 1)
            logits_rows += range(len(tokens), len(tokens) + len(proposal) + 1)
            tokens += [last] + proposal
            lens.append(len(proposal) + 1)
        else:
            logits_rows.append(len(tokens))
            tokens.append(last)
            lens.append(1)
            samplers.append(seq)
    return tokens, lens, logits_rows, samplers, rows


class Speculation:
    def __init__(self, k: int, ngram: int, draft: EngineDraft | None, cache, max_step_tokens: int,
                 device: torch.device, max_batch: int | None = SPECULATIVE_MAX_BATCH) -> None:
        self.k, self.ngram, self.draft, self.cache, self.device = k, ngram, draft, cache, device
        self.max_batch = max_batch  # a step of more decode rows proposes nothing; None: no limit
        # The greedy token of every verified position, taken as a decode step's sampler takes it.
        self.greedy = Sampler(max_step_tokens, device)
        self.greedy.fill(0.0, 0, 1.0)
        self.stats = LookupStats()  # verification rows, tokens proposed and accepted
        # seq_id -> the n-gram index of its tokens (prompt lookup): a scan of every row's tokens
        # each step would cost ~0.1 ms a 700-token row. Dropped when the sequence stops running.
        self.indexes: dict[int, NgramIndex] = {}

    def k_of(self, params: SamplingParams) -> int:
        own = params.num_assistant_tokens if self.draft is not None else params.prompt_lookup_num_tokens
        return self.k if own is None else own

    def propose(self, decodes: list[Sequence], budget: int) -> dict[Sequence, list[int]]:
        """The scheduler's hook: proposals of the speculating decode rows, at most `budget` tokens
        in all."""
        rows: list[tuple[Sequence, int]] = []
        out: dict[Sequence, list[int]] = {}
        if self.max_batch is not None and len(decodes) > self.max_batch:
            return out
        for seq in decodes:
            request = seq.request
            cap = min(self.k_of(request.params), request.max_len - len(seq.token_ids) - 1, budget)
            if cap <= 0:
                continue
            if self.draft is not None:
                rows.append((seq, cap))
                budget -= cap
            elif proposal := self._lookup(seq, cap, request.params.max_matching_ngram_size or self.ngram):
                out[seq] = proposal
                budget -= len(proposal)
        if rows:
            out = {seq: p for seq, p in self.draft.propose(rows).items() if p}
        return out

    def _lookup(self, seq: Sequence, cap: int, max_ngram: int) -> list[int]:
        """prompt_lookup.propose(seq.token_ids, cap, max_ngram) through the sequence's index,
        extended by the tokens it gained since; built again if its tokens are no longer the
        indexed ones followed by new ones (a cut: a list compare in C, not a Python scan)."""
        index, tokens = self.indexes.get(seq.seq_id), seq.token_ids
        if index is None or index.max_ngram != max_ngram or tokens[:len(index.tokens)] != index.tokens:
            index = self.indexes[seq.seq_id] = NgramIndex(max_ngram)
        index.extend(tokens[len(index.tokens):])
        return index.propose(cap)

    def verify(self, logits: torch.Tensor, rows: VerifyRows) -> torch.Tensor:
        """Queue the verification of rows (their logits among the step's logits [R, V]); returns
        the logits of the ordinary samplers."""
        spec = logits[to_device(rows.logits_rows, logits.device)]  # [T, V]
        greedy_pos, sampled = [], []
        start = 0
        for r, (seq, proposal) in enumerate(zip(rows.seqs, rows.proposals)):
            if seq.request.params.greedy:
                greedy_pos += range(start, start + len(proposal) + 1)
            else:
                sampled.append(r)
            start += len(proposal) + 1
        if greedy_pos:
            rows.greedy = self.greedy(spec[to_device(greedy_pos, spec.device)])
        if sampled:
            rows.sampled = sample_verify(spec, rows, sampled)
        taken = set(rows.logits_rows)
        plain = [i for i in range(logits.shape[0]) if i not in taken]
        return logits[to_device(plain, logits.device)]

    def read_back(self, rows: VerifyRows | None, scheduler: Scheduler, finished: list[Request],
                  tokenizer) -> tuple[list[Sequence], int]:
        """After a step read back (rows.read): the verification rows' tokens appended under the
        stop rule, rejected slots given back; (sequences that got tokens, how many tokens)."""
        got: list[Sequence] = []
        count = 0
        for seq, proposal, accepted, emitted in zip(*(() if rows is None else (
                rows.seqs, rows.proposals, rows.accepted, rows.emitted))):
            if seq.status is Status.FINISHED:  # aborted (NaN logits) while it was read
                continue
            self.cache.truncate(seq.seq_id, len(proposal) - accepted)
            seq.num_computed += accepted
            if self.draft is not None:
                self.draft.accepted(seq.seq_id, accepted)
            self.stats.rounds += 1
            self.stats.proposed += len(proposal)
            self.stats.accepted += accepted
            got.append(seq)
            request = seq.request
            for token in emitted:
                seq.token_ids.append(token)
                count += 1
                reason = ("stop" if token in request.stop_ids else
                          "length" if len(seq.token_ids) >= request.max_len else None)
                if request.params.stop and reason != "stop" and stop_in_tail(seq, tokenizer):
                    reason = "stop"
                if reason is not None:
                    scheduler.finish(seq, reason)
                    if request.finished:
                        finished.append(request)
                    break
            seq.num_watched = seq.num_output
        self.release(scheduler.running)
        return got, count

    def reset(self) -> None:
        """After a fault (engine/repair.py): the draft's sequences start over."""
        self.indexes.clear()
        if self.draft is not None:
            self.draft.reset()

    def release(self, running: list[Sequence]) -> None:
        """After a step or an abort: what was kept for sequences no longer running is dropped (the
        draft's sequences freed, n-gram indexes)."""
        if self.draft is not None:
            self.draft.keep(running)
        if self.indexes:
            live = {s.seq_id for s in running}
            for sid in [sid for sid in self.indexes if sid not in live]:
                del self.indexes[sid]
