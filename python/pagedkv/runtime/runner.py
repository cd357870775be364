"""ModelRunner: one prepared model bound to one KV cache; it executes steps.

A step is rows of sequences that hold cache slots, each computing its last `query_lens[i]`
tokens (a prompt, a prefill chunk after cached context, a prefix-cache hit's remainder, or one
decode token). The runner builds the step's metadata through the cache (KVCache.build_metadata,
the one metadata builder), runs the forward, and returns the logits of the rows asked for. A
decode-only step (one token per row) is padded to a batch bucket and, on CUDA, replayed as a
CUDA graph (runtime/graphs.py, the one capture place). A speculative verification step (rows of a
last token and a proposal, beside one-token decode rows: run_rows_of, run_decode_rows) runs each
token as a decode row of its own and is replayed as a graph too; steps with a prefill chunk run
eagerly.

generate()'s fixed batch (runtime/fixed_batch.py) and pagedkv.LLM (engine/llm.py) both run on
this class: the prefill of generate() is a step like the engine's, and its decode steps capture
the runner's forward together with the sampler and the on-device advance.

Nothing here waits for the device: host inputs go through pinned memory, so the engine can build
and launch step N+1 while step N runs. A row whose input token step N sampled and nobody has read
back yet takes it on the device (PendingTokens).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from typing import Any, Callable, Hashable, Iterable, Iterator

import torch
from torch.profiler import record_function

from pagedkv.cache import KVCache, StepMetadata
from pagedkv.layers.attention import ForwardMetadata
from pagedkv.models.fallback import FallbackDecoder, FallbackWeights
from pagedkv.models.cohere import CohereDecoder, CohereWeights
from pagedkv.models.gemma import GemmaDecoder, GemmaWeights
from pagedkv.models.llama import PagedDecoder
from pagedkv.models.olmo2 import Olmo2Decoder, Olmo2Weights
from pagedkv.runtime.graphs import CapturedStep, CudaGraphs
from pagedkv.runtime.model import PreparedModel
from pagedkv.runtime.parallel import graphs_hold_collectives

logger = logging.getLogger(__name__)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def bucket(batch: int, limit: int | None = None) -> int:
    """The CUDA-graph batch size a decode step of `batch` rows pads to (at most `limit`)."""
    padded = next((b for b in BATCH_BUCKETS if b >= batch), batch)
    return padded if limit is None else max(min(padded, limit), batch)


def decode_rows_padding(num_rows: int, num_tokens: int, max_batch: int | None, max_step_tokens: int
                        ) -> tuple[int, int]:
    """(rows, tokens) a step of num_rows decode rows of num_tokens tokens in all pads to for its
    CUDA graph (run_decode_rows): rows to a batch bucket (at most max_batch), each padding row of
    one token, unless they do not fit max_step_tokens; tokens, theirs included, to a batch bucket,
    past the largest to a multiple of 64 (at most max_step_tokens): a few graphs cover all steps."""
    rows = bucket(num_rows, max_batch)
    if num_tokens + rows - num_rows > max_step_tokens:
        rows = num_rows
    tokens = num_tokens + rows - num_rows
    padded = bucket(tokens) if tokens <= BATCH_BUCKETS[-1] else -(-tokens // 64) * 64
    return rows, max(min(padded, max_step_tokens), tokens)


def cuda_graphs_wanted(requested: bool | None, model: PreparedModel, caller: str) -> bool:
    """A use_cuda_graphs argument resolved: None means on for CUDA models that allow graphs;
    True raises off CUDA and for a model whose decode step failed to capture (graphs_allowed),
    never silently eager."""
    device = model.device
    if requested and device.type != "cuda":
        raise ValueError(f"{caller}: use_cuda_graphs=True needs a model on a CUDA device, got {device}")
    if requested and not graphs_allowed(model):
        raise _not_capturable(model, caller)
    return (device.type == "cuda" if requested is None else bool(requested)) and graphs_allowed(model)


def verify_graphs_wanted(device: torch.device) -> bool:
    """Speculative verification steps padded to one width and captured as CUDA graphs: on CUDA
    (PAGEDKV_VERIFY_GRAPHS=0: eager, an A/B switch); on the CPU padding would only add work."""
    return device.type == "cuda" and os.environ.get("PAGEDKV_VERIFY_GRAPHS", "1") != "0"


@contextlib.contextmanager
def graph_steps(runners: Iterable[ModelRunner], on: bool) -> Iterator[None]:
    """Within: the runners' steps (decode steps of run(), verification steps of run_rows_of and
    run_decode_rows) replay as CUDA graphs if `on` (and their model allows it); after, each runner
    as it was. generate()'s runners run eagerly outside a call that wants them (its own decode
    graphs sample inside)."""
    runners = list(runners)
    saved = [r.use_cuda_graphs for r in runners]
    for r in runners:
        r.use_cuda_graphs = on and graphs_allowed(r.model)
    try:
        yield
    finally:
        for r, was in zip(runners, saved):
            r.use_cuda_graphs = was


def graphs_allowed(model: PreparedModel) -> bool:
    """False for a model run by its own HF modules (models/fallback.py) once a decode step of it
    failed to capture (capture_step): HF code that syncs with the host or branches on values
    cannot be replayed, so its steps run eagerly from then on."""
    return not (isinstance(model.weights, FallbackWeights) and model.weights.capture_error is not None)


def _not_capturable(model: PreparedModel, caller: str) -> ValueError:
    return ValueError(f"{caller}: use_cuda_graphs=True, but the decode step of {type(model.weights.model).__name__} "
                      f"(run by its own HF modules: pagedkv.support_path(model) == 'fallback') cannot be "
                      f"captured as a CUDA graph: {model.weights.capture_error}; pass use_cuda_graphs=None "
                      "(the default: it then runs eagerly) or False")


def capture_step(runner: ModelRunner, key: Hashable, step: Callable[[], Any],
                 buffers: Any = None) -> CapturedStep | None:
    """runner.graphs.capture(key, step, buffers), or None when `step` of a model run by its own
    HF modules ran eagerly (the warm-up) but could not be captured: the model's steps run eagerly
    from then on (logged once), or, if the caller insisted (runner.insist_graphs), ValueError
    naming why. The failed capture was ended (runtime/graphs.py); the warm-up wrote only what an
    eager step writes. Errors of the warm-up itself, out-of-memory and native models' errors
    propagate as they are."""
    warmed: list[bool] = []

    def watched() -> Any:
        out = step()
        warmed.append(True)
        return out

    model = runner.model
    try:
        return runner.graphs.capture(key, watched, buffers=buffers)
    except Exception as error:  # noqa: BLE001 - a KeyboardInterrupt goes on as it is
        if not (isinstance(model.weights, FallbackWeights) and warmed) or isinstance(error, torch.OutOfMemoryError):
            raise
        model.weights.capture_error = capture_failure(error)
        if runner.insist_graphs:
            raise _not_capturable(model, "pagedkv") from error
        logger.info("%s (model_type %r, pagedkv's fallback path) runs eagerly: its decode step cannot be "
                    "captured as a CUDA graph: %s", type(model.weights.model).__name__,
                    model.weights.model.config.model_type, model.weights.capture_error)
        return None


def capture_failure(error: BaseException) -> str:
    """The first line of the error that started a chain (a step's error inside a capture is the
    context of the capture's own end failing), with its type."""
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"


def host_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    """An int64 CPU tensor of values, pinned when it is going to a CUDA device: a copy from
    pageable memory may wait for the stream, which would end the overlap of host and device."""
    return torch.tensor(values, dtype=torch.int64, pin_memory=device.type == "cuda")


def to_device(values: list[int], device: torch.device) -> torch.Tensor:
    return host_tensor(values, device).to(device, non_blocking=True)


def overlap_wanted(requested: bool | None, device: torch.device) -> bool:
    """An overlap_steps argument (pagedkv.LLM) resolved: None means on for CUDA models (on the
    CPU every op runs as it is called, so a step launched ahead only adds work)."""
    return device.type == "cuda" if requested is None else bool(requested)


@dataclasses.dataclass(slots=True)
class PendingTokens:
    """Input tokens still on the device: token rows[i] of a step is source[from_rows[i]], the
    sample of an earlier step not read back yet. rows None: tokens [0, n) are source[0, n)."""

    source: torch.Tensor  # [S] int64 on the model's device: an earlier step's samples
    n: int
    rows: list[int] | None = None  # [n] token indices of the step
    from_rows: list[int] | None = None  # [n] indices into source

    def fill(self, ids: torch.Tensor) -> None:
        """Write the pending tokens into ids [T] (on the device), stream-ordered. An invalid -1
        (a sampled row with NaN/inf logits, raised on when read back) is fed as 0."""
        if self.rows is None:
            torch.clamp(self.source[:self.n], min=0, out=ids[:self.n])
        else:
            device = ids.device
            tokens = self.source.index_select(0, to_device(self.from_rows, device)).clamp_(min=0)
            ids.index_copy_(0, to_device(self.rows, device), tokens)


@dataclasses.dataclass(slots=True)
class StepInput:
    """One step: rows (cache sequences) and the new tokens each computes, flat in row order."""

    seq_ids: list[int]  # [B] sequences holding slots for their new tokens
    token_ids: list[int]  # [T] the rows' new tokens, row after row (placeholders where pending)
    query_lens: list[int] | None  # [B] new tokens per row (its last ones); None: one each (decode)
    logits_rows: list[int] | None = None  # indices into token_ids to return logits for; None: all
    pending: PendingTokens | None = None  # tokens that are still on the device
    # [B] each row's base S for a length-dependent rope (model.rope): its tokens' S is
    # max(position + 1, base). Needed by steps with longer rows; decode rows' S is position + 1.
    rope_bases: list[int] | None = None


class ModelRunner:
    def __init__(self, model: PreparedModel, cache: KVCache, use_cuda_graphs: bool,
                 max_batch: int | None = None, insist_graphs: bool = False):
        """max_batch: most rows of a decode step (caps its bucket); use_cuda_graphs needs CUDA;
        insist_graphs: the caller passed use_cuda_graphs=True (a step that cannot be captured
        raises instead of running eagerly: capture_step)."""
        cuda_graphs_wanted(use_cuda_graphs, model, "pagedkv")
        self.model = model
        self.cache = cache
        self.device = model.device
        self.max_batch = max_batch
        if isinstance(model.weights, FallbackWeights):  # the HF model's own modules
            self.decoder = FallbackDecoder(model.weights, cache.k_caches, cache.v_caches)
        elif isinstance(model.weights, GemmaWeights):  # models/gemma.py
            self.decoder = GemmaDecoder(model.weights, model.cos_sin, cache.k_caches, cache.v_caches)
        elif isinstance(model.weights, Olmo2Weights):  # models/olmo2.py
            self.decoder = Olmo2Decoder(model.weights, model.cos_sin, cache.k_caches, cache.v_caches)
        elif isinstance(model.weights, CohereWeights):  # models/cohere.py
            self.decoder = CohereDecoder(model.weights, model.cos_sin, cache.k_caches, cache.v_caches)
        else:
            self.decoder = PagedDecoder(model.weights, model.cos_sin, cache.k_caches, cache.v_caches,
                                        tp=model.tp, rope=model.rope)
        self.use_cuda_graphs = use_cuda_graphs  # for run()'s decode steps
        # verification steps (run_rows_of, run_decode_rows) as graphs too (PAGEDKV_VERIFY_GRAPHS=0: eagerly)
        self.verify_graphs = verify_graphs_wanted(model.device)
        self.insist_graphs = insist_graphs  # generate() sets it per call (fixed_batch.py)
        self.graphs = CudaGraphs() if model.device.type == "cuda" else None
        if self.graphs is not None and model.tp is not None:
            graphs_hold_collectives(self.graphs)  # dropped before the process group goes

    def run(self, step: StepInput) -> torch.Tensor:
        """Logits [R, V] of the rows step.logits_rows (R = len(logits_rows); all T tokens when
        None). On CUDA the result may view a graph's output: read it before the next step."""
        decode = step.query_lens is None
        num_rows = len(step.seq_ids)
        padded = bucket(num_rows, self.max_batch) if decode and self.use_cuda_graphs else None
        meta = self.cache.build_metadata(step.seq_ids, step.query_lens, padded)
        tokens = step.token_ids
        if meta.num_tokens > len(tokens):  # padding rows of a bucket feed token 0
            tokens = tokens + [0] * (meta.num_tokens - len(tokens))
        ids = host_tensor(tokens, self.device)  # [num_tokens]
        rows = step.logits_rows
        if decode:
            full = self._decode(meta, ids, step.pending)  # [num_tokens, V], padding rows included
            if rows is None or rows == list(range(num_rows)):
                return full[:num_rows]  # a decode row is one token: rows and tokens coincide
            return full[to_device(rows, self.device)]
        ids = self._on_device(ids, step.pending)
        index = None if rows is None else to_device(rows, self.device)
        fmeta = forward_metadata(meta)
        if self.model.rope is not None:
            fmeta.rope_lens = self._rope_lens(step, meta.positions)
        return self.decoder.forward(ids, fmeta, logits_rows=index)

    def run_rows_of(self, step: StepInput, width: int) -> torch.Tensor:
        """Logits [B * width, V] of a step whose B rows compute `width` tokens each (a speculative
        verification step whose proposals the caller padded to one width), row after row, each
        token run as a decode row of its own (tokens_as_decode_rows). With verification graphs on
        (verify_graphs_wanted) the step is padded to a batch bucket, its padding rows of `width`
        tokens too, and replayed as a CUDA graph per (bucket, width). The result may view a
        graph's output: read it before the next step."""
        num_rows = len(step.seq_ids)
        graphs = self.verify_graphs and self.use_cuda_graphs
        padded = bucket(num_rows, self.max_batch) if graphs else None
        meta = self.cache.build_metadata(step.seq_ids, [width] * num_rows, padded, pad_query_len=width)
        ids = host_tensor(step.token_ids + [0] * (meta.num_tokens - len(step.token_ids)), self.device)
        key = ("verify", padded, width) if graphs else None
        return self._as_decode_rows(meta, ids, key, None)[:num_rows * width]

    def run_decode_rows(self, step: StepInput) -> torch.Tensor:
        """Logits [R, V] of step.logits_rows (all T tokens when None) of a step whose rows are all
        decode rows of step.query_lens tokens each (pagedkv.LLM's verification rows, a row's last
        token and its proposal, beside ordinary decode rows of one token; no prefill chunk), each
        token run as a decode row of its own (tokens_as_decode_rows). With verification graphs on
        (verify_graphs_wanted) the step is padded (decode_rows_padding: rows to a bucket, tokens
        to a bucket) and replayed as a CUDA graph per (row bucket, token bucket). The result may
        view a graph's output: read it before the next step."""
        num_rows, num_tokens = len(step.seq_ids), len(step.token_ids)
        if step.query_lens is None or sum(step.query_lens) != num_tokens:
            raise ValueError(f"pagedkv: run_decode_rows needs query_lens summing to the step's "
                             f"{num_tokens} tokens, got {step.query_lens}")
        graphs = self.verify_graphs and self.use_cuda_graphs
        rows = tokens = None
        if graphs:
            rows, tokens = decode_rows_padding(num_rows, num_tokens, self.max_batch, self.cache.max_step_tokens)
        meta = self.cache.build_metadata(step.seq_ids, step.query_lens, rows, padded_tokens=tokens)
        ids = host_tensor(step.token_ids + [0] * (meta.num_tokens - num_tokens), self.device)
        full = self._as_decode_rows(meta, ids, ("decode_rows", rows, tokens) if graphs else None,
                                    step.pending)  # [meta.num_tokens, V]
        if step.logits_rows is None or step.logits_rows == list(range(num_tokens)):
            return full[:num_tokens]
        return full[to_device(step.logits_rows, self.device)]

    def _as_decode_rows(self, meta: StepMetadata, ids: torch.Tensor, key: Hashable | None,
                        pending: PendingTokens | None) -> torch.Tensor:
        """Logits [meta.num_tokens, V] of every token of the step, each run as a decode row of its
        own; replayed as the CUDA graph of `key` (captured at its first use), eagerly if None. A
        key names the metadata's shape: one graph is replayed only over views laid out as when
        it was captured (the step buffer's, at fixed addresses)."""
        captured = self.graphs.get(key) if key is not None else None
        if key is not None and captured is None:
            static_ids = torch.zeros(meta.num_tokens, dtype=torch.int64, device=self.device)
            # The warm-up writes this step's K/V with token 0; the replay below rewrites them.
            captured = capture_step(self, key, lambda: self.decoder.forward(
                static_ids, tokens_as_decode_rows(meta)), buffers=static_ids)
            if captured is None:  # a fallback model that cannot be captured: eager from now on
                self.use_cuda_graphs = False
        if captured is None:
            return self.decoder.forward(self._on_device(ids, pending), tokens_as_decode_rows(meta))
        captured.buffers.copy_(ids, non_blocking=True)
        if pending is not None:
            pending.fill(captured.buffers)
        return captured.replay()

    def _rope_lens(self, step: StepInput, positions: torch.Tensor) -> torch.Tensor:
        """[T] each token's S (length-dependent rope): max(position + 1, its row's base)."""
        if step.rope_bases is None or len(step.rope_bases) != len(step.seq_ids):
            raise ValueError("pagedkv: a step with prompt rows on a length-dependent rope needs "
                             "StepInput.rope_bases, one per row")
        per_token = [b for b, n in zip(step.rope_bases, step.query_lens) for _ in range(n)]
        return torch.maximum(positions.long() + 1, to_device(per_token, self.device))

    def _on_device(self, ids: torch.Tensor, pending: PendingTokens | None) -> torch.Tensor:
        ids = ids.to(self.device, non_blocking=True)
        if pending is not None:
            pending.fill(ids)
        return ids

    def _decode(self, meta: StepMetadata, ids: torch.Tensor, pending: PendingTokens | None) -> torch.Tensor:
        fmeta = forward_metadata(meta, decode=True)
        if not self.use_cuda_graphs:
            with record_function("decode_step"):
                return self.decoder.forward(self._on_device(ids, pending), fmeta)
        # The metadata views keep their addresses across steps of one bucket (they alias the
        # cache's step buffer), so a graph captured over them reads each step's metadata.
        step = self.graphs.get(meta.num_tokens)
        if step is None:
            static_ids = torch.zeros(meta.num_tokens, dtype=torch.int64, device=self.device)
            # The warm-up run writes this step's K/V with token 0; the replay below rewrites them.
            step = capture_step(self, meta.num_tokens, lambda: self.decoder.forward(static_ids, fmeta),
                                buffers=static_ids)
            if step is None:  # a fallback model's step that cannot be captured: eager from now on
                self.use_cuda_graphs = False
                with record_function("decode_step"):  # this step's padding rows write nothing
                    return self.decoder.forward(self._on_device(ids, pending), fmeta)
        step.buffers.copy_(ids, non_blocking=True)
        if pending is not None:
            pending.fill(step.buffers)
        return step.replay()


def tokens_as_decode_rows(meta: StepMetadata) -> ForwardMetadata:
    """A step of rows of any number of tokens as a decode step of one row per token: token j of a
    row attends to its sequence's first position + 1 slots through its row's block table (the
    step's earlier tokens included: every token's K/V is written before attention reads). Decode
    attention's fixed cost a layer is well under prefill attention's for few-token rows, which on
    a small model is most of a verification step. A token's row is found in query_start_loc;
    padding tokens (slot -1: of padding rows, or past the last row) attend to nothing. Device ops
    only, so a captured graph recomputes them from the step's metadata."""
    starts = meta.query_start_loc  # [P + 1]
    tokens = torch.arange(meta.positions.shape[0], dtype=starts.dtype, device=starts.device)  # [T]
    rows = torch.searchsorted(starts[1:], tokens, right=True).clamp_(max=starts.shape[0] - 2)  # [T]
    context = torch.where(meta.slot_mapping >= 0, meta.positions + 1, 0).to(torch.int32)  # [T]
    return ForwardMetadata(positions=meta.positions, slot_mapping=meta.slot_mapping,
                           block_tables=meta.block_tables.index_select(0, rows), context_lens=context)


def forward_metadata(meta: StepMetadata, decode: bool = False) -> ForwardMetadata:
    """The forward's view of a step's metadata: decode steps use paged decode attention, others
    paged prefill attention over query_start_loc."""
    return ForwardMetadata(positions=meta.positions, slot_mapping=meta.slot_mapping,
                           block_tables=meta.block_tables, context_lens=meta.context_lens,
                           query_start_loc=None if decode else meta.query_start_loc,
                           max_query_len=meta.max_query_len)
