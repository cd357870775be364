"""Fuzzing the C++ cache manager: thousands of seeded random operation sequences (add, prefix
hits on live and freed prompts, append, reserve, append_batch, fork, truncate, free (keeping its blocks in
the prefix cache or not), blocks_needed_*, step
metadata, and bad calls: unknown, duplicate and reused ids, too long, negative counts), each
compared after every operation with the Python model (cache_model.py) and checked for
consistency; a refused or CacheFull call must change nothing (the model does not change, and
the manager must still equal it). test_cache_properties.py explores the same operations with
Hypothesis's rule-based shrinking; these runs are cheaper, so there are many more of them.

PAGEDKV_FUZZ_EXAMPLES: sequences (default 4000, under 10 s); PAGEDKV_FUZZ_STEPS: operations per
sequence (default 60). A failure names its seed: fuzz_run(seed) replays it."""

from __future__ import annotations

import os
import random

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache_checks import check_agrees, check_consistent, check_step, expect_same_outcome, free_all_and_check
from cache_model import CacheModel
from pagedkv import _C

EXAMPLES = int(os.environ.get("PAGEDKV_FUZZ_EXAMPLES", "4000"))
STEPS = int(os.environ.get("PAGEDKV_FUZZ_STEPS", "60"))
OPENINGS = [[], [7] * 9, [7] * 4 + [1, 2, 3, 1, 2, 3, 1, 2], [5, 6] * 5]


def fuzz_run(seed: int, steps: int = STEPS) -> dict[str, int]:
    """One random sequence of operations; returns how often each outcome happened."""
    rng = random.Random(seed)
    max_seq_len = rng.choice([8, 24, 40])
    block_size = rng.choice([1, 2, 4, 8, 16])
    num_blocks = rng.randint(max(1, -(-max_seq_len // block_size) // 2), 24)
    prefix_caching = rng.random() < 0.7
    real = _C.CacheManager(num_blocks, block_size, max_seq_len, prefix_caching)
    model = CacheModel(num_blocks, block_size, max_seq_len, prefix_caching)
    layout = _C.StepLayout(8, 8 * max_seq_len, real.max_blocks_per_seq)
    buffer = torch.zeros(layout.size, dtype=torch.int32)
    outcomes: dict[str, int] = {}
    next_id = 0

    def note(what: str) -> None:
        outcomes[what] = outcomes.get(what, 0) + 1

    def tokens(n: int) -> list[int]:
        return [rng.randint(0, 3) for _ in range(n)]

    def some_id() -> int:
        live = sorted(model.seqs)
        r = rng.random()
        if not live or r < 0.04:
            return rng.choice([-1, next_id + 5])  # unknown
        if r < 0.08 and next_id:
            return rng.randrange(next_id)  # maybe freed already
        return rng.choice(live)

    for _ in range(steps):
        op = rng.random() if model.seqs else 0.0
        seq_id = some_id()
        if op < 0.20:  # a new prompt, often with a shared opening; sometimes empty or too long
            new = next_id if rng.random() < 0.95 else seq_id  # sometimes an id in use
            next_id += 1
            n = rng.randint(1, max_seq_len) if rng.random() < 0.95 else rng.choice([0, max_seq_len + 1])
            prompt = (rng.choice(OPENINGS) + tokens(max_seq_len + 1))[:n]
            if expect_same_outcome(lambda: model.add(new, prompt), lambda: real.add_sequence(new, prompt), note):
                note("prefix hit")
        elif op < 0.28 and seq_id in model.seqs:  # after a live prefix: hits on live blocks
            known = model.seqs[seq_id].tokens
            known = known[:known.index(None)] if None in known else known
            prompt = known[:rng.randint(0, len(known))] + tokens(rng.randint(0, 6))
            new, next_id = next_id, next_id + 1
            if expect_same_outcome(lambda: model.add(new, prompt), lambda: real.add_sequence(new, prompt), note):
                note("prefix hit on a live sequence")
        elif op < 0.40:
            more = tokens(rng.randint(0, max_seq_len // 4 + 1))
            if expect_same_outcome(lambda: model.append([seq_id], [more]),
                                   lambda: [tuple(c) for c in real.append_tokens(seq_id, more)], note):
                note("copy-on-write")
        elif op < 0.48:
            n = rng.randint(0, max_seq_len // 4 + 1) if rng.random() < 0.95 else -1
            expect_same_outcome(lambda: model.reserve(seq_id, n),
                                lambda: [tuple(c) for c in real.reserve(seq_id, n)], note)
        elif op < 0.62:
            ids = rng.sample(sorted(model.seqs), rng.randint(0, min(6, len(model.seqs))))
            ids += [seq_id] if rng.random() < 0.1 else []  # maybe unknown or twice
            toks = tokens(len(ids))
            if ids and expect_same_outcome(lambda: model.append(ids, [[t] for t in toks]),
                                           lambda: [tuple(c) for c in real.append_batch(ids, toks)], note):
                note("copy-on-write in a batch")
        elif op < 0.68:
            ids = rng.sample(sorted(model.seqs), min(len(model.seqs), rng.randint(1, 4))) or [seq_id]
            n = rng.randint(0, 9)
            expect_same_outcome(lambda: model.plan_append(ids, n)[1],
                                lambda: real.blocks_needed_to_append(ids, n), note)
            prompt = (rng.choice(OPENINGS[1:]) + tokens(rng.randint(0, 6)))[:max_seq_len]
            expect_same_outcome(lambda: model.plan_add(prompt)[1], lambda: real.blocks_needed_to_add(prompt), note)
        elif op < 0.78:
            child = seq_id if rng.random() < 0.1 else next_id  # sometimes into an id in use
            next_id += 1
            expect_same_outcome(lambda: model.fork(seq_id, child), lambda: real.fork(seq_id, child), note)
        elif op < 0.84:  # speculative tokens rejected: the last n slots go
            n = rng.randint(0, len(model.seqs[seq_id].tokens)) if seq_id in model.seqs else 1
            valid = seq_id in model.seqs and 0 < n < len(model.seqs[seq_id].tokens)
            expect_same_outcome(lambda: model.truncate(seq_id, n), lambda: real.truncate(seq_id, n), note)
            if valid:
                note("truncated")
        elif op < 0.92:  # keep_cached=False: as after a failed step
            keep = rng.random() < 0.8
            expect_same_outcome(lambda: model.free(seq_id, keep), lambda: real.free(seq_id, keep), note)
        elif model.seqs:
            ids = rng.sample(sorted(model.seqs), rng.randint(1, min(6, len(model.seqs))))
            lens = [rng.randint(1, len(model.seqs[s].tokens)) for s in ids]
            check_step(real, model, layout, buffer, ids, lens, rng.randint(len(ids), 8))
        check_agrees(real, model)
        check_consistent(real)
    free_all_and_check(real)
    return outcomes


@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1))
def test_random_operation_sequences(seed):
    fuzz_run(seed)


def test_fuzz_reaches_every_outcome():
    """The runs above are not vacuous: over a few hundred seeds every path is taken."""
    total: dict[str, int] = {}
    for seed in range(200):
        for what, n in fuzz_run(seed).items():
            total[what] = total.get(what, 0) + n
    for what in ["done", "cache full", "refused: KeyError", "refused: ValueError", "prefix hit",
                 "prefix hit on a live sequence", "copy-on-write", "copy-on-write in a batch", "truncated"]:
        assert total.get(what, 0) > 10, f"{what}: {total}"
