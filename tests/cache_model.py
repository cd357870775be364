"""A plain-Python model of the C++ cache manager, for the property tests: the same policy (free
stack, LRU of cached blocks freed last-block-first, prefix keys, copy-on-write) written as plainly
as possible. A prefix key here is the tuple of ALL tokens up to the block's end, so the model has
no hashing at all: it states what the chained hashes must mean."""

from __future__ import annotations

from dataclasses import dataclass, field


class ModelCacheFull(Exception):
    pass


@dataclass
class ModelSequence:
    tokens: list[int | None]  # None: a slot reserved for a token not known yet
    blocks: list[int] = field(default_factory=list)
    keyable: bool = True  # False once slots were reserved without token ids


class CacheModel:
    def __init__(self, num_blocks: int, block_size: int, max_seq_len: int, prefix_caching: bool):
        self.bs = block_size
        self.max_seq_len = max_seq_len
        self.prefix_caching = prefix_caching
        self.ref = [0] * num_blocks
        self.free_stack = list(range(num_blocks - 1, -1, -1))
        self.lru: list[int] = []  # oldest first
        self.key_of: dict[int, tuple[int, ...]] = {}
        self.block_of: dict[tuple[int, ...], int] = {}
        self.seqs: dict[int, ModelSequence] = {}

    # -- blocks --------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free_stack) + len(self.lru)

    def allocate(self) -> int:
        if self.free_stack:
            block = self.free_stack.pop()
        else:
            block = self.lru.pop(0)
            del self.block_of[self.key_of.pop(block)]
        self.ref[block] = 1
        return block

    def add_ref(self, block: int) -> None:
        if self.ref[block] == 0:
            self.lru.remove(block)
        self.ref[block] += 1

    def release(self, block: int) -> None:
        self.ref[block] -= 1
        if self.ref[block] == 0:
            (self.lru if block in self.key_of else self.free_stack).append(block)

    def register(self, block: int, key: tuple[int, ...]) -> None:
        if self.prefix_caching and key not in self.block_of:
            self.block_of[key] = block
            self.key_of[block] = key

    def blocks_for(self, n: int) -> int:
        return -(-n // self.bs)

    # -- sequences -----------------------------------------------------------------------------
    def plan_add(self, tokens: list[int]) -> tuple[list[int], int]:
        """(cached blocks reused, free blocks needed); raises ValueError like the C++ checks."""
        n = len(tokens)
        if n < 1 or n > self.max_seq_len or self.blocks_for(n) > len(self.ref):
            raise ValueError("bad prompt")
        hits = []
        if self.prefix_caching:
            for i in range((n - 1) // self.bs):
                block = self.block_of.get(tuple(tokens[: (i + 1) * self.bs]))
                if block is None:
                    break
                hits.append(block)
        revived = sum(self.ref[b] == 0 for b in hits)
        return hits, self.blocks_for(n) - len(hits) + revived

    def add(self, seq_id: int, tokens: list[int]) -> int:
        if seq_id in self.seqs:
            raise ValueError("id in use")
        hits, needed = self.plan_add(tokens)
        if needed > self.num_free:
            raise ModelCacheFull
        seq = ModelSequence(list(tokens))
        for block in hits:
            self.add_ref(block)
            seq.blocks.append(block)
        while len(seq.blocks) < self.blocks_for(len(tokens)):
            seq.blocks.append(self.allocate())
        for i in range(len(hits), len(tokens) // self.bs):
            self.register(seq.blocks[i], tuple(tokens[: (i + 1) * self.bs]))
        self.seqs[seq_id] = seq
        return len(hits) * self.bs

    def plan_append(self, seq_ids: list[int], n: int) -> tuple[list[bool], int]:
        """(copy-on-write per sequence, free blocks needed) for n more tokens each."""
        moved_off: dict[int, int] = {}
        copies, needed, seen = [], 0, set()
        for sid in seq_ids:
            seq = self.seqs[sid]  # KeyError like C++
            if sid in seen:
                raise ValueError("duplicate id")
            seen.add(sid)
            if len(seq.tokens) + n > self.max_seq_len:
                raise ValueError("too long")
            copy = False
            if n > 0 and len(seq.tokens) % self.bs:
                last = seq.blocks[-1]
                copy = self.ref[last] - moved_off.get(last, 0) > 1
                moved_off[last] = moved_off.get(last, 0) + copy
            copies.append(copy)
            needed += copy + self.blocks_for(len(seq.tokens) + n) - self.blocks_for(len(seq.tokens))
        return copies, needed

    def reserve(self, seq_id: int, n: int) -> list[tuple[int, int]]:
        self.seqs[seq_id]  # an unknown id is a KeyError before a bad count, as in C++
        if n < 0:
            raise ValueError("negative count")
        return self.append([seq_id], [[None] * n])

    def append(self, seq_ids: list[int], tokens_per_seq: list[list[int | None]]) -> list[tuple[int, int]]:
        copy_flags, needed = self.plan_append(seq_ids, len(tokens_per_seq[0]) if tokens_per_seq else 0)
        if needed > self.num_free:
            raise ModelCacheFull
        copies = []
        for sid, copy, tokens in zip(seq_ids, copy_flags, tokens_per_seq):
            seq = self.seqs[sid]
            if copy:
                src, dst = seq.blocks[-1], self.allocate()
                self.release(src)
                seq.blocks[-1] = dst
                copies.append((src, dst))
            elif tokens and len(seq.tokens) % self.bs:  # its own reopened block gets other tokens
                self.unregister_if_last_owner(seq.blocks[-1])
            seq.keyable = seq.keyable and None not in tokens
            for token in tokens:
                if len(seq.tokens) % self.bs == 0:
                    seq.blocks.append(self.allocate())
                seq.tokens.append(token)
                if len(seq.tokens) % self.bs == 0 and seq.keyable:
                    self.register(seq.blocks[-1], tuple(seq.tokens))
        return copies

    def fork(self, parent_id: int, child_id: int) -> None:
        parent = self.seqs[parent_id]
        if child_id in self.seqs:
            raise ValueError("id in use")
        for block in parent.blocks:
            self.add_ref(block)
        self.seqs[child_id] = ModelSequence(list(parent.tokens), list(parent.blocks), parent.keyable)

    def truncate(self, seq_id: int, n: int) -> None:
        """The last n slots go: emptied blocks leave the prefix cache as they are released; a
        reopened block keeps its key until append writes into it (model.append)."""
        seq = self.seqs[seq_id]
        if not 0 <= n < len(seq.tokens):
            raise ValueError("bad count")
        kept = len(seq.tokens) - n
        keep_blocks = self.blocks_for(kept)
        for block in reversed(seq.blocks[keep_blocks:]):
            self.unregister_if_last_owner(block)
            self.release(block)
        del seq.blocks[keep_blocks:], seq.tokens[kept:]
        seq.keyable = None not in seq.tokens

    def unregister_if_last_owner(self, block: int) -> None:
        if self.ref[block] == 1 and block in self.key_of:
            del self.block_of[self.key_of.pop(block)]

    def free(self, seq_id: int, keep_cached: bool = True) -> None:
        seq = self.seqs.pop(seq_id)
        for block in reversed(seq.blocks):
            if not keep_cached:
                self.unregister_if_last_owner(block)
            self.release(block)
