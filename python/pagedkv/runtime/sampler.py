"""The one sampler: logits processing and sampling of a step's rows, on the device, with no host
sync (so generate() captures it inside its decode-step graph, and the engine runs it right after
its forward).

Per-row parameters live in static device tensors [rows]: temperature (0 = greedy, exactly
argmax), top-k (0 = off), top-p (1 = off), the RNG seed, and the RNG offset (tokens the row has
generated), so a row's token depends on its logits, seed and offset only, never on its batch
slot. generate() fills every row alike once per call; the engine writes the rows of the
sequences that sample (SamplingBatch), and for an unchanged batch only moves the offsets on.

Logits processors of HF's greedy/sample loop, in HF's order and arithmetic, before sampling:
repetition penalty, then min_new_tokens' EOS suppression (temperature, top-k and top-p are the
sampling op's own); generate() may add HF's cheap ones (fast_processors.py: a [V] bias before the
penalty, min_p before sampling), each only when the call sets it, so a step without them runs
no kernel of theirs. The engine's requests may also ask for per-row penalties, min_p and logprobs
(row_processing.py): set as `processing` for the steps that have such rows, else None.
"""

from __future__ import annotations

import torch
from torch.profiler import record_function

from pagedkv import ops
from pagedkv.runtime.fast_processors import FastProcessors, apply_min_p
from pagedkv.runtime.row_processing import RowProcessing

# The kernels take top_k as int32 and keep every token for top_k >= the vocabulary size (< 2**31),
# so a larger top_k is top_k off either way: stored as this, exactly equivalent.
TOP_K_MAX = 2**31 - 1


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> None:
    """In place, HF's RepetitionPenaltyLogitsProcessor: logits of tokens already in the sequence
    (prompt included) are divided by `penalty` if positive, multiplied if negative.
    logits: [B, V] float32; seen: [B, V] bool."""
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    torch.where(seen, penalized, logits, out=logits)


def suppress_eos(logits: torch.Tensor, eos_ids: torch.Tensor, generated: torch.Tensor,
                 min_new_tokens: int) -> None:
    """In place, HF's MinNewTokensLengthLogitsProcessor: EOS logits are -inf while a row has
    generated fewer than min_new_tokens. logits: [B, V]; eos_ids: [E] int64; generated: [B]."""
    too_early = (generated < min_new_tokens).unsqueeze(1)  # [B, 1]
    eos_logits = logits[:, eos_ids]  # [B, E]
    logits[:, eos_ids] = torch.where(too_early, torch.full_like(eos_logits, -float("inf")), eos_logits)


class Sampler:
    """Samples one token per row of logits [n, V], n <= rows, into `next_tokens[:n]`.

    repetition_penalty != 1 needs `seen` [rows, V] bool at each call; min_new_tokens > 0 with
    eos_token_ids needs `generated` [rows] int32 (tokens each row has generated so far).
    bias_vocab / min_p: allocate generate()'s [V] bias and [rows] min_p (fill_processors sets
    their values per call; a captured step reads them).
    """

    def __init__(self, rows: int, device: torch.device, *, repetition_penalty: float = 1.0,
                 min_new_tokens: int = 0, eos_token_ids: tuple[int, ...] = (),
                 bias_vocab: int | None = None, min_p: bool = False) -> None:
        self.device = device
        self._allocate(rows)
        self.bias = (None if bias_vocab is None else
                     torch.zeros(bias_vocab, dtype=torch.float32, device=device))  # [V]
        self.min_p = torch.zeros(rows, dtype=torch.float32, device=device) if min_p else None  # [rows]
        self.begin: torch.Tensor | None = None  # [V] for the next call with first=True only
        self.repetition_penalty = repetition_penalty
        self.min_new_tokens = min_new_tokens if eos_token_ids else 0
        self.eos_ids = torch.tensor(eos_token_ids, dtype=torch.int64, device=device)  # [E]
        self.all_greedy = True  # every row at temperature 0: plain argmax, no parameters read
        self.processing: RowProcessing | None = None  # the engine's per-row processing, if a row has any

    def _allocate(self, rows: int) -> None:
        device = self.device
        self.rows = rows
        self.temperatures = torch.zeros(rows, dtype=torch.float32, device=device)  # [rows]
        self.top_k = torch.zeros(rows, dtype=torch.int32, device=device)  # [rows]
        self.top_p = torch.ones(rows, dtype=torch.float32, device=device)  # [rows]
        self.seeds = torch.zeros(rows, dtype=torch.int64, device=device)  # [rows]
        self.offsets = torch.zeros(rows, dtype=torch.int64, device=device)  # [rows]
        self.next_tokens = torch.zeros(rows, dtype=torch.int64, device=device)  # [rows]

    def fill(self, temperature: float, top_k: int, top_p: float) -> None:
        """Every row alike (generate()); seeds and offsets are set by the caller."""
        self.temperatures.fill_(temperature)
        self.top_k.fill_(min(top_k, TOP_K_MAX))
        self.top_p.fill_(top_p)
        self.all_greedy = temperature <= 0

    def fill_processors(self, processors: FastProcessors | None, vocab: int) -> None:
        """generate()'s cheap processors for this call, every row alike (the tensors this
        sampler allocated for them; begin_suppress_tokens for the first token only)."""
        if self.bias is not None:
            self.bias.copy_(processors.bias_vector(vocab, self.device))
        if self.min_p is not None:
            self.min_p.fill_(processors.min_p)
        self.begin = None
        if processors is not None and processors.begin:
            self.begin = processors.begin_vector(vocab, self.device)

    def set_rows(self, temperatures: list[float], top_k: list[int], top_p: list[float],
                 seeds: list[int], offsets: list[int]) -> None:
        """The parameters of rows [0, n) (the engine's samples of one step, in order). More rows
        than allocated re-allocate the tensors: only for a sampler no CUDA graph captured. Every
        value is converted before any row is written, so a value that does not fit raises with
        the rows (and all_greedy) as they were."""
        n = len(temperatures)
        all_greedy = all(t <= 0 for t in temperatures)
        if not all_greedy:
            pinned = self.temperatures.device.type == "cuda"
            host = [torch.tensor(values, dtype=dtype, pin_memory=pinned) for values, dtype in (
                (temperatures, torch.float32), ([min(k, TOP_K_MAX) for k in top_k], torch.int32),
                (top_p, torch.float32), (seeds, torch.int64), (offsets, torch.int64))]
        if n > self.rows:
            self._allocate(max(n, 2 * self.rows))
        self.all_greedy = all_greedy
        if all_greedy:
            return
        for dst, src in zip((self.temperatures, self.top_k, self.top_p, self.seeds, self.offsets), host):
            dst[:n].copy_(src, non_blocking=pinned)

    def advance_offsets(self, n: int) -> None:
        """Rows [0, n) each generated one token since they last sampled (stream-ordered)."""
        if not self.all_greedy:
            self.offsets[:n].add_(1)

    def __call__(self, logits: torch.Tensor, generated: torch.Tensor | None = None,
                 seen: torch.Tensor | None = None, first: bool = False) -> torch.Tensor:
        """logits [n, V] -> next_tokens[:n] int64 (a view of the static output). first: the
        rows' first generated token (begin_suppress_tokens apply)."""
        with record_function("sample"):
            n = logits.shape[0]
            penalize = self.repetition_penalty != 1.0
            suppress = self.min_new_tokens > 0
            begin = self.begin if first else None
            min_p = None if self.all_greedy else self.min_p
            # HF converts logits to fp32 for its processors. ops.sample reads bf16/fp16 logits as
            # their exact fp32 values, so without a processor the conversion changes no token
            # and is skipped (a kernel and a [n, V] fp32 copy per step).
            if penalize or suppress or self.bias is not None or begin is not None or min_p is not None:
                logits = logits.float()
            if self.bias is not None:  # then HF's bans: -inf whatever the logit (inf + -inf is NaN)
                logits.add_(self.bias).masked_fill_(self.bias == -float("inf"), -float("inf"))
            if begin is not None:
                logits.masked_fill_(begin == -float("inf"), -float("inf"))
            if penalize:
                apply_repetition_penalty(logits, seen[:n], self.repetition_penalty)
            if suppress:
                suppress_eos(logits, self.eos_ids, generated[:n], self.min_new_tokens)
            if min_p is not None:  # HF's warpers come after every processor
                apply_min_p(logits, self.temperatures[:n], min_p[:n])
            processing = self.processing
            if processing is not None:
                logits = processing.before_sampling(logits)
            out = self.next_tokens[:n]
            if self.all_greedy:
                ops.sample(logits, out=out)
            else:
                ops.sample(logits, self.temperatures[:n], self.top_k[:n], self.top_p[:n],
                           self.seeds[:n], self.offsets[:n], out=out)
            if processing is not None:
                processing.after_sampling(out)
            return out
