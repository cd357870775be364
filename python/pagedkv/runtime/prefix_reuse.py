"""generate()'s reuse of earlier calls' K/V: a chat's next turn (the earlier prompt + its reply +
new text) finds the earlier call's full blocks in the prefix cache and computes only the rest.

A finished row's prompt blocks are keyed when it is added; its generated tokens' slots, reserved
before their ids were known, are named after the call (KVCache.name_reserved), so their full
blocks enter the prefix cache too. The cache keeps them only as evictable blocks: they are free
blocks for any later call (no growth), reused while nothing needs their space.

Cached K/V are valid only for the weights that computed them. A new tensor, dtype or device makes
a new PreparedModel and cache (runtime/model.py); an in-place write (an optimizer step,
load_state_dict, an op under no_grad) raises autograd's version counter of the parameter, which
weights_version sums, and the cached blocks are dropped. Writes through ``.data`` bypass the
counter: after one, call ``pagedkv.kv_cache_of(model).drop_prefix_cache()``.
"""

from __future__ import annotations

from typing import Sequence

import torch

from pagedkv.cache import KVCache


def weights_version(model: torch.nn.Module) -> int:
    """The sum of the HF model's parameters' version counters: it grows with every in-place write
    autograd sees. About 0.1 ms for 28 layers: per call, not per step."""
    return sum(0 if p.is_inference() else p._version for p in model.parameters())


def fed_tokens(row: Sequence[int], eos_ids: Sequence[int]) -> list[int]:
    """The new tokens of a finished row whose K/V the call wrote and that the returned row holds:
    all but the last (sampled, never fed), and none after the first EOS (the returned row holds
    padding there, the cache the tokens the device went on feeding)."""
    fed = list(row[:-1])
    for i, token in enumerate(fed):
        if token in eos_ids:
            return fed[:i + 1]
    return fed


def keep_rows(cache: KVCache, seq_ids: Sequence[int], new_tokens: torch.Tensor,
              eos_ids: Sequence[int]) -> None:
    """Free a finished call's rows, keeping their full blocks in the prefix cache. new_tokens:
    [len(seq_ids), N], row i is sequence seq_ids[i]'s generation (pad after EOS). A sequence the
    cache no longer holds (freed by its own path) is skipped."""
    for seq_id, row in zip(seq_ids, new_tokens.tolist()):
        if cache.has_sequence(seq_id):
            cache.name_reserved(seq_id, fed_tokens(row, eos_ids))
            cache.free(seq_id)
