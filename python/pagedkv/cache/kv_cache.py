"""The paged KV cache: K/V tensors on the device, and the C++ cache manager that decides which
block holds which tokens of which sequence. Attention reads K/V through the block tables built
here; nothing is ever gathered into dense per-sequence tensors."""

from __future__ import annotations

import logging
from typing import Sequence

import torch

from pagedkv import ops
from pagedkv._ext import _C
from pagedkv.cache.spec import KVCacheSpec, num_blocks_for
from pagedkv.cache.step_metadata import StepBuffers, StepMetadata

CacheFull: type[RuntimeError] = _C.CacheFull  # typed: _C is loaded at run time, its names read as Any
"""Raised (a RuntimeError) when an operation needs more free blocks than the cache has. Nothing
was changed: free or preempt a sequence and try again, or ask ``can_allocate`` first."""


logger = logging.getLogger(__name__)

PENDING_TOKEN = -1  # append_batch: the slot of a token not read back yet (set_pending_tokens)


def copy_blocks(cache: KVCache, copies: Sequence[tuple[int, int]]) -> None:
    """Copy-on-write on the device, on the current stream: block ``src`` to block ``dst`` for
    each (src, dst) pair the cache manager returned, in every layer's K and V (one launch)."""
    if not copies:
        return
    src, dst = torch.tensor(copies, dtype=torch.int64).T.contiguous().to(cache.device)  # [n] each
    ops.copy_blocks(cache.k_caches, cache.v_caches, src, dst)


class KVCache:
    """K and V of every layer in ``num_blocks`` blocks of ``block_size`` tokens, with sequences'
    bookkeeping delegated to ``pagedkv._C.CacheManager``.

    Size it with exactly one of ``num_blocks=``, ``memory_bytes=`` or ``memory_fraction=`` (of the
    CUDA memory available now: free, plus what torch's allocator holds unused). ``max_seq_len``
    bounds one sequence (default: the whole cache); it also sets the width of the block-table
    rows of build_metadata, ``ceil(max_seq_len / block_size)``, so pass the model's limit for a
    large cache. ``max_batch_size`` and ``max_step_tokens`` bound one step's metadata (rows, and
    new tokens including padding; default max(max_seq_len, max_batch_size) so a whole prompt fits
    one step); its buffers are made at the first build.

    dtype torch.float8_e4m3fn: an fp8 cache (half the bytes of a 16-bit one), K/V stored as
    x / scale with one fp32 scale per layer for K and for V: ``kv_scales`` (per layer (k, v);
    None: 1.0), later ``set_kv_scales``; see cache/kv_dtype.py.

    Errors: ``CacheFull`` when blocks run out (nothing changed); ``KeyError`` for a sequence id
    that is not in the cache (unknown, or already freed); ``ValueError`` for a call that can
    never succeed (empty or too long prompt, id in use, duplicate id in a batch, a count, id or
    token id out of range: sequence ids are int64, token ids in [0, 2**31), ...); ``TypeError``
    for a bool or a non-int where a count or an id goes. Nothing is ever wrapped.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.bfloat16,
        block_size: int = 16,
        num_blocks: int | None = None,
        memory_bytes: int | None = None,
        memory_fraction: float | None = None,
        device: torch.device | str = "cuda",
        max_seq_len: int | None = None,
        max_batch_size: int = 256,
        max_step_tokens: int | None = None,
        enable_prefix_caching: bool = True,
        kv_scales: Sequence[tuple[float, float]] | None = None,
    ) -> None:
        self.spec = spec = KVCacheSpec(num_layers, num_kv_heads, head_dim, dtype, block_size)
        self.device = torch.device(device)
        blocks = num_blocks_for(spec, self.device, num_blocks=num_blocks, memory_bytes=memory_bytes,
                                memory_fraction=memory_fraction)
        if max_seq_len is None:  # not `or`: a max_seq_len of 0 is refused, not taken as the default
            max_seq_len = blocks * block_size
        self.manager = _C.CacheManager(blocks, block_size, max_seq_len, enable_prefix_caching)
        # kv: [num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]; one tensor so
        # that a block copy covers all layers in one op.
        self.kv = torch.zeros(num_layers, 2, blocks, block_size, num_kv_heads, head_dim, dtype=dtype,
                              device=self.device)
        # Per layer [num_blocks, block_size, num_kv_heads, head_dim], contiguous views of kv.
        self.k_caches: list[torch.Tensor] = list(self.kv[:, 0].unbind(0))
        self.v_caches: list[torch.Tensor] = list(self.kv[:, 1].unbind(0))
        # An fp8 cache: [num_layers, 2 (K, V)] fp32 scales on the device (K/V stored as x / scale),
        # each layer's pair also the `kv_scale` attribute of its K and V views, which the ops read
        # when the model code passes caches only. Written in place (set_kv_scales): graphs see them.
        self.kv_scales: torch.Tensor | None = None
        if dtype == torch.float8_e4m3fn:
            self.kv_scales = torch.ones(num_layers, 2, dtype=torch.float32, device=self.device)
            for layer, (k, v) in enumerate(zip(self.k_caches, self.v_caches)):
                k.kv_scale = self.kv_scales[layer, 0:1]
                v.kv_scale = self.kv_scales[layer, 1:2]
            self.set_kv_scales(kv_scales)
        if max_step_tokens is None:
            max_step_tokens = max(self.manager.max_seq_len, max_batch_size)
        # Checked now (bools, ints past int32, max_step_tokens < max_batch_size), used at the
        # first build_metadata, which makes its buffers.
        self._layout = _C.StepLayout(max_batch_size, max_step_tokens, self.manager.max_blocks_per_seq)
        self._max_batch_size = max_batch_size
        self._max_step_tokens = max_step_tokens
        self._buffers: StepBuffers | None = None
        logger.info("KV cache: %s on %s, %s; %d layers x %d kv heads x %d head dim; sequences up "
                    "to %d tokens", self.size_text, self.device, str(dtype).removeprefix("torch."),
                    num_layers, num_kv_heads, head_dim, self.manager.max_seq_len)

    @classmethod
    def from_hf_config(cls, config, *, dtype: torch.dtype | None = None, block_size: int = 16,
                       **kwargs) -> KVCache:
        """A cache shaped for a transformers config (see KVCacheSpec.from_hf_config); kwargs as
        for KVCache (sizing, device, limits)."""
        spec = KVCacheSpec.from_hf_config(config, dtype=dtype, block_size=block_size)
        return cls(spec.num_layers, spec.num_kv_heads, spec.head_dim, dtype=spec.dtype,
                   block_size=spec.block_size, **kwargs)

    def set_kv_scales(self, scales: Sequence[tuple[float, float]] | None) -> None:
        """An fp8 cache's per-layer (k_scale, v_scale), positive and finite; None: all 1.0. A
        change drops the prefix cache (its K/V were stored with the old scales): call it with no
        sequence in the cache. ValueError (nothing changed) for a 16-bit cache or bad values."""
        if self.kv_scales is None:
            raise ValueError(f"pagedkv: KV-cache scales apply to a torch.float8_e4m3fn cache; this "
                             f"one is {self.spec.dtype}")
        values = torch.ones(self.spec.num_layers, 2) if scales is None else torch.tensor(
            [[float(k), float(v)] for k, v in scales], dtype=torch.float32)
        if values.shape != (self.spec.num_layers, 2) or not bool((values.isfinite() & (values > 0)).all()):
            raise ValueError(f"pagedkv: kv_cache_scales must be {self.spec.num_layers} (k_scale, "
                             f"v_scale) pairs of positive finite numbers, one per layer; got "
                             f"{values.tolist() if values.numel() <= 8 else tuple(values.shape)}")
        if not torch.equal(values, self.kv_scales.cpu()):
            self.drop_prefix_cache()
            self.kv_scales.copy_(values)
            logger.info("fp8 KV-cache scales: k %.4g..%.4g, v %.4g..%.4g", values[:, 0].min(),
                        values[:, 0].max(), values[:, 1].min(), values[:, 1].max())

    # -- size ------------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.manager.num_blocks

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def capacity_tokens(self) -> int:
        """Tokens the whole cache holds: num_blocks * block_size."""
        return self.manager.num_blocks * self.spec.block_size

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out: never used, or cached with no owner (evicted LRU first)."""
        return self.manager.num_free_blocks

    @property
    def nbytes(self) -> int:
        """Bytes of K and V in all blocks and layers."""
        return self.num_blocks * self.spec.bytes_per_block

    @property
    def size_text(self) -> str:
        """e.g. "4096 blocks x 16 tokens (1.61 GB)", for reprs and logs."""
        return f"{self.num_blocks} blocks x {self.block_size} tokens ({self.nbytes / 1e9:.3g} GB)"

    def __repr__(self) -> str:
        s = self.spec
        return (f"KVCache(num_blocks={self.num_blocks}, block_size={s.block_size}, "
                f"num_layers={s.num_layers}, num_kv_heads={s.num_kv_heads}, head_dim={s.head_dim}, "
                f"dtype={str(s.dtype).removeprefix('torch.')}, device={self.device}, "
                + ("" if self.kv_scales is None else "kv_scales=per layer, ")
                + f"free_blocks={self.num_free_blocks}, memory={self.nbytes / 1e9:.3g} GB)")

    # -- sequences -------------------------------------------------------------------------------
    def add_sequence(self, seq_id: int, token_ids: Sequence[int] | torch.Tensor) -> int:
        """Reserve a slot for each prompt token. Returns how many leading tokens are already in
        the prefix cache (a multiple of block_size, less than the prompt length): the step
        computes only the rest. Raises CacheFull (nothing changed) when blocks run out."""
        return self.manager.add_sequence(seq_id, token_ids)

    def append_tokens(self, seq_id: int, token_ids: Sequence[int] | torch.Tensor) -> None:
        """Reserve slots for more tokens of one sequence (e.g. a prefill chunk)."""
        copy_blocks(self, self.manager.append_tokens(seq_id, token_ids))

    def reserve(self, seq_id: int, num_tokens: int) -> None:
        """Reserve slots for tokens whose ids are not known yet (e.g. a whole generation up front).
        The sequence's blocks from here on enter the prefix cache only as name_reserved names
        their tokens."""
        copy_blocks(self, self.manager.reserve(seq_id, num_tokens))

    def name_reserved(self, seq_id: int, token_ids: Sequence[int] | torch.Tensor) -> None:
        """The ids of the sequence's next slots without ids (reserve), in order, once known and
        their K/V written (generate() after its call): the full blocks they complete enter the
        prefix cache. ValueError (nothing changed) for more ids than such slots, or an id < 0."""
        self.manager.name_reserved(seq_id, token_ids)

    def drop_prefix_cache(self) -> None:
        """Forget the K/V of every cached block no sequence holds: they are free blocks again and
        no prompt finds them (after the model's weights changed, e.g. through ``.data``)."""
        self.manager.drop_cached()

    def append_batch(self, seq_ids: Sequence[int] | torch.Tensor, token_ids: Sequence[int] | torch.Tensor) -> None:
        """Reserve one slot per sequence for a decode step (token_ids[i] for seq_ids[i]): all or
        nothing. A sequence that shares a partly filled last block gets a copy of it first.
        Ids and tokens: lists of ints or 1-D CPU int32/int64 tensors. A token of PENDING_TOKEN
        (-1) reserves the slot of a token sampled but not read back yet (the engine schedules a
        step ahead); set_pending_tokens names it, and the sequence takes no other append until
        then (nor does the block it fills enter the prefix cache)."""
        copy_blocks(self, self.manager.append_batch(seq_ids, token_ids))

    def set_pending_tokens(self, seq_ids: Sequence[int], token_ids: Sequence[int]) -> None:
        """The tokens of the slots append_batch reserved with PENDING_TOKEN, one per sequence,
        all or nothing."""
        self.manager.set_pending_tokens(seq_ids, token_ids)

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Give back the sequence's last num_tokens slots (speculative tokens a step rejected),
        num_tokens in [0, its length - 1]; their K/V are simply written again later. Blocks left
        empty go back to the free blocks and leave the prefix cache; a partly emptied block
        leaves it when the sequence next writes into it (or is copied first if shared)."""
        self.manager.truncate(seq_id, num_tokens)

    def release_out_of_window(self, seq_ids: Sequence[int], window: int) -> int:
        """Give back each sequence's leading blocks whose every token lies before position
        ``seq_len - window``: no later token attends to them when every layer of the model has a
        sliding window of at most ``window`` (>= 1) tokens. Call it only when all the sequences'
        slots belong to steps already queued on the device, and never for a model with a layer
        that sees the whole context. A cached full block stays in the prefix cache, as free()
        leaves it. The sequence keeps its length and positions; the released entries of its
        block table hold 0 (attention starts at the window, so never reads them), and truncate()
        or a step that would reach them is refused. Returns the blocks released; ValueError
        (nothing changed) for window < 1, a duplicate id, or a sequence with slots reserved
        without ids (reserve)."""
        return self.manager.release_out_of_window(seq_ids, window)

    def released_blocks(self, seq_id: int) -> int:
        """Leading blocks of the sequence that release_out_of_window gave back."""
        return self.manager.released_blocks(seq_id)

    def fork(self, parent_id: int, child_id: int) -> None:
        """A new sequence sharing all of the parent's tokens and blocks (copy-on-write)."""
        self.manager.fork(parent_id, child_id)

    def free(self, seq_id: int, keep_cached: bool = True) -> None:
        """Give the sequence's blocks back; its full blocks stay in the prefix cache until evicted
        (keep_cached=False: those no other sequence holds leave it, e.g. after a failed step whose
        K/V were never written)."""
        self.manager.free(seq_id, keep_cached)

    def free_all(self, keep_cached: bool = True) -> None:
        """free() every sequence the cache holds (a caller starting over)."""
        for seq_id in self.manager.sequence_ids():
            self.manager.free(seq_id, keep_cached)

    def seq_len(self, seq_id: int) -> int:
        """Tokens of the sequence holding a slot."""
        return self.manager.seq_len(seq_id)

    def block_table(self, seq_id: int) -> list[int]:
        return self.manager.block_table(seq_id)

    def has_sequence(self, seq_id: int) -> bool:
        return seq_id in self.manager

    # -- asking first ----------------------------------------------------------------------------
    def can_allocate(self, num_blocks: int) -> bool:
        return self.manager.can_allocate(num_blocks)

    def blocks_needed_to_add(self, token_ids: Sequence[int] | torch.Tensor) -> int:
        """Free blocks add_sequence would take (prefix-cache hits count only if revived)."""
        return self.manager.blocks_needed_to_add(token_ids)

    def blocks_needed_to_append(self, seq_ids: Sequence[int], num_tokens: int = 1) -> int:
        """Free blocks appending num_tokens to each sequence would take (copy-on-write included)."""
        return self.manager.blocks_needed_to_append(seq_ids, num_tokens)

    @property
    def max_step_tokens(self) -> int:
        """Most new tokens of one build_metadata call, padding included."""
        return self._max_step_tokens

    def step_capacity_fits(self, num_seqs: int, num_tokens: int) -> bool:
        """Whether one build_metadata call may hold num_seqs rows and num_tokens new tokens."""
        return num_seqs <= self._max_batch_size and num_tokens <= self._max_step_tokens

    # -- one step --------------------------------------------------------------------------------
    def build_metadata(
        self,
        seq_ids: Sequence[int],
        query_lens: Sequence[int] | None = None,
        padded_batch: int | None = None,
        pad_query_len: int = 1,
        padded_tokens: int | None = None,
    ) -> StepMetadata:
        """Metadata of one step over seq_ids, whose slots are already reserved. query_lens[i]:
        the new tokens of sequence i (its last ones); None for decode (1 each). padded_batch:
        rows including padding (a CUDA-graph bucket), default len(seq_ids), each padding row of
        pad_query_len tokens that attend to nothing and write nothing. padded_tokens: the token
        fields padded to this many (a CUDA graph of a step's tokens run as decode rows: rows of
        any lengths, tokens to a bucket), the ones past query_start_loc[padded_batch] of no row
        (slot -1, position 0). Built in C++ into a pinned buffer (the token padding written there
        by the host) and sent to the device in one non-blocking copy."""
        padded = len(seq_ids) if padded_batch is None else padded_batch
        if self._buffers is None:
            self._buffers = StepBuffers(self._layout, self.device)
        buffers = self._buffers
        buffers.wait_until_reusable()
        num_tokens, max_query_len, max_context_len = self.manager.build_step(
            buffers.layout, buffers.host, seq_ids, query_lens, padded, pad_query_len)
        if padded_tokens is not None and padded_tokens != num_tokens:
            if not num_tokens < padded_tokens <= self._max_step_tokens:
                raise ValueError(f"pagedkv: padded_tokens = {padded_tokens} must be in [{num_tokens}, "
                                 f"{self._max_step_tokens}] (the step's tokens with its padding rows', "
                                 "max_step_tokens)")
            buffers.pad_tokens(num_tokens, padded_tokens)
            num_tokens = padded_tokens
        buffers.upload(padded)
        return buffers.metadata(len(seq_ids), padded, num_tokens, max_query_len, max_context_len)
