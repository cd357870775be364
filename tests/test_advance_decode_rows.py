"""advance_decode_rows (one decode step on for generate()'s fixed batch) against the same update
in plain PyTorch ops, on random rows: live and padding rows, positions that cross a block
boundary, and positions past the row's table."""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICES
from pagedkv import ops

BATCHES = [1, 3, 8, 33, 300]  # 300: more rows than one CUDA thread block
BLOCK_SIZES = [1, 16, 128]
MAX_BLOCKS = [1, 4]


def random_rows(batch, block_size, max_blocks, device, seed):
    """Every field random; a quarter of the rows padding (context 0), some positions at the last
    slot of a block (the step crosses into the next) or of the table (the next one is past it)."""
    gen = torch.Generator().manual_seed(seed)
    capacity = block_size * max_blocks
    positions = torch.randint(0, capacity, (batch,), generator=gen, dtype=torch.int32)
    edge = torch.rand(batch, generator=gen) < 0.3
    positions[edge] = (positions[edge] // block_size + 1) * block_size - 1
    live = torch.rand(batch, generator=gen) < 0.75
    rows = dict(
        # -1: a sampled row with NaN/inf logits (ops.sample); it feeds token 0
        next_tokens=torch.where(torch.rand(batch, generator=gen) < 0.1, -1,
                                torch.randint(0, 150_000, (batch,), generator=gen)),
        tokens=torch.randint(0, 150_000, (batch,), generator=gen),
        positions=torch.where(live, positions, torch.zeros_like(positions)),
        context_lens=torch.where(live, positions + 1, torch.zeros_like(positions)),
        generated=torch.randint(0, 100, (batch,), generator=gen, dtype=torch.int32),
        offsets=torch.randint(0, 2**40, (batch,), generator=gen),
        slot_mapping=torch.randint(-1, 1000, (batch,), generator=gen, dtype=torch.int32),
        block_tables=torch.randperm(batch * max_blocks, generator=gen).to(torch.int32).view(batch, max_blocks),
    )
    return {name: t.to(device) for name, t in rows.items()}


def reference(rows, block_size):
    """The update in PyTorch ops (what DecodeState.advance ran before the fused op)."""
    out = {name: t.clone() for name, t in rows.items()}
    live = (out["context_lens"] > 0).to(torch.int32)
    out["tokens"].copy_(out["next_tokens"].clamp(min=0))
    for name in ("positions", "context_lens", "generated"):
        out[name].add_(live)
    out["offsets"].add_(1)
    pos = out["positions"].long()
    block_index = pos // block_size
    in_table = block_index < out["block_tables"].shape[1]
    block = out["block_tables"].gather(1, block_index.clamp(max=out["block_tables"].shape[1] - 1).unsqueeze(1))
    slots = block.squeeze(1) * block_size + out["positions"] % block_size
    keep = (out["context_lens"] > 0) & in_table
    out["slot_mapping"] = torch.where(keep, slots, torch.full_like(slots, -1)).to(torch.int32)
    return out


def advance(rows, block_size):
    ops.advance_decode_rows(rows["next_tokens"], rows["tokens"], rows["positions"], rows["context_lens"],
                            rows["generated"], rows["offsets"], rows["slot_mapping"], rows["block_tables"],
                            block_size)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("max_blocks", MAX_BLOCKS)
def test_matches_pytorch(device, batch, block_size, max_blocks):
    rows = random_rows(batch, block_size, max_blocks, device, seed=batch * 1000 + block_size + max_blocks)
    expected = reference(rows, block_size)
    advance(rows, block_size)
    for name, want in expected.items():
        assert torch.equal(rows[name], want), f"{name}: {rows[name].tolist()} != {want.tolist()}"


@pytest.mark.parametrize("device", DEVICES)
def test_steps_accumulate(device):
    """Ten steps in a row equal ten steps of the reference (what generate() runs)."""
    rows = random_rows(8, 16, 4, device, seed=7)
    rows["positions"] //= 4  # room for ten steps inside the table
    rows["context_lens"] = torch.where(rows["context_lens"] > 0, rows["positions"] + 1,
                                       torch.zeros_like(rows["positions"]))
    expected = {name: t.clone() for name, t in rows.items()}
    for step in range(10):
        next_tokens = torch.full_like(rows["next_tokens"], step)
        rows["next_tokens"].copy_(next_tokens)
        expected["next_tokens"].copy_(next_tokens)
        expected = reference(expected, 16)
        advance(rows, 16)
    for name, want in expected.items():
        assert torch.equal(rows[name], want), name


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    rows = random_rows(5, 16, 2, device, seed=1)
    args = (rows["next_tokens"], rows["tokens"], rows["positions"], rows["context_lens"],
            rows["generated"], rows["offsets"], rows["slot_mapping"], rows["block_tables"], 16)
    torch.library.opcheck(torch.ops.pagedkv.advance_decode_rows.default, args)


def test_bad_calls():
    rows = random_rows(4, 16, 2, "cpu", seed=2)
    bad = dict(rows, positions=rows["positions"].long())
    with pytest.raises(RuntimeError, match=r"positions has dtype Long; it must be Int"):
        advance(bad, 16)
    bad = dict(rows, offsets=rows["offsets"][:3])
    with pytest.raises(RuntimeError, match=r"offsets must have shape \[batch\] = \[4\]"):
        advance(bad, 16)
    bad = dict(rows, block_tables=rows["block_tables"].flatten())
    with pytest.raises(RuntimeError, match=r"block_tables must have shape \[batch, max_blocks\]"):
        advance(bad, 16)
    with pytest.raises(RuntimeError, match=r"block_size must be > 0, got 0"):
        advance(rows, 0)
    before = {name: t.clone() for name, t in rows.items()}
    with pytest.raises(RuntimeError):
        advance(dict(rows, tokens=rows["tokens"].to(torch.int32)), 16)
    for name, t in before.items():  # a refused call writes nothing
        assert torch.equal(rows[name], t), name
