"""The device-side state of generate()'s fixed batch between decode steps.

Every row's blocks are reserved for the whole generation after its prefill, so each decode step's metadata (positions,
slots, context lengths) follows from the last on the device (ops.advance_decode_rows). A decode
step therefore needs no host work and no host->device copy, and the whole step, advance
included, replays as one CUDA graph. The prompts ran before as an ordinary step of the runner
(metadata from KVCache.build_metadata); this state starts where they left the rows.

Rows beyond the real batch (padding up to a CUDA-graph bucket) have context length 0 and slot -1:
the kernels skip them.
"""

from __future__ import annotations

import dataclasses

import torch

from pagedkv import ops
from pagedkv.layers.attention import ForwardMetadata


@dataclasses.dataclass(slots=True)
class DecodeState:
    tokens: torch.Tensor  # [B] int64: the token each row feeds next
    positions: torch.Tensor  # [B] int32: its position
    context_lens: torch.Tensor  # [B] int32: positions + 1 for live rows, 0 for padding rows
    slot_mapping: torch.Tensor  # [B] int32: its cache slot, -1 for padding rows
    block_tables: torch.Tensor  # [B, max_blocks] int32
    generated: torch.Tensor  # [B] int32: tokens generated so far (min_new_tokens)
    seen: torch.Tensor | None  # [B, V] bool: tokens in the row so far (repetition penalty)
    block_size: int
    # A length-dependent rope (layers/rotary.py): a token's S is max(position + 1 + offset, base),
    # offset = how far the row trails the batch's longest prompt (HF's S spans the left-padded batch)
    rope_offsets: torch.Tensor | None = None  # [B] int64
    rope_bases: torch.Tensor | None = None  # [B] int64

    @classmethod
    def allocate(cls, batch: int, max_blocks: int, vocab: int | None, block_size: int,
                 device: torch.device, rope: bool = False) -> "DecodeState":
        i32 = dict(dtype=torch.int32, device=device)
        i64 = dict(dtype=torch.int64, device=device)
        return cls(
            rope_offsets=torch.zeros(batch, **i64) if rope else None,
            rope_bases=torch.zeros(batch, **i64) if rope else None,
            tokens=torch.zeros(batch, dtype=torch.int64, device=device),
            positions=torch.zeros(batch, **i32), context_lens=torch.zeros(batch, **i32),
            slot_mapping=torch.full((batch,), -1, **i32),
            block_tables=torch.zeros(batch, max_blocks, **i32),
            generated=torch.zeros(batch, **i32),
            seen=None if vocab is None else torch.zeros(batch, vocab, dtype=torch.bool, device=device),
            block_size=block_size,
        )

    def start(self, prompt_lens: torch.Tensor, block_tables: torch.Tensor, rope_base: int = 0) -> None:
        """Rows at their prompts' last tokens, as the prefill left them: the first advance moves
        them to the first generated token. prompt_lens: [batch] int32; block_tables: [batch,
        <= max_blocks] int32, each row's blocks with the generation's reserved ones (host);
        rope_base: the call's base S (length-dependent rope: RopeByLength.call_base)."""
        if self.rope_offsets is not None:
            self.rope_offsets.zero_()
            self.rope_offsets[:prompt_lens.shape[0]].copy_(prompt_lens.max() - prompt_lens)
            self.rope_bases.fill_(rope_base)
        batch = prompt_lens.shape[0]
        self.block_tables.zero_()
        self.block_tables[:batch, :block_tables.shape[1]].copy_(block_tables)
        self.context_lens.zero_()  # padding rows stay at context 0: skipped by the kernels
        self.context_lens[:batch].copy_(prompt_lens)
        torch.clamp(self.context_lens - 1, min=0, out=self.positions)
        self.slot_mapping.fill_(-1)
        self.generated.zero_()

    def metadata(self) -> ForwardMetadata:
        lens = None
        if self.rope_offsets is not None:  # on the device: a captured step computes it each replay
            lens = torch.maximum(self.positions.long() + 1 + self.rope_offsets, self.rope_bases)
        return ForwardMetadata(positions=self.positions, slot_mapping=self.slot_mapping,
                               block_tables=self.block_tables, context_lens=self.context_lens,
                               rope_lens=lens)

    def advance(self, next_tokens: torch.Tensor, offsets: torch.Tensor) -> None:
        """After a step sampled next_tokens [B]: feed them, one position further, and one RNG
        offset on (offsets [B] int64, the sampler's; on device, one kernel; padding rows keep
        context 0 and slot -1)."""
        ops.advance_decode_rows(next_tokens, self.tokens, self.positions, self.context_lens,
                                self.generated, offsets, self.slot_mapping, self.block_tables,
                                self.block_size)
        if self.seen is not None:  # tokens: next_tokens with an invalid -1 read as 0
            self.seen.scatter_(1, self.tokens.unsqueeze(1), True)
