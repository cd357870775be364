"""A decode step's end on the device: the next token of each row, then the rows moved one position on."""

from __future__ import annotations

import torch

from pagedkv.ops._common import _ops


def sample(
    logits: torch.Tensor,
    temperatures: torch.Tensor | None = None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    seeds: torch.Tensor | None = None,
    offsets: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token id per row of logits [batch, vocab] (last dim contiguous), written to out.

    Without temperatures every row is greedy: exactly ``logits.argmax(-1)``. Per-row [batch]
    tensors on logits' device: temperatures float32 (<= 0 means greedy), top_k int32 (0 = off),
    top_p float32 (1.0 = off), seeds int64 and offsets int64 (both needed with temperatures).
    A sampled row draws from softmax(logits / T) restricted to HF's top-k then top-p sets; the
    draw depends only on (seed, offset) and the logits, never on global RNG state. A sampled row
    whose largest logit is NaN or +-inf (a NaN anywhere, or every logit -inf) has no softmax: it
    gets -1, an invalid token for the caller to raise on (HF's multinomial raises there); a
    greedy row keeps torch.argmax's answer (NaN counts as the largest). out: [batch] int64 or
    int32, or None to allocate int64. Returns out.
    """
    if out is None:
        out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    _ops.sample(out, logits, temperatures, top_k, top_p, seeds, offsets)
    return out


@torch.library.register_fake("pagedkv::sample")
def _sample_fake(out, logits, temperatures, top_k, top_p, seeds, offsets) -> None:
    return None


def advance_decode_rows(
    next_tokens: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
    context_lens: torch.Tensor, generated: torch.Tensor, offsets: torch.Tensor,
    slot_mapping: torch.Tensor, block_tables: torch.Tensor, block_size: int,
) -> None:
    """One decode step on for a batch whose rows have all their blocks reserved, in one kernel.

    In place: ``tokens = next_tokens`` (0 for an invalid -1 from ``sample``); rows with ``context_lens > 0`` (live) get positions,
    context_lens and generated + 1; offsets + 1 for every row; slot_mapping = the cache slot of
    the new position, ``block_tables[b, pos // block_size] * block_size + pos % block_size``, or
    -1 for padding rows and for a position past the row's table. block_tables: [B, max_blocks]
    int32; next_tokens, tokens, offsets: [B] int64; the rest [B] int32; one device.
    """
    _ops.advance_decode_rows(next_tokens, tokens, positions, context_lens, generated, offsets,
                             slot_mapping, block_tables, block_size)


@torch.library.register_fake("pagedkv::advance_decode_rows")
def _advance_decode_rows_fake(next_tokens, tokens, positions, context_lens, generated, offsets,
                              slot_mapping, block_tables, block_size) -> None:
    return None
