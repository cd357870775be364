"""Types of the compiled module pagedkv._C (csrc/bindings.cpp, csrc/cache_bindings.cpp)."""

from typing import Sequence, Union

import torch

# Ids and tokens: a list of ints or a 1-D CPU int32/int64 tensor.
Ints = Union[Sequence[int], torch.Tensor]

build_info: str
with_cuda: bool

class CacheFull(RuntimeError):
    """Not enough free blocks for the operation; nothing was changed."""

class StepLayout:
    """Offsets (int32 elements, 64-byte aligned) of each field in one packed step buffer:
    context_lens [max_batch], query_start_loc [max_batch + 1], slot_mapping [max_tokens],
    positions [max_tokens], block_tables [max_batch, max_blocks_per_seq] (last)."""

    def __init__(self, max_batch: int, max_tokens: int, max_blocks_per_seq: int) -> None: ...
    @property
    def max_batch(self) -> int: ...
    @property
    def max_tokens(self) -> int: ...
    @property
    def max_blocks_per_seq(self) -> int: ...
    @property
    def context_lens(self) -> int: ...
    @property
    def query_start_loc(self) -> int: ...
    @property
    def slot_mapping(self) -> int: ...
    @property
    def positions(self) -> int: ...
    @property
    def block_tables(self) -> int: ...
    @property
    def size(self) -> int:
        """Elements of the whole buffer."""
    def used_size(self, padded_batch: int) -> int:
        """Elements from the start to the end of padded_batch (in [0, max_batch]) block-table rows."""

class CacheManager:
    """Block bookkeeping of the paged KV cache (torch-free C++). Failed calls change nothing.
    Raises CacheFull (out of blocks), KeyError (unknown sequence id), ValueError (bad call, or
    a count or id out of range: sequence ids are any int64, token ids in [0, 2**31), counts
    never wrap), TypeError (a bool or a non-int where a count or an id goes)."""

    def __init__(self, num_blocks: int, block_size: int, max_seq_len: int,
                 enable_prefix_caching: bool = True) -> None: ...
    def add_sequence(self, seq_id: int, token_ids: Ints) -> int:
        """Returns the number of leading prompt tokens found in the prefix cache."""
    def append_tokens(self, seq_id: int, token_ids: Ints) -> list[tuple[int, int]]:
        """Returns the (src, dst) block copies to do on the device first (copy-on-write)."""
    def reserve(self, seq_id: int, num_tokens: int) -> list[tuple[int, int]]:
        """Slots for tokens not known yet; the sequence's later blocks are prefix-cached only as
        name_reserved names their tokens."""
    def name_reserved(self, seq_id: int, token_ids: Ints) -> None:
        """The ids of the next slots without ids (reserve), once known and their K/V written:
        the full blocks they complete enter the prefix cache."""
    def drop_cached(self) -> None:
        """Every cached block no sequence holds leaves the prefix cache (stale K/V)."""
    def append_batch(self, seq_ids: Ints, token_ids: Ints) -> list[tuple[int, int]]:
        """One token per sequence, all or nothing; -1 reserves a slot whose token comes later."""
    def set_pending_tokens(self, seq_ids: Ints, token_ids: Ints) -> None:
        """The tokens of slots append_batch reserved with -1, all or nothing."""
    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Give back the last num_tokens slots, in [0, its length - 1]."""
    def release_out_of_window(self, seq_ids: Ints, window: int) -> int:
        """Give back leading blocks wholly before seq_len - window (window >= 1); the count."""
    def released_blocks(self, seq_id: int) -> int: ...
    def fork(self, parent_id: int, child_id: int) -> None: ...
    def free(self, seq_id: int, keep_cached: bool = True) -> None: ...
    def blocks_needed_to_add(self, token_ids: Ints) -> int: ...
    def blocks_needed_to_append(self, seq_ids: Ints, num_tokens: int = 1) -> int:
        """num_tokens in [0, max_seq_len], checked even for no sequence."""
    def can_allocate(self, num_blocks: int) -> bool:
        """num_blocks >= 0."""
    def seq_len(self, seq_id: int) -> int: ...
    def block_table(self, seq_id: int) -> list[int]: ...
    def __contains__(self, seq_id: int) -> bool:
        """False for an int past int64 (no sequence has it)."""
    def __len__(self) -> int: ...
    def sequence_ids(self) -> list[int]: ...
    def ref_count(self, block: int) -> int: ...
    def evictable_blocks(self) -> list[int]:
        """Cached blocks with no owner, in eviction order (least recently freed first)."""
    @property
    def num_blocks(self) -> int: ...
    @property
    def num_free_blocks(self) -> int:
        """Never-used or unkeyed free blocks plus evictable cached ones."""
    @property
    def num_evictable_blocks(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def max_seq_len(self) -> int: ...
    @property
    def max_blocks_per_seq(self) -> int: ...
    @property
    def enable_prefix_caching(self) -> bool: ...
    def build_step(self, layout: StepLayout, buffer: torch.Tensor, seq_ids: Ints,
                   query_lens: Ints | None, padded_batch: int, pad_query_len: int = 1) -> tuple[int, int, int]:
        """Writes one step's metadata into buffer (CPU int32, layout.size elements), padding rows
        of pad_query_len tokens; returns (num_tokens, max_query_len, max_context_len)."""


class BranchedGraph:
    """A CUDA build's conditional graph (csrc/cuda/graph_branch.cpp, runtime/graph_branches.py)."""

    def __init__(self, head: int, if_true: int, if_false: int, flag: torch.Tensor) -> None: ...
    def replay(self) -> None: ...
