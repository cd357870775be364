"""Prompt lookup kept on the device: the two ends of one speculative round of generate()'s fixed
batch (propose before the verification forward, accept after its greedy tokens), so the host only
replays rounds. The rule, written with Python loops, is tests/lookup_round_reference.py."""

from __future__ import annotations

import torch

from pagedkv.ops._common import _ops


def lookup_propose(
    history: torch.Tensor, lengths: torch.Tensor, generated: torch.Tensor, done: torch.Tensor,
    block_tables: torch.Tensor, feed: torch.Tensor, proposal_lens: torch.Tensor,
    positions: torch.Tensor, slot_mapping: torch.Tensor, context_lens: torch.Tensor,
    max_new: torch.Tensor, k: int, max_ngram: int, block_size: int,
) -> None:
    """Each row's feed of ``width = feed.shape[1]`` tokens for the verification forward, in place.

    A live row (``history[b, :lengths[b]]``, ``generated[b]`` of them emitted) feeds its last
    token, then up to ``min(k, width - 1, max_new - generated - 1)`` tokens that followed the
    first (leftmost) earlier occurrence of its last n tokens (n from ``min(max_ngram, length - 1)``
    down to 1; the first n with a match wins), then its last token as filler. Positions run from
    length - 1; fed and proposed tokens get their cache slot through ``block_tables`` and context
    position + 1; filler, positions past the row's table and done rows get slot -1 and context 0
    (done rows also feed 0 at position 0, and propose 0).

    history [R, L] int64 (L >= 1; lengths must stay in [1, L]: out-of-range values are clamped,
    not raised, on the device); lengths, generated [R] int64; done [R] bool; block_tables [R, MB]
    int32; feed [R, W] int64 (W >= 1); proposal_lens [R] int64; positions, slot_mapping,
    context_lens [R * W] int32; max_new [R] int64 (each row's max_new_tokens); k >= 0,
    max_ngram >= 1, block_size >= 1; one device.
    """
    _ops.lookup_propose(history, lengths, generated, done, block_tables, feed, proposal_lens,
                        positions, slot_mapping, context_lens, max_new, k, max_ngram, block_size)


@torch.library.register_fake("pagedkv::lookup_propose")
def _lookup_propose_fake(history, lengths, generated, done, block_tables, feed, proposal_lens,
                         positions, slot_mapping, context_lens, max_new, k, max_ngram,
                         block_size) -> None:
    return None


def lookup_accept(
    greedy: torch.Tensor, feed: torch.Tensor, proposal_lens: torch.Tensor, eos_ids: torch.Tensor,
    history: torch.Tensor, lengths: torch.Tensor, generated: torch.Tensor, done: torch.Tensor,
    stats: torch.Tensor, max_new: torch.Tensor,
) -> None:
    """Each live row after the verification forward, in place.

    ``greedy`` [R * W] int64 is the model's token at each fed position. A live row accepts the
    longest prefix of its proposal ``feed[b, 1:1 + proposal_lens[b]]`` that greedy repeats (a
    tokens) and emits ``greedy[b * W : b * W + a + 1]``, cut after the first token in ``eos_ids``
    and at ``max_new - generated``. The emitted tokens are appended to ``history`` at
    ``lengths[b]`` (history must have room: writes past L are dropped); lengths and generated grow
    by their count; done is set on an EOS or when generated reaches max_new; ``stats[b] +=
    (1, proposal_lens[b], a)``. Done rows are left as they are.

    feed [R, W] int64; proposal_lens [R] int64; eos_ids [E] int64 (E may be 0); history [R, L]
    int64; lengths, generated [R] int64; done [R] bool; stats [R, 3] int64; max_new [R] int64;
    one device.
    """
    _ops.lookup_accept(greedy, feed, proposal_lens, eos_ids, history, lengths, generated, done,
                       stats, max_new)


@torch.library.register_fake("pagedkv::lookup_accept")
def _lookup_accept_fake(greedy, feed, proposal_lens, eos_ids, history, lengths, generated, done,
                        stats, max_new) -> None:
    return None
