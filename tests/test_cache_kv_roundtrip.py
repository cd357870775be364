"""K/V written through slot_mapping read back through block_tables (plain torch indexing) equal
what each sequence wrote, over ragged batches of prefills (with prefix-cache hits) and decode
steps, with forks (copy-on-write) and frees in between.

Each token's K/V is a function of its whole prefix, so a prefix hit that handed a sequence
another prompt's block, or a copy that missed a layer, shows up as a wrong value."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import DEVICES
from pagedkv import KVCache, StepMetadata

BLOCK_SIZES = [1, 4, 16]
DTYPES = [torch.float32, torch.bfloat16]
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 8


def expected_kv(tokens: list[int], dtype, device) -> torch.Tensor:
    """[layers, 2 (K, V), len(tokens), kv_heads, head_dim]: position p's values from tokens[:p+1]."""
    keys, h = [], 0
    for t in tokens:
        h = (h * 1_000_003 + t + 1) % 2_147_483_647
        keys.append(h)
    prefix = torch.tensor(keys, dtype=torch.float64)[None, None, :, None, None]
    lane = torch.arange(1, LAYERS * 2 * KV_HEADS * HEAD_DIM + 1, dtype=torch.float64)
    lane = lane.view(LAYERS, 2, 1, KV_HEADS, HEAD_DIM)
    return torch.sin(prefix * 1e-3 + lane).to(dtype=dtype, device=device)


def write_step(cache: KVCache, meta: StepMetadata, new_kv: torch.Tensor) -> None:
    """What the RoPE + KV-write kernel does: new_kv [layers, 2, num_tokens, kv_heads, head_dim]
    into the slots of slot_mapping, skipping padding (-1)."""
    flat = cache.kv.view(LAYERS, 2, -1, KV_HEADS, HEAD_DIM)  # [layers, 2, num_slots, heads, dim]
    slots = meta.slot_mapping.long()
    real = slots >= 0
    flat[:, :, slots[real]] = new_kv[:, :, real]


def read_context(cache: KVCache, meta: StepMetadata, row: int) -> torch.Tensor:
    """What paged attention reads for one row: [layers, 2, context_len, kv_heads, head_dim]."""
    n = int(meta.context_lens[row])
    blocks = meta.block_tables[row, : -(-n // cache.block_size)].long()
    kv = cache.kv[:, :, blocks]  # [layers, 2, num_blocks, block_size, heads, dim]
    return kv.flatten(2, 3)[:, :, :n]


class Scenario:
    """Sequences' tokens kept beside the cache; each step writes the new tokens' K/V and checks
    every scheduled row reads back exactly its own history."""

    def __init__(self, cache: KVCache, rng: random.Random):
        self.cache, self.rng = cache, rng
        self.tokens: dict[int, list[int]] = {}
        self.next_id = 0

    def step(self, seq_ids: list[int], query_lens: list[int] | None, padded_batch: int | None = None):
        meta = self.cache.build_metadata(seq_ids, query_lens, padded_batch)
        new_kv, qsl = [], meta.query_start_loc.tolist()
        for row, seq_id in enumerate(seq_ids):
            toks = self.tokens[seq_id]
            q = qsl[row + 1] - qsl[row]
            assert meta.positions[qsl[row]: qsl[row + 1]].tolist() == list(range(len(toks) - q, len(toks)))
            new_kv.append(expected_kv(toks, self.cache.spec.dtype, self.cache.device)[:, :, len(toks) - q:])
        pad = meta.num_tokens - qsl[len(seq_ids)]
        poison = torch.full((LAYERS, 2, pad, KV_HEADS, HEAD_DIM), float("nan"), dtype=self.cache.spec.dtype,
                            device=self.cache.device)
        write_step(self.cache, meta, torch.cat(new_kv + [poison], dim=2))
        for row, seq_id in enumerate(seq_ids):
            got = read_context(self.cache, meta, row)
            assert torch.equal(got, expected_kv(self.tokens[seq_id], self.cache.spec.dtype, self.cache.device)), (
                f"sequence {seq_id} reads back other K/V than it wrote")

    def add(self, prompt: list[int]) -> tuple[int, int]:
        seq_id, self.next_id = self.next_id, self.next_id + 1
        cached = self.cache.add_sequence(seq_id, prompt)
        self.tokens[seq_id] = list(prompt)
        return seq_id, len(prompt) - cached

    def append(self, seq_ids: list[int]) -> None:
        new = [self.rng.randrange(50) for _ in seq_ids]
        self.cache.append_batch(seq_ids, new)
        for seq_id, t in zip(seq_ids, new):
            self.tokens[seq_id].append(t)

    def fork(self, parent: int) -> int:
        child, self.next_id = self.next_id, self.next_id + 1
        self.cache.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        return child

    def free(self, seq_id: int) -> None:
        self.cache.free(seq_id)
        del self.tokens[seq_id]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_kv_round_trip_over_prefills_decodes_forks_and_prefix_hits(device, dtype, block_size):
    rng = random.Random(block_size)
    cache = KVCache(LAYERS, KV_HEADS, HEAD_DIM, dtype=dtype, block_size=block_size, num_blocks=4096 // block_size,
                    device=device, max_seq_len=256, max_batch_size=16)
    cache.kv.fill_(float("nan"))  # a slot read before it was written fails the comparison
    run = Scenario(cache, rng)
    system = [rng.randrange(50) for _ in range(37)]
    cached_system = 37 // block_size * block_size  # full blocks of the shared opening

    # A ragged prefill batch.
    first = [run.add([rng.randrange(50) for _ in range(n)]) for n in (1, 5, 23)]
    run.step([s for s, _ in first], [q for _, q in first])
    # Two prompts with one opening in one step: the second hits blocks the first reserved in the
    # same step (their K/V are written before attention reads them).
    sharing = [run.add(system), run.add(system + [50, 51, 52])]
    assert [q for _, q in sharing] == [37, 40 - cached_system]
    run.step([s for s, _ in sharing], [q for _, q in sharing])
    running = [s for s, _ in first + sharing]

    for i in range(20):
        if i == 4:  # fork mid-block: the next writes of parent and child copy the shared block
            running += [run.fork(running[1]), run.fork(running[3])]
        if i == 9:
            run.free(running.pop(0))
        if i == 12:  # a prefix hit prefilled in the same step as everyone's decode
            seq_id, q = run.add(system + [53, 54, 55, 56])
            assert q == 41 - cached_system
            run.append(running)
            run.step(running + [seq_id], [1] * len(running) + [q], padded_batch=16)
            running.append(seq_id)
            continue
        run.append(running)
        run.step(running, None, padded_batch=16 if i % 3 == 0 else None)
    for seq_id in list(run.tokens):
        run.free(seq_id)
    assert cache.num_free_blocks == cache.num_blocks
