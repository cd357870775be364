"""One model step's metadata: what C++ writes into a pinned host buffer and the ONE copy that
takes it to the device. See StepMetadata for what each field means."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedkv._ext import _C


@dataclass(slots=True)
class StepMetadata:
    """Device views of one step's metadata (int32). The views alias buffers that the next
    build overwrites, and keep their addresses across steps (so CUDA graphs can capture them).

    For each scheduled sequence (row) i, its last ``query_len_i`` tokens are the step's new tokens:
    their slots were reserved by add/append, and the step writes their K/V before attention.
    Padding rows (padded_batch > num_seqs) have context length 0 and one padding token each
    (pad_query_len); padding tokens past query_start_loc[padded_batch] (padded_tokens) are of no
    row. Every padding token has slot -1 and position 0.
    """

    block_tables: torch.Tensor  # [padded_batch, max_blocks_per_seq]; entries past a row's used
    #                             blocks are stale or 0, but always valid block ids
    context_lens: torch.Tensor  # [padded_batch] tokens attention sees, new ones included; pad: 0
    query_start_loc: torch.Tensor  # [padded_batch + 1] row i's new tokens are [qsl[i], qsl[i+1])
    slot_mapping: torch.Tensor  # [num_tokens] block * block_size + offset per new token; pad: -1
    positions: torch.Tensor  # [num_tokens] position of each new token in its sequence; pad: 0
    num_seqs: int  # real rows
    num_tokens: int  # new tokens, padding included
    max_query_len: int  # over real rows
    max_context_len: int  # over real rows


class StepBuffers:
    """The packed int32 buffer of a StepLayout: pinned on the host (written by C++), and its twin
    on the device (the same tensor on CPU). Fields are views at the layout's offsets."""

    def __init__(self, layout: _C.StepLayout, device: torch.device) -> None:
        self.layout = layout
        on_cuda = device.type == "cuda"
        self.host = torch.zeros(layout.size, dtype=torch.int32, pin_memory=on_cuda)  # [layout.size]
        self.device = torch.zeros(layout.size, dtype=torch.int32, device=device) if on_cuda else self.host
        # The host buffer may be rewritten only once the previous copy out of it has finished.
        self._copied = torch.cuda.Event() if on_cuda else None
        # Slicing five views costs ~10 us of Python a step; a decode bucket reuses its views.
        self._views: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}

    def wait_until_reusable(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()  # normally done already: the last step's token read-back synced

    def upload(self, padded_batch: int) -> None:
        """Copy the used prefix of the buffer (everything up to the last used block-table row)."""
        if self._copied is None:
            return
        n = self.layout.used_size(padded_batch)
        self.device[:n].copy_(self.host[:n], non_blocking=True)
        self._copied.record()

    def pad_tokens(self, start: int, end: int) -> None:
        """Tokens [start, end) of the host buffer as padding: slot -1 (written nowhere, attending
        to nothing), position 0. Before upload(), which copies them with the rest."""
        layout = self.layout
        self.host[layout.slot_mapping + start: layout.slot_mapping + end] = -1
        self.host[layout.positions + start: layout.positions + end] = 0

    def metadata(self, num_seqs: int, padded_batch: int, num_tokens: int, max_query_len: int,
                 max_context_len: int) -> StepMetadata:
        views = self._views.get((padded_batch, num_tokens))
        if views is None:
            if len(self._views) >= 64:  # prefill token counts vary without bound: keep few
                self._views.clear()
            views = self._views[(padded_batch, num_tokens)] = self._slice(padded_batch, num_tokens)
        return StepMetadata(*views, num_seqs=num_seqs, num_tokens=num_tokens, max_query_len=max_query_len,
                            max_context_len=max_context_len)

    def _slice(self, padded_batch: int, num_tokens: int) -> tuple[torch.Tensor, ...]:
        """Views in StepMetadata's field order: block_tables, context_lens, query_start_loc,
        slot_mapping, positions."""
        layout, buf = self.layout, self.device
        table = buf[layout.block_tables: layout.block_tables + padded_batch * layout.max_blocks_per_seq]
        return (
            table.view(padded_batch, layout.max_blocks_per_seq),
            buf[layout.context_lens: layout.context_lens + padded_batch],
            buf[layout.query_start_loc: layout.query_start_loc + padded_batch + 1],
            buf[layout.slot_mapping: layout.slot_mapping + num_tokens],
            buf[layout.positions: layout.positions + num_tokens],
        )
