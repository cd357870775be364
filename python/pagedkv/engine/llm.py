"""pagedkv.LLM: continuous batching of many requests over one paged KV cache.

    llm = pagedkv.LLM(model, max_num_seqs=256, max_num_batched_tokens=8192)
    outs = llm.generate(prompts, SamplingParams(max_tokens=128, temperature=0))  # input order
    # online: llm.add_request(...); while llm.has_unfinished_requests(): llm.step()
    # streaming: for out in llm.stream(prompts, params): ...

Each step the scheduler (scheduler.py) picks the sequences to run and reserves their cache
slots; the model runner (runtime/runner.py) runs their decode tokens and prefill chunks as one
flat batch, the sampler draws a token for every sequence that reached its end, and finished
sequences free their blocks at once. The engine decides who runs; the runner how.

On CUDA the engine overlaps its host work with the device: each step() launches the next step
before it reads the current one's tokens back (launched_step.py), so scheduling, metadata and the
caller's own work run while the device computes. A sequence that a read-back shows has stopped
(a stop token) computed one more row in the step already launched; that row is dropped.

An exception (a KeyboardInterrupt, a device fault) may stop a call anywhere. A call marks the
engine `_dirty` while it changes its state, and the next call finds it so and rebuilds the state
from each request's tokens (repair.py); the batch and streaming APIs are in batch_api.py.
"""

from __future__ import annotations

import collections
import itertools
import random
import threading
import time

import torch

from pagedkv.cache import KVCache, KVCacheSpec, num_blocks_for
from pagedkv.cache.kv_dtype import kv_cache_options
from pagedkv.cache.spec import cache_sizing
from pagedkv.engine.batch_api import BatchAPI
from pagedkv.engine.draft import shared_with_draft
from pagedkv.engine.launched_step import LaunchedStep, pending_inputs
from pagedkv.engine.outputs import EngineStats, RequestOutput
from pagedkv.engine.prompts import Prompt, check_params, load_model, tokenize_prompt
from pagedkv.engine.repair import rebuild
from pagedkv.engine.request import Request, Sequence, Status, new_request
from pagedkv.engine.sampling_batch import SamplingBatch
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.engine.scheduler import Scheduler, SchedulerOutput
from pagedkv.engine.speculation import SPECULATIVE_MAX_BATCH, check_request, decode_rows, speculation_for
from pagedkv.engine.step_outputs import deliver, step_outputs
from pagedkv.engine.watched import read_watched
from pagedkv.models import registry, windows
from pagedkv.runtime.model import check_unchanged, prepared
from pagedkv.runtime.runner import ModelRunner, StepInput, cuda_graphs_wanted, overlap_wanted, to_device
from pagedkv.runtime.sampler import Sampler


class LLM(BatchAPI):
    """Serve many requests of one HF causal LM (every type pagedkv runs: docs/model_types.md).

    model: a loaded ``*ForCausalLM`` (on its device and dtype) or a name/path for
    ``from_pretrained``; tokenizer: needed for string prompts and output text (loaded with a
    model name). max_num_seqs: sequences running at once; max_num_batched_tokens: new tokens per
    step (longer prompts are chunked). The KV cache is sized by exactly one of
    ``kv_cache_memory`` (bytes if an int, else a fraction in (0, 1] of the available CUDA memory:
    free, plus what torch's allocator holds unused; default 0.9 on CUDA, 256 MiB on CPU) or
    ``num_kv_blocks``. max_model_len: longest sequence, prompt + output (default: the model's
    limit, at most the cache's capacity). kv_cache_dtype, kv_cache_scales: as generate()'s, not "calibrate".
    use_cuda_graphs: replay decode-only steps and verification steps without a prefill chunk as
    CUDA graphs (default on for CUDA models). overlap_steps: launch each step before the previous
    one's tokens are read back (default on for CUDA models; off, every step waits for the one before).
    Speculative decoding (engine/speculation.py; serial steps): HF's prompt lookup (prompt_lookup_num_tokens
    k >= 1, max_matching_ngram_size) or a draft on its own cache (assistant_model, num_assistant_tokens),
    k per request in SamplingParams; only steps of <= speculative_max_batch (None: any) decode rows propose.

    Threads may share an engine: its calls run one at a time (generate() and stream() hold it
    until they return or stop, so another thread's call waits for them).
    """

    def __init__(self, model, tokenizer=None, *, max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 kv_cache_memory: int | float | None = None, num_kv_blocks: int | None = None,
                 max_model_len: int | None = None, block_size: int = 16, enable_prefix_caching: bool = True,
                 use_cuda_graphs: bool | None = None, overlap_steps: bool | None = None,
                 dtype: torch.dtype | None = None, kv_cache_dtype: str = "auto", kv_cache_scales=None,
                 prompt_lookup_num_tokens: int = 0, max_matching_ngram_size: int | None = None,
                 assistant_model=None, num_assistant_tokens: int | None = None,
                 speculative_max_batch: int | None = SPECULATIVE_MAX_BATCH) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"pagedkv.LLM: max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"pagedkv.LLM: max_num_batched_tokens ({max_num_batched_tokens}) must be "
                             f">= max_num_seqs ({max_num_seqs}): every running sequence decodes a "
                             "token per step")
        model, self.tokenizer = load_model(model, tokenizer, dtype)
        registry.check_supported(model)
        self.model = model
        state = prepared(model)  # the weights, fused once and shared with generate()
        # Tensor parallel (pagedkv.tensor_parallel): every rank runs this engine on the same
        # requests and must schedule them alike, so the ranks agree on the cache's block count
        # and draw request seeds from one generator.
        self.tp = state.tp
        self.device = state.device
        limit = state.max_positions
        sizing = shared_with_draft(model, assistant_model, state, block_size,  # a draft's cache shares it
                                   cache_sizing(kv_cache_memory, num_kv_blocks, self.device))
        w = state.weights
        if self.tp is not None:
            spec = KVCacheSpec(len(w.layers), w.num_kv_heads, w.head_dim, state.dtype, block_size)
            sizing = {"num_blocks": self.tp.min_over_ranks(num_blocks_for(spec, self.device, **sizing))}
        kv_dtype, kv_scales = kv_cache_options(model, state, kv_cache_dtype, kv_cache_scales, "pagedkv.LLM")
        self.cache = KVCache(len(w.layers), w.num_kv_heads, w.head_dim, dtype=kv_dtype, kv_scales=kv_scales,
                             block_size=block_size, device=self.device,
                             max_seq_len=min(limit, max_model_len or limit), max_batch_size=max_num_seqs,
                             max_step_tokens=max_num_batched_tokens,
                             enable_prefix_caching=enable_prefix_caching and state.rope is None, **sizing)
        capacity = self.cache.capacity_tokens
        if max_model_len is not None and max_model_len > min(limit, capacity):
            raise ValueError(f"pagedkv.LLM: max_model_len {max_model_len} is more than the model's limit "
                             f"({limit}) or the KV cache's capacity ({capacity} tokens)")
        self.max_model_len = max_model_len or min(limit, capacity)
        graphs = cuda_graphs_wanted(use_cuda_graphs, state, "pagedkv.LLM")
        self.runner = ModelRunner(state, self.cache, graphs, max_batch=max_num_seqs,
                                  insist_graphs=use_cuda_graphs is True)
        self.speculation = speculation_for(model, state, self.cache, dict(
            prompt_lookup_num_tokens=prompt_lookup_num_tokens, max_matching_ngram_size=max_matching_ngram_size,
            assistant_model=assistant_model, num_assistant_tokens=num_assistant_tokens), overlap_steps, graphs,
            (max_num_seqs, max_num_batched_tokens, self.max_model_len), speculative_max_batch)
        self.scheduler = Scheduler(self.cache, max_num_seqs, max_num_batched_tokens,
                                   self.speculation and self.speculation.propose, windows.every_layer_window(w))
        self.vocab_size = w.vocab_size
        eos = getattr(model.generation_config, "eos_token_id", None)  # generation_config may be None
        eos = model.config.eos_token_id if eos is None else eos
        self.eos_token_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self.sampling = SamplingBatch(Sampler(max_num_seqs, self.device), self.vocab_size)
        # Seeds of requests that name none; from Python's global generator, so random.seed()
        # before making the engine reproduces a run (under tensor parallelism, rank 0's).
        seed = torch.tensor([random.getrandbits(62)], dtype=torch.int64)
        if self.tp is not None:
            seed = self.tp.broadcast_(seed.to(self.tp.device))
        self._seed_rng = random.Random(int(seed.item()))
        self.stats = EngineStats()
        self._requests: dict[str, Request] = {}
        self._request_counter = itertools.count()
        self._seq_counter = itertools.count()
        self.overlap_steps = overlap_wanted(overlap_steps, self.device) and self.speculation is None
        self._launched: collections.deque[LaunchedStep] = collections.deque()  # oldest first, <= 2
        self._lock = threading.RLock()
        # Requests finished in a step whose outputs have not been returned yet (an interrupted
        # call); the next step reports them.
        self._finished: list[Request] = []
        # Set while a call changes the engine's state: an exception (an interrupt) that leaves it
        # set makes the next call rebuild the state from what is certain (engine/repair.py).
        self._dirty = False

    def __repr__(self) -> str:
        return (f"LLM(model={type(self.model).__name__}, device={self.device}, "
                f"dtype={str(self.runner.model.dtype).removeprefix('torch.')}, "
                f"cache={self.cache.size_text}, max_num_seqs={self.scheduler.max_num_seqs}, "
                f"max_model_len={self.max_model_len}, running={len(self.scheduler.running)}, "
                f"waiting={len(self.scheduler.waiting)})")

    # -- requests -------------------------------------------------------------------------------
    def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request (a string, with the tokenizer, or token ids); returns its id. Bad
        input raises ValueError (TypeError for a wrong type) and leaves the engine as it was;
        so do, on every rank, requests that differ between tensor-parallel ranks."""
        with self._lock:
            self._repair()
            check_unchanged(self.model, self.runner.model)  # ModelChanged; per call, not per step
            self._check_weights_unwritten()
            given = None if request_id is None else str(request_id)
            (text, ids, params), = self._agreed(lambda: [self._checked(prompt, sampling_params)], [given])
            if request_id is None:
                request_id = self._auto_ids(1)[0]
            elif str(request_id) in self._requests:
                raise ValueError(f"pagedkv.LLM: request id {str(request_id)!r} is already in use")
            request = self._new_request(text, ids, params, str(request_id))
            self._commit([request])
            return request.request_id

    def _checked(self, prompt: Prompt, sampling_params: SamplingParams | None
                 ) -> tuple[str | None, list[int], SamplingParams]:
        """A request's text, token ids and parameters, or the error that refuses it."""
        params = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(params, SamplingParams):
            raise TypeError("pagedkv.LLM: sampling_params must be a SamplingParams, got "
                            f"{type(params).__name__}")
        text, ids = tokenize_prompt(prompt, self.tokenizer, self.vocab_size)
        check_params(params, self.tokenizer, self.vocab_size)
        check_request(self.speculation, params)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"pagedkv.LLM: the prompt has {len(ids)} tokens; at most "
                             f"{self.max_model_len - 1} fit (max_model_len {self.max_model_len}, one "
                             "token left to generate)")
        rope = self.runner.model.rope  # rope by length (no prefix cache): each request as HF's generate alone
        if rope and (reason := rope.admit(len(ids), min(len(ids) + params.max_tokens, self.max_model_len))):
            raise ValueError(f"pagedkv.LLM: {reason}")
        if params.n > self.scheduler.max_num_seqs:
            raise ValueError(f"pagedkv.LLM: n = {params.n} samples is more than max_num_seqs "
                             f"({self.scheduler.max_num_seqs})")
        return text, ids, params

    def _auto_ids(self, count: int) -> list[str]:
        """`count` new request ids from the counter, skipping ids in use (given by a caller)."""
        fresh = (i for i in map(str, self._request_counter) if i not in self._requests)
        return list(itertools.islice(fresh, count))

    def _new_request(self, text: str | None, ids: list[int], params: SamplingParams,
                     request_id: str) -> Request:
        """A request and its first sequence, not queued yet (nothing of the engine changes)."""
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(62) - params.n
        eos = frozenset() if params.ignore_eos else self.eos_token_ids
        return new_request(request_id, text, ids, params, max(seed, 0), eos, self.max_model_len,
                           next(self._seq_counter))

    def _commit(self, requests: list[Request]) -> None:
        """Queue the requests, all or none: the table takes them in one dict update (one C call;
        the waiting queue follows, and an interrupt before it does is repaired)."""
        self._dirty = True
        self._requests.update({r.request_id: r for r in requests})
        for request in requests:
            self.scheduler.add(request.sequences[0])
        self.sampling.special.update(r for r in requests if r.params.special)
        self._dirty = False

    def abort_request(self, request_id: str) -> None:
        """Drop a request (its blocks are freed); unknown ids are ignored."""
        with self._lock:
            self._repair()
            if request_id not in self._requests:
                return
            self._dirty = True
            request = self._requests.pop(request_id)
            for seq in request.sequences:
                if seq.status is not Status.FINISHED:
                    self.scheduler.abort(seq)
            if self.speculation is not None:
                self.speculation.release(self.scheduler.running)
            self._dirty = False

    def has_unfinished_requests(self) -> bool:
        if self._dirty:  # an interrupted call: the repair may find requests to run or report
            with self._lock:
                self._repair()
        return self.scheduler.has_unfinished() or any(
            self._requests.get(r.request_id) is r for r in self._finished)

    def _repair(self) -> None:
        """After a call that an exception stopped while it changed the engine's state: rebuild it
        from each request's tokens (engine/repair.py); unread samples are dropped, to be sampled
        again with the same values. Run again if it is interrupted itself."""
        if not self._dirty:
            return
        self._launched.clear()
        self.sampling = self.sampling.fresh()  # the rows it knew may not have run
        if self.speculation is not None:
            self.speculation.reset()
        self._finished = rebuild(self._requests, self.scheduler, self.tokenizer)
        self._dirty = False

    # -- one step -------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, partial: bool = True) -> list[RequestOutput]:
        """Run one step; returns an output for every request that got tokens in it (partial,
        with the tokens so far, or finished, the last time it is reported). partial=False
        reports finished requests only (no per-step copies of the token lists)."""
        # One line: the lock's release runs on it, so no line of Python (where an interrupt could
        # land, the finished outputs already handed over) comes between _step's end and the caller.
        with self._lock: return self._step(partial)  # noqa: E701

    def _step(self, partial: bool, wanted: set[str] | None = None) -> list[RequestOutput]:
        """One step's outputs; wanted: the requests of a generate() or stream() call, whose are
        the only outputs it returns (others' finished ones wait for the next step() call)."""
        self._repair()
        launched = self._launched
        self._dirty = True
        if not launched:
            step = self._launch()
            if step is not None:
                launched.append(step)
            elif self.scheduler.waiting and not self.scheduler.running:
                raise RuntimeError("pagedkv.LLM: no waiting request fits the empty engine (a bug: "
                                   "add_request checks that each one fits)")
        if self.overlap_steps and len(launched) == 1:
            ahead = self._launch()  # the next step, queued behind this one on the device
            if ahead is not None:
                launched.append(ahead)
        # Consistent again while it waits for the device: an interrupt (or the error of a read
        # that found NaN logits) leaves the step launched, to be read by the next call.
        self._dirty = False
        tokens = launched[0].read(self.abort_request) if launched else []
        self._dirty = True
        outputs = self._read_back(tokens, partial)
        if wanted is not None:
            outputs = [out for out in outputs if out.request_id in wanted]
        self._dirty = False
        return deliver(self._requests, outputs)

    def _launch(self) -> LaunchedStep | None:
        """Schedule a step and queue its forward and sampling on the device; None if nothing runs.
        A failure once slots were reserved leaves the engine to repair (_dirty)."""
        sched = self.scheduler.schedule()
        self.stats.num_preemptions = self.scheduler.num_preemptions
        if not sched.decodes and not sched.prefills:
            return None
        self.stats.num_steps += 1
        self.stats.num_cached_prompt_tokens += sched.num_cached_tokens
        self.stats.num_prompt_tokens_computed += sum(r.num_new for r in sched.prefills)
        return self._run(sched)

    def _read_back(self, tokens: list[int], partial: bool) -> list[RequestOutput]:
        """Hand the oldest launched step's tokens (read) to their sequences; the outputs of the
        step, not delivered yet."""
        # Those finished before and returned since have left the table.
        finished = self._finished = [r for r in self._finished if self._requests.get(r.request_id) is r]
        now = time.perf_counter()
        if not self._launched:  # nothing ran: report what an interrupted call did not
            return step_outputs([], finished, partial, now, self.tokenizer)
        step = self._launched.popleft()
        # The loop over every sample of the step: kept to an append and a few cheap tests.
        got: list[Sequence] = []
        named_ids: list[int] = []  # cache slots reserved for these tokens before they were known
        named: list[int] = []
        for seq, token in zip(step.samplers, tokens):
            if seq.status is Status.FINISHED:  # stopped in the step before, or aborted
                continue
            seq.pending -= 1
            token_ids = seq.token_ids
            token_ids.append(token)
            got.append(seq)
            request = seq.request
            if token in request.stop_ids or len(token_ids) >= request.max_len:
                self.scheduler.finish(seq, "stop" if token in request.stop_ids else "length")
                if request.finished:
                    finished.append(request)
            elif seq.pending_in_cache:
                seq.pending_in_cache = False
                named_ids.append(seq.seq_id)
                named.append(token)
        if named_ids:
            self.cache.set_pending_tokens(named_ids, named)
        if step.watched:  # stop strings, logprobs
            read_watched(step.watched, step.read_logprobs(), self.scheduler, finished, self.tokenizer)
        if self.speculation is not None:  # verification rows: several tokens each
            more, verified = self.speculation.read_back(step.verify, self.scheduler, finished, self.tokenizer)
            got += more
            self.stats.num_generated_tokens += verified - len(more)
        if self._launched and not self._launched[0].has_live_samples():
            self._launched.popleft()  # every sample of the step ahead ended: nothing to read
        for seq in () if step.repeat else got:  # a repeated batch has had its first tokens
            metrics = seq.request.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
        self.stats.num_generated_tokens += len(got)
        return step_outputs(got, finished, partial, now, self.tokenizer)

    def _run(self, sched: SchedulerOutput) -> LaunchedStep:
        """Queue the forward and sampling of one step. Advances num_computed, forks n > 1
        samples once their prompt is computed."""
        decodes, prefills, proposals = sched.decodes, sched.prefills, sched.proposals
        one_token = all(r.num_new == 1 and (self.runner.model.rope is None  # by length: S = position + 1
                                            or r.seq.num_computed + 1 >= r.seq.prompt_len) for r in prefills)
        decode_only = one_token and not proposals
        seq_ids = sched.decode_ids + [r.seq.seq_id for r in prefills] if prefills else sched.decode_ids
        # A decode row feeds its last token and samples; one verifying a proposal feeds both.
        tokens, lens, logits_rows, samplers, verify = decode_rows(decodes, sched.decode_tokens, proposals)
        query_lens = None if decode_only else lens + [r.num_new for r in prefills]
        for r in prefills:
            start = r.seq.num_computed
            tokens += r.seq.token_ids[start:start + r.num_new]
            if r.samples:
                logits_rows.append(len(tokens) - 1)
                samplers.append(r.seq)
        pending = pending_inputs(decodes, self._launched[-1]) if self._launched and decodes else None
        bases = None if decode_only else [s.prompt_len for s in decodes] + [r.seq.prompt_len for r in prefills]
        run = self.runner.run_decode_rows if proposals and one_token else self.runner.run  # no prefill chunk
        logits = run(StepInput(seq_ids, tokens, query_lens, logits_rows, pending, bases))  # [S, V]
        for seq in decodes:
            seq.num_computed += 1
        for r in prefills:
            r.seq.num_computed += r.num_new
        if verify is not None:
            logits = self.speculation.verify(logits, verify)  # the ordinary samplers' rows
        if not samplers:
            return LaunchedStep([], False, verify=verify)

        # n > 1: fork the samples once the prompt is computed; they share its logits row. A
        # repeated batch has no forks pending: they were made when its sequences sampled before.
        repeat = self.sampling.repeats(samplers, self.stats.num_steps)
        if not repeat:
            row_of = list(range(len(samplers)))
            for i, seq in enumerate(list(samplers)):
                if seq.pending_forks:
                    children = self.scheduler.fork(seq, [next(self._seq_counter) for _ in range(seq.pending_forks)])
                    samplers += children
                    row_of += [i] * len(children)
            if len(row_of) > len(logits_rows):
                logits = logits[to_device(row_of, self.device)]
        # With CUDA graphs the logits view the graph's output; the sampler runs on the same
        # stream before the next replay overwrites them.
        sampler = self.sampling.prepare(samplers, self.stats.num_steps, repeat)
        return LaunchedStep.sampled(samplers, repeat, sampler(logits), self.sampling, verify)
