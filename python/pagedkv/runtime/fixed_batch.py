"""generate()'s fixed batch on the model runner: every row's blocks (prompt + max_new_tokens) are
counted against the device before any work, the prompts run as one step of the runner, the
generation's slots are reserved after them, and each decode step
(forward, logits processing, sampling, and the advance of positions and slots) runs on the device
with no host work, replayed as one CUDA graph per batch bucket and settings.

The host keeps one decode step queued ahead of it (runtime/decode_read_back.py). Prompt lookup,
greedy or sampled, runs its rounds on the device too (runtime/lookup_rounds.py), and so do draft
models with a constant num_assistant_tokens (runtime/draft_rounds.py); draft models of the "heuristic" schedules verify in
rounds read back on the host (runtime/prompt_lookup.py).
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import torch
from torch.profiler import record_function

from pagedkv.cache import CacheFull, KVCache, KVCacheSpec, free_memory_bytes
from pagedkv.layers.rotary import crossing_reason
from pagedkv.runtime.decode_read_back import read_back
from pagedkv.runtime.decode_state import DecodeState
from pagedkv.runtime.draft_rounds import DeviceDraft
from pagedkv.runtime.fast_processors import FastProcessors
from pagedkv.runtime.logits_step import LogitsStep
from pagedkv.runtime.lookup_rounds import DeviceLookup
from pagedkv.runtime.model import PreparedModel
from pagedkv.runtime.parallel import call_digest
from pagedkv.runtime.prefix_reuse import keep_rows
from pagedkv.runtime.prompt_lookup import LookupStats, check_lookup, lookup_room, run_prompt_lookup
from pagedkv.runtime.runner import ModelRunner, StepInput, bucket, capture_step, cuda_graphs_wanted
from pagedkv.runtime.sampler import Sampler

BLOCK_SIZE = 16


@dataclasses.dataclass(frozen=True, slots=True)
class GenerationSettings:
    """What one generate() call asks for, resolved and checked. Token counts are per row."""

    max_new_tokens: int
    min_new_tokens: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    do_sample: bool
    temperature: float
    top_k: int
    top_p: float
    repetition_penalty: float
    return_dict_in_generate: bool
    # Rows per prompt: HF's num_return_sequences (sampled rows r*n .. r*n+n-1 of prompt r fork
    # its prefilled blocks); num_beams > 1 runs hf/beam_search.py instead of this batch.
    num_return_sequences: int = 1
    num_beams: int = 1
    # repetition_penalty counts the rows' left padding as prompt tokens (transformers <= 5.1x)
    penalize_padding: bool = True
    # HF's cheap processors where the captured step gives HF's logits (hf/generation_config.py)
    processors: FastProcessors | None = None
    # HF's prompt lookup (runtime/prompt_lookup.py): tokens proposed per row and step; 0: off
    prompt_lookup_num_tokens: int = 0
    max_matching_ngram_size: int = 2


@dataclasses.dataclass(frozen=True, slots=True)
class _GraphKey:
    """What a captured decode step bakes in besides its buffers."""

    rows: int
    max_blocks: int
    do_sample: bool
    repetition_penalty: float
    min_new_tokens: int
    eos_ids: tuple[int, ...]
    bias: bool = False  # a [V] bias vector added (its values are filled per call)
    min_p: bool = False  # min_p's mask (its value is filled per call)


def check_call(model: PreparedModel, prompts: list[list[int]], settings: GenerationSettings,
               *more) -> int:
    """Refuse a call whose rows would pass the model's positions; under tensor parallelism, one
    whose prompts or settings (and `more`) differ between ranks. Returns the longest row."""
    longest = max(len(p) for p in prompts) + settings.max_new_tokens
    if longest > model.max_positions:
        raise ValueError(f"pagedkv.generate: sequences reach {longest} tokens but the model's "
                         f"max_position_embeddings is {model.max_positions}; prompt + "
                         f"max_new_tokens must be <= {model.max_positions}")
    if model.tp is not None:
        model.tp.check_same("prompts or generation settings", call_digest(prompts, settings, *more))
    return longest


def rope_base(model: PreparedModel, prompts: list[list[int]], width: int, max_new: int) -> int:
    """A length-dependent rope's base S for this call (RopeByLength.call_base; 0 without one),
    its rows computed; refuses what HF computes otherwise. width: input_ids' padded width."""
    rope = model.rope
    if rope is None:
        return 0
    reason = crossing_reason(rope.hf_module.config, width, width + max_new)
    if reason is not None:
        raise ValueError(f"pagedkv.generate: {reason}")
    base = rope.call_base(max(map(len, prompts)))
    if base > rope.length:
        raise ValueError(f"pagedkv.generate: the model's rotary embedding was grown to S={base} by an "
                         f"earlier HF forward (dynamic rope keeps it), past the {rope.length} positions "
                         "pagedkv computes; run HF's forward once on a prompt shorter than "
                         f"max_position_embeddings ({rope.switch}) to reset it")
    rope.ensure(max(base, max(map(len, prompts)) + max_new))
    return base


class FixedBatch:
    """generate()'s runner for one prepared model: its own cache, re-made larger when a call
    needs more blocks. Between calls it holds no row; finished rows' full blocks stay in its
    prefix cache (evictable, so still free) for a later prompt that extends them
    (runtime/prefix_reuse.py)."""

    def __init__(self, model: PreparedModel):
        self.model = model
        self.runner: ModelRunner | None = None
        # Graph key -> (state, sampler): buffers the key's captured step reads and writes.
        self._buffers: dict[_GraphKey, tuple[DecodeState, Sampler]] = {}
        self._weights_version: int | None = None  # of the weights the cached K/V came from
        self.kv_dtype = model.dtype  # the cache's: generate()'s kv_cache_dtype, set per call
        self.kv_scales: list[tuple[float, float]] | None = None  # an fp8 cache's (cache/kv_dtype.py)
        self.last_prompt_lookup: LookupStats | None = None  # the last prompt-lookup call's counts
        self._lookup = DeviceLookup()  # prompt lookup's captured rounds
        self._draft = DeviceDraft()  # a constant-k draft model's captured rounds

    def note_weights(self, version: int) -> None:
        """Drop the cached K/V when the weights were written in place since the last call
        (version: prefix_reuse.weights_version of the HF model, read before each call)."""
        if version != self._weights_version and self.runner is not None:
            self.runner.cache.drop_prefix_cache()
        self._weights_version = version

    @property
    def cache(self) -> KVCache | None:
        return None if self.runner is None else self.runner.cache

    def generate(self, prompts: list[list[int]], input_ids: torch.Tensor,
                 settings: GenerationSettings, streamer=None,
                 use_cuda_graphs: bool | None = None, decode_loop=None, proposer=None) -> torch.Tensor:
        """Returns the new tokens [B * n, N] (pad after EOS), N <= settings.max_new_tokens, n =
        settings.num_return_sequences; input_ids [B * n, S]: each prompt's row n times, as HF expands.
        use_cuda_graphs: default on for CUDA models. decode_loop: the processed path (HF's
        processors, hf/processed_decode.py): decode_loop(prefill logits [B, V], step) -> [B, N],
        step(tokens [B]) -> logits [B, V] (a LogitsStep); None: the captured sample-in-graph steps.
        proposer: a draft_model.DraftProposer: speculative rounds on its proposals (on the
        device where proposer.on_device)."""
        model, max_new = self.model, settings.max_new_tokens
        graphs = cuda_graphs_wanted(use_cuda_graphs, model, "pagedkv.generate")
        longest = check_call(model, prompts, settings)
        base = rope_base(model, prompts, input_ids.shape[1], max_new)
        # A row feeds len + max_new - 1 tokens; one slot more keeps the position the last step
        # advances to (never run) inside its blocks. A prompt's n rows share its full blocks.
        n = settings.num_return_sequences
        lookup = proposer.max_tokens if proposer is not None else settings.prompt_lookup_num_tokens
        if lookup:
            check_lookup(model)
        slack, verify_tokens = lookup_room(lookup, len(prompts))  # padded verification rows
        num_blocks = sum(len(p) // BLOCK_SIZE + n * (math.ceil((len(p) + max_new + slack) / BLOCK_SIZE)
                                                     - len(p) // BLOCK_SIZE) for p in prompts)
        step_tokens = max(sum(map(len, prompts)), verify_tokens)  # prefill, or a verification
        runner = self._runner_for(num_blocks, len(prompts) * n, step_tokens, longest)
        runner.insist_graphs = use_cuda_graphs is True  # a step that cannot be captured raises
        # Rows of a call interrupted in its own clean-up; their K/V may be unwritten.
        runner.cache.free_all(keep_cached=False)
        seq_ids = list(range(len(prompts) * n))
        try:
            if lookup and proposer is not None and not proposer.on_device:  # rounds read back; rows freed there
                new_tokens, self.last_prompt_lookup = run_prompt_lookup(runner, seq_ids, prompts, settings,
                                                                        streamer, input_ids, proposer, graphs)
                return new_tokens
            if lookup and proposer is not None:  # a constant k: rounds on the device (runtime/draft_rounds.py)
                new_tokens, self.last_prompt_lookup = self._draft.run(runner, proposer.runner, lookup, seq_ids,
                                                                      prompts, settings, streamer, input_ids, graphs)
            elif lookup:  # prompt lookup: rounds on the device (runtime/lookup_rounds.py)
                new_tokens, self.last_prompt_lookup = self._lookup.run(runner, seq_ids, prompts, settings,
                                                                       streamer, input_ids, graphs)
            else:
                new_tokens = self._run(runner, seq_ids, prompts, input_ids, settings, streamer, graphs,
                                       decode_loop, base)  # [B * n, N]
            keep_rows(runner.cache, seq_ids, new_tokens, settings.eos_token_ids)
        except BaseException:
            runner.cache.free_all(keep_cached=False)  # blocks whose K/V may never have been written
            raise
        return new_tokens

    # -- the cache ---------------------------------------------------------------------------
    def runner_for(self, num_blocks: int, rows: int, prompt_tokens: int, longest: int) -> ModelRunner:
        """_runner_for, for callers that run their own eager steps on this cache (beam search)."""
        if self.model.rope is not None:  # its steps carry no per-row S (HF's spans the padded batch)
            raise ValueError(f"pagedkv.generate: num_beams > 1 is not supported with rope type "
                             f"{self.model.rope.kind!r}; use num_beams=1")
        return self._runner_for(num_blocks, rows, prompt_tokens, longest)

    def _runner_for(self, num_blocks: int, rows: int, prompt_tokens: int, longest: int) -> ModelRunner:
        """A runner whose cache has num_blocks blocks and room for this prefill's metadata: the
        current one if it does. Its decode steps are this module's (graphs or not, per call)."""
        runner = self.runner
        if (runner is not None and runner.cache.num_blocks >= num_blocks
                and runner.cache.step_capacity_fits(rows, prompt_tokens)
                and runner.cache.spec.dtype == self.kv_dtype):
            if runner.cache.kv_scales is not None:  # a change drops the cached K/V
                runner.cache.set_kv_scales(self.kv_scales)
            return runner
        model = self.model
        w = model.weights
        spec = KVCacheSpec(len(w.layers), w.num_kv_heads, w.head_dim, self.kv_dtype, BLOCK_SIZE)
        self._check_memory(spec, num_blocks, rows, longest)
        if runner is not None:
            num_blocks = self._grown(spec, num_blocks, runner.cache.num_blocks)
        # The old cache and its graphs go before the new cache is allocated (the buffers first:
        # interrupted between the two, the old runner stays whole).
        self._buffers.clear()
        self._lookup.clear()
        self._draft.clear()
        runner = self.runner = None
        cache = KVCache(spec.num_layers, spec.num_kv_heads, spec.head_dim, dtype=spec.dtype,
                        device=model.device, block_size=spec.block_size, num_blocks=num_blocks,
                        max_seq_len=model.max_positions,
                        # a length-dependent rope's K depend on the S of the call that wrote them
                        enable_prefix_caching=model.rope is None,
                        max_batch_size=max(rows, 256),
                        max_step_tokens=max(prompt_tokens, model.max_positions, 256))
        if cache.kv_scales is not None:
            cache.set_kv_scales(self.kv_scales)
        self.runner = ModelRunner(model, cache, use_cuda_graphs=False)
        return self.runner

    def _check_memory(self, spec: KVCacheSpec, num_blocks: int, rows: int, longest: int) -> None:
        """Refuse, before any work, a batch whose blocks (all reserved up front) do not fit the
        device; the cache in use is counted as free since it is replaced."""
        needed = num_blocks * spec.bytes_per_block
        free = free_memory_bytes(self.model.device)
        if free is not None and self.cache is not None:
            free += self.cache.kv.nbytes
        fits = free is None or needed <= free
        tp = self.model.tp
        if tp is not None and not tp.all_true(fits) and fits:  # all ranks refuse together
            raise CacheFull(f"pagedkv.generate: the batch's {num_blocks} KV-cache blocks fit this "
                            "rank's device but not another's (its error names the sizes). Nothing was run.")
        if not fits:
            raise CacheFull(f"pagedkv.generate: the batch needs {num_blocks} KV-cache blocks "
                            f"({needed / 2**20:.1f} MiB: {rows} rows of up to {longest} tokens, prompt + "
                            f"max_new_tokens) but {self.model.device} has {free / 2**20:.1f} MiB free; "
                            "generate fewer rows or fewer new tokens per call. Nothing was run.")

    def _grown(self, spec: KVCacheSpec, num_blocks: int, old_blocks: int) -> int:
        """The size of a re-made cache: at least twice the old one where that fits the device (on
        every rank), so that a conversation growing turn by turn re-makes it, and loses its cached
        blocks, only a logarithmic number of times."""
        doubled = 2 * old_blocks
        if doubled <= num_blocks:
            return num_blocks
        free = free_memory_bytes(self.model.device)
        fits = free is None or doubled * spec.bytes_per_block <= free + self.cache.kv.nbytes
        if self.model.tp is not None:
            fits = self.model.tp.all_true(fits)
        return doubled if fits else num_blocks

    # -- decode steps ------------------------------------------------------------------------
    def _decode_step(self, runner: ModelRunner, key: _GraphKey, settings: GenerationSettings,
                     graphs: bool):
        """(replay, state, sampler): replay() runs one decode step and its advance."""
        captured = runner.graphs.get(key) if graphs else None
        if captured is not None and key in self._buffers:
            state, sampler = self._buffers[key]
            return captured.replay, state, sampler
        device = self.model.device
        vocab = self.model.weights.vocab_size if settings.repetition_penalty != 1.0 else None
        state = DecodeState.allocate(key.rows, key.max_blocks, vocab, BLOCK_SIZE, device,
                                     rope=self.model.rope is not None)
        sampler = Sampler(key.rows, device, repetition_penalty=settings.repetition_penalty,
                          min_new_tokens=settings.min_new_tokens, eos_token_ids=settings.eos_token_ids,
                          bias_vocab=self.model.weights.vocab_size if key.bias else None, min_p=key.min_p)
        sampler.fill(settings.temperature if settings.do_sample else 0.0, settings.top_k, settings.top_p)

        def step() -> torch.Tensor:
            with record_function("decode_step"):
                logits = runner.decoder.forward(state.tokens, state.metadata())
                next_tokens = sampler(logits, state.generated, state.seen)
                state.advance(next_tokens, sampler.offsets)
                return next_tokens

        if not graphs:
            return step, state, sampler
        captured = capture_step(runner, key, step)
        if captured is None:  # a fallback model's step that cannot be captured: eager from now on
            return step, state, sampler
        self._buffers[key] = (state, sampler)  # once captured: a graph is used only with its buffers
        return captured.replay, state, sampler

    def _run(self, runner: ModelRunner, seq_ids: list[int], prompts: list[list[int]],
             input_ids: torch.Tensor, settings: GenerationSettings, streamer, graphs: bool,
             decode_loop=None, base: int = 0):
        cache = runner.cache
        n = settings.num_return_sequences  # rows r*n .. r*n+n-1 are prompt r's, as HF expands them
        batch, max_new = len(seq_ids), settings.max_new_tokens
        lens = [len(p) for p in prompts for _ in range(n)]  # [B * n] per row
        firsts = seq_ids[::n]  # each prompt's first row: the one prefilled
        with record_function("metadata"):
            # Leading tokens found in the prefix cache (an earlier call's K/V) are not computed again.
            cached = [cache.add_sequence(sid, prompt) for sid, prompt in zip(firsts, prompts)]
        # The prompts run as one step of the runner, before the generation's slots are reserved
        # (a row's new tokens are its last ones: the prompt's past its cached blocks, here).
        with record_function("prefill"):
            query = [len(p) - c for p, c in zip(prompts, cached)]  # [B]
            last = list(itertools.accumulate(query, initial=-1))[1:]  # each prompt's last token
            tokens = list(itertools.chain.from_iterable([p[c:] for p, c in zip(prompts, cached)]))
            logits = runner.run(StepInput(firsts, tokens, query, last, rope_bases=[base] * len(firsts)))  # [B, V]
        if n > 1:  # a prompt's other rows fork its blocks (reserve copies a shared partial one)
            for sid in seq_ids:
                if sid % n:
                    cache.fork(sid - sid % n, sid)
            logits = logits.repeat_interleave(n, dim=0)  # [B * n, V]
        with record_function("metadata"):
            for sid in seq_ids:
                cache.reserve(sid, max_new)
            tables = [cache.block_table(sid) for sid in seq_ids]
            # Round the table width up so that calls of similar lengths share a captured graph.
            max_blocks = 1 << (max(len(t) for t in tables) - 1).bit_length()
            rows = bucket(batch) if graphs else batch
            fast = settings.processors
            key = _GraphKey(rows, max_blocks, settings.do_sample, settings.repetition_penalty,
                            settings.min_new_tokens, settings.eos_token_ids,
                            bias=fast is not None and bool(fast.bias),
                            min_p=fast is not None and fast.min_p is not None)
        if decode_loop is not None:
            step = LogitsStep(runner, rows, max_blocks, BLOCK_SIZE, graphs)
            step.start(lens, tables, base)
            return decode_loop(logits, step)
        replay, state, sampler = self._decode_step(runner, key, settings, graphs)
        with record_function("metadata"):
            table_host = torch.zeros(batch, max_blocks, dtype=torch.int32)
            for r, table in enumerate(tables):
                table_host[r, :len(table)] = torch.tensor(table, dtype=torch.int32)
            state.start(torch.tensor(lens, dtype=torch.int32), table_host, base)
            sampler.offsets.zero_()
            sampler.fill_processors(settings.processors, self.model.weights.vocab_size)
            if settings.do_sample:  # from torch's global RNG: torch.manual_seed reproduces a call
                sampler.seeds[:batch].copy_(torch.randint(0, 2**62, (batch,)))
                if self.model.tp is not None:  # every rank samples with the first rank's seeds
                    self.model.tp.broadcast_(sampler.seeds)
            if state.seen is not None:  # the prompt ids HF's repetition penalty counts
                state.seen.zero_()
                ids = input_ids.long()  # [batch, width], left-padded
                if not settings.penalize_padding:  # a row's padding reads as its last token
                    width = ids.shape[1]
                    pads = torch.tensor([width - n for n in lens], device=ids.device)  # [batch]
                    padding = torch.arange(width, device=ids.device) < pads.unsqueeze(1)
                    ids = torch.where(padding, ids[:, -1:], ids)
                state.seen[:batch].scatter_(1, ids, True)
        if rows > batch:
            logits = torch.cat([logits, logits.new_zeros(rows - batch, logits.shape[1])])
        first = sampler(logits, state.generated, state.seen, first=True)
        state.advance(first, sampler.offsets)
        return read_back(replay, first, sampler.next_tokens, rows, batch, max_new, settings,
                          streamer, input_ids, self.model.device)
