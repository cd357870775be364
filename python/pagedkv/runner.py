"""ModelRunner: one HF model on pagedkv — weights taken once, a paged KV cache, a prefill, and
decode steps that replay as CUDA graphs (one per batch bucket and settings).

For generate() every row's blocks are reserved before the first step (prompt + max_new_tokens),
so a decode step advances its own metadata on the device (see decode_state.py).
"""

from __future__ import annotations

import dataclasses
import math
import zlib

import torch
from torch.profiler import record_function

from pagedkv import ops
from pagedkv.cache import CacheFull, KVCache
from pagedkv.cache_spec import KVCacheSpec, free_memory_bytes
from pagedkv.decode_state import DecodeState
from pagedkv.generation_config import GenerationSettings
from pagedkv.logits import apply_repetition_penalty, suppress_eos
from pagedkv.models.llama import PagedDecoder, ForwardMetadata, extract_weights
from pagedkv.parallel import TensorParallel, shard_weights
from pagedkv.rope import build_cos_sin_cache
from pagedkv.support import check_supported

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
BLOCK_SIZE = 16


def slots_of(block_table: list[int], num_tokens: int) -> torch.Tensor:
    """Cache slots [num_tokens] int32 of a sequence's first num_tokens tokens."""
    blocks = torch.tensor(block_table, dtype=torch.int32).repeat_interleave(BLOCK_SIZE)[:num_tokens]
    return blocks * BLOCK_SIZE + torch.arange(num_tokens, dtype=torch.int32) % BLOCK_SIZE


def _call_digest(prompts: list[list[int]], settings: GenerationSettings) -> list[int]:
    """A few numbers that differ, but for a hash collision, between two different calls."""
    return [len(prompts), sum(map(len, prompts)), zlib.crc32(repr(prompts).encode()),
            zlib.crc32(repr(settings).encode())]


def device_of(model) -> torch.device:
    """Where pagedkv runs `model`: its runner's device (a tensor-parallel shard's may differ
    from the HF model's own), else the model's."""
    runner = getattr(model, "_pagedkv_runner", None)
    return runner.device if runner is not None else next(model.parameters()).device


def _bucket(batch: int) -> int:
    return next((b for b in BATCH_BUCKETS if b >= batch), batch)


@dataclasses.dataclass(frozen=True, slots=True)
class _SamplerKey:
    """What a captured decode step bakes in besides its buffers."""

    batch: int
    max_blocks: int
    do_sample: bool
    repetition_penalty: float
    min_new_tokens: int
    eos_ids: tuple[int, ...]


class _Sampler:
    """Logits processing + sampling with the per-row parameters in device tensors."""

    def __init__(self, batch: int, settings: GenerationSettings, device: torch.device):
        self.settings = settings
        self.temperatures = torch.full((batch,), settings.temperature if settings.do_sample else 0.0,
                                       dtype=torch.float32, device=device)
        self.top_k = torch.full((batch,), settings.top_k, dtype=torch.int32, device=device)
        self.top_p = torch.full((batch,), settings.top_p, dtype=torch.float32, device=device)
        self.seeds = torch.zeros(batch, dtype=torch.int64, device=device)
        self.eos_ids = torch.tensor(settings.eos_token_ids, dtype=torch.int64, device=device)
        self.next_tokens = torch.zeros(batch, dtype=torch.int64, device=device)

    def __call__(self, logits: torch.Tensor, state: DecodeState) -> torch.Tensor:
        with record_function("sample"):
            s = self.settings
            penalize = s.repetition_penalty != 1.0
            suppress = s.min_new_tokens > 0 and len(s.eos_token_ids) > 0
            # HF converts logits to fp32 for its processors. ops.sample reads bf16/fp16 logits as
            # their exact fp32 values, so without a processor the conversion changes no token
            # and is skipped (a kernel and a [B, V] fp32 copy per step).
            if penalize or suppress:
                logits = logits.float()
            if penalize:
                apply_repetition_penalty(logits, state.seen, s.repetition_penalty)
            if suppress:
                suppress_eos(logits, self.eos_ids, state.generated, s.min_new_tokens)
            ops.sample(logits, self.temperatures, self.top_k, self.top_p, self.seeds,
                       state.offsets, out=self.next_tokens)
            return self.next_tokens


class ModelRunner:
    def __init__(self, model, tp: TensorParallel | None = None):
        """tp: run this rank's shard of the model on tp.device (pagedkv.tensor_parallel)."""
        check_supported(model)
        self.model = model
        self.tp = tp
        param = next(model.parameters())
        self.device, self.dtype = (param.device if tp is None else tp.device), param.dtype
        config = model.config
        self.weights = extract_weights(model)
        if tp is not None:
            self.weights = shard_weights(self.weights, tp.rank, tp.world_size, tp.device)
        self.max_positions = int(config.max_position_embeddings)
        # [max_positions, Dh] fp32, from the model's own rotary embedding (exactly HF's cos/sin).
        self.cos_sin = build_cos_sin_cache(config, self.max_positions, self.device,
                                           rotary_emb=model.model.rotary_emb)
        self.cache: KVCache | None = None
        self.decoder: PagedDecoder | None = None
        self._graphs: dict[_SamplerKey, tuple[torch.cuda.CUDAGraph, DecodeState, _Sampler]] = {}

    # -- cache -------------------------------------------------------------------------------
    def _ensure_cache(self, num_blocks: int, rows: int, longest: int) -> KVCache:
        if self.cache is None or self.cache.num_blocks < num_blocks:
            w = self.weights
            spec = KVCacheSpec(len(w.layers), w.num_kv_heads, w.head_dim, self.dtype, BLOCK_SIZE)
            self._check_memory(spec, num_blocks, rows, longest)
            self._graphs.clear()  # graphs hold the old cache's addresses
            self.cache = None
            self.cache = KVCache(spec.num_layers, spec.num_kv_heads, spec.head_dim, dtype=spec.dtype,
                                 device=self.device, block_size=spec.block_size, num_blocks=num_blocks,
                                 max_seq_len=self.max_positions, enable_prefix_caching=False)
            self.decoder = PagedDecoder(w, self.cos_sin, self.cache.k_caches, self.cache.v_caches,
                                        tp=self.tp)
        return self.cache

    def _check_memory(self, spec: KVCacheSpec, num_blocks: int, rows: int, longest: int) -> None:
        """Refuse, before any work, a batch whose blocks (all reserved up front) do not fit the
        device; the cache in use is counted as free since it is replaced."""
        needed = num_blocks * spec.bytes_per_block
        free = free_memory_bytes(self.device)
        if free is not None and self.cache is not None:
            free += self.cache.kv.nbytes
        fits = free is None or needed <= free
        if self.tp is not None and not self.tp.all_true(fits) and fits:  # all ranks refuse together
            raise CacheFull(f"pagedkv.generate: the batch's {num_blocks} KV-cache blocks fit this "
                            "rank's device but not another's (its error names the sizes). Nothing was run.")
        if not fits:
            raise CacheFull(f"pagedkv.generate: the batch needs {num_blocks} KV-cache blocks "
                            f"({needed / 2**20:.1f} MiB: {rows} rows of up to {longest} tokens, prompt + "
                            f"max_new_tokens) but {self.device} has {free / 2**20:.1f} MiB free; "
                            "generate fewer rows or fewer new tokens per call. Nothing was run.")

    # -- generate ----------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], input_ids: torch.Tensor,
                 settings: GenerationSettings, streamer=None,
                 use_cuda_graphs: bool | None = None) -> torch.Tensor:
        """Returns the new tokens [B, N] (pad after EOS), N <= settings.max_new_tokens.
        use_cuda_graphs: default on for CUDA models."""
        graphs = (self.device.type == "cuda") if use_cuda_graphs is None else use_cuda_graphs
        if graphs and self.device.type != "cuda":
            raise ValueError("pagedkv: use_cuda_graphs=True needs a model on a CUDA device")
        batch = len(prompts)
        max_new = settings.max_new_tokens
        longest = max(len(p) for p in prompts) + max_new
        if longest > self.max_positions:
            raise ValueError(f"pagedkv.generate: sequences reach {longest} tokens but the model's "
                             f"max_position_embeddings is {self.max_positions}; prompt + "
                             f"max_new_tokens must be <= {self.max_positions}")
        if self.tp is not None:
            self.tp.check_same("prompts or generation settings", _call_digest(prompts, settings))
        # A row feeds len + max_new - 1 tokens; one slot more keeps the position that the last
        # step advances to (never run) inside the row's blocks, so no step indexes past them.
        lengths = [len(p) + max_new for p in prompts]
        blocks_per_row = [math.ceil(n / BLOCK_SIZE) for n in lengths]
        cache = self._ensure_cache(sum(blocks_per_row), batch, longest)
        seq_ids = list(range(batch))
        try:
            tables = self._reserve(cache, seq_ids, prompts, max_new)
            return self._run(prompts, input_ids, settings, streamer, tables, graphs)
        finally:
            for sid in seq_ids:
                if cache.has_sequence(sid):
                    cache.free(sid)

    def _reserve(self, cache: KVCache, seq_ids, prompts, extra_tokens: int) -> list[list[int]]:
        with record_function("metadata"):
            for sid, prompt in zip(seq_ids, prompts):
                cache.add_sequence(sid, prompt)
                if extra_tokens:
                    cache.reserve(sid, extra_tokens)
            return [cache.block_table(sid) for sid in seq_ids]

    def _prefill(self, prompts: list[list[int]], tables: list[list[int]]) -> torch.Tensor:
        """Runs the prompts, writes their K/V; returns the last position's logits [B, V]."""
        with record_function("prefill"):
            dev = self.device
            lens = [len(p) for p in prompts]
            ids = torch.tensor([t for p in prompts for t in p], dtype=torch.int64, device=dev)
            positions = torch.cat([torch.arange(n, dtype=torch.int32) for n in lens])
            slots = torch.cat([slots_of(table, n) for table, n in zip(tables, lens)])
            meta = ForwardMetadata(positions=positions.to(dev), slot_mapping=slots.to(dev), prefill_lens=lens)
            last_rows = torch.tensor(lens, device=dev).cumsum(0) - 1
            return self.decoder.forward(ids, meta, logits_rows=last_rows)

    def _new_state(self, batch_rows: int, max_blocks: int, settings: GenerationSettings):
        vocab = self.weights.vocab_size if settings.repetition_penalty != 1.0 else None
        state = DecodeState.allocate(batch_rows, max_blocks, vocab, BLOCK_SIZE, self.device)
        return state, _Sampler(batch_rows, settings, self.device)

    def _step(self, state: DecodeState, sampler: _Sampler) -> torch.Tensor:
        with record_function("decode_step"):
            logits = self.decoder.forward(state.tokens, state.metadata())
            next_tokens = sampler(logits, state)
            state.advance(next_tokens)
            return next_tokens

    def _decode_runner(self, batch: int, max_blocks: int, settings: GenerationSettings, graphs: bool):
        """(replay, state, sampler): replay() runs one decode step (and its advance)."""
        rows = _bucket(batch) if graphs else batch
        if not graphs:
            state, sampler = self._new_state(rows, max_blocks, settings)
            return (lambda: self._step(state, sampler)), state, sampler
        key = _SamplerKey(rows, max_blocks, settings.do_sample, settings.repetition_penalty,
                          settings.min_new_tokens, settings.eos_token_ids)
        if key not in self._graphs:
            state, sampler = self._new_state(rows, max_blocks, settings)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._step(state, sampler)  # warm-up outside capture (lazy inits, cuBLAS handles)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._step(state, sampler)
            self._graphs[key] = (graph, state, sampler)
        graph, state, sampler = self._graphs[key]

        def replay() -> None:
            with record_function("decode_step"):  # the captured label is not replayed
                graph.replay()

        return replay, state, sampler

    def _run(self, prompts, input_ids, settings: GenerationSettings, streamer, tables, graphs: bool):
        batch, max_new = len(prompts), settings.max_new_tokens
        # Round the table width up so that calls of similar lengths share a captured graph.
        max_blocks = 1 << (max(len(t) for t in tables) - 1).bit_length()
        replay, state, sampler = self._decode_runner(batch, max_blocks, settings, graphs)
        rows = state.tokens.shape[0]

        with record_function("metadata"):
            table_host = torch.zeros(rows, max_blocks, dtype=torch.int32)
            for r, table in enumerate(tables):
                table_host[r, :len(table)] = torch.tensor(table, dtype=torch.int32)
            lens = torch.zeros(rows, dtype=torch.int32)
            lens[:batch] = torch.tensor([len(p) for p in prompts], dtype=torch.int32)
            state.block_tables.copy_(table_host)
            # advance() below moves every live row one on; padding rows (bucket rows past the
            # batch) stay at position 0 with context 0: skipped by the kernels.
            state.positions.copy_((lens - 1).clamp(min=0))
            state.context_lens.copy_(lens)
            state.generated.zero_()
            state.offsets.zero_()
            if settings.do_sample:  # from torch's global RNG: torch.manual_seed reproduces a call
                sampler.seeds[:batch].copy_(torch.randint(0, 2**62, (batch,)))
                if self.tp is not None:  # every rank samples with the first rank's seeds
                    self.tp.broadcast_(sampler.seeds)
            sampler.temperatures.fill_(settings.temperature if settings.do_sample else 0.0)
            sampler.top_k.fill_(settings.top_k)
            sampler.top_p.fill_(settings.top_p)
            if state.seen is not None:  # HF penalizes every id of the (padded) input rows
                state.seen.zero_()
                state.seen[:batch].scatter_(1, input_ids.long(), True)

        logits = self._prefill(prompts, tables)  # [B, V]
        if rows > batch:
            logits = torch.cat([logits, logits.new_zeros(rows - batch, logits.shape[1])])
        first = sampler(logits, state)
        state.advance(first)

        pinned = self.device.type == "cuda"
        tokens_host = torch.empty(max_new, rows, dtype=torch.int64, pin_memory=pinned)
        ready: list[torch.cuda.Event | None] = []

        def fetch(step: int, tokens: torch.Tensor) -> None:
            tokens_host[step].copy_(tokens, non_blocking=pinned)
            event = torch.cuda.Event() if pinned else None
            if event is not None:
                event.record()
            ready.append(event)

        fetch(0, first)
        eos = torch.tensor(settings.eos_token_ids, dtype=torch.int64)
        pad = settings.pad_token_id
        finished = torch.zeros(batch, dtype=torch.bool)
        produced: list[torch.Tensor] = []
        launched = 1
        try:  # the streamer gets end() however the loop ends, so that its reader is released
            if streamer is not None:
                streamer.put(input_ids.cpu())
            while len(produced) < launched:
                if launched < max_new:  # keep one step queued while the host reads the last
                    replay()
                    fetch(launched, sampler.next_tokens)
                    launched += 1
                step = len(produced)
                if ready[step] is not None:
                    ready[step].synchronize()
                tokens = tokens_host[step, :batch].clone()
                if pad is not None:
                    tokens = torch.where(finished, torch.full_like(tokens, pad), tokens)
                if len(eos):
                    finished |= torch.isin(tokens, eos)
                produced.append(tokens)
                if streamer is not None:
                    streamer.put(tokens)
                if bool(finished.all()):
                    break
        finally:
            if streamer is not None:
                streamer.end()
            if pinned:
                torch.cuda.current_stream().synchronize()  # no step left writing the cache
        return torch.stack(produced, dim=1).to(self.device)


def runner_for(model) -> ModelRunner:
    """The model's runner, made on first use and kept on the model (weights are fused once)."""
    runner = getattr(model, "_pagedkv_runner", None)
    if runner is None:
        runner = ModelRunner(model)
        model._pagedkv_runner = runner
    return runner
