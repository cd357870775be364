"""lookup_propose and lookup_accept (one prompt-lookup round of generate()'s fixed batch kept on
the device) against the plain-PyTorch rule of tests/lookup_round_reference.py, on random rows:
histories over tiny vocabularies (n-grams repeat) and rows with no repeat, done and live rows
mixed, generated near max_new (caps cut proposals), positions past the block table, greedy tokens
that match a proposal fully, partly or not at all, EOS inside the accepted run."""

from __future__ import annotations

import pytest
import torch

import lookup_round_reference as reference
from conftest import DEVICES
from pagedkv import ops

ROWS = [1, 3, 9]
WIDTHS = [1, 2, 5, 12]
KS = [0, 1, 4, 10]
NGRAMS = [1, 2, 3]
BLOCK_SIZES = [1, 16]
MAX_NEW = 24
MAX_LENGTH = 300
OUTPUTS = ("feed", "proposal_lens", "positions", "slot_mapping", "context_lens")
STATE = ("history", "lengths", "generated", "done", "stats")


def random_state(rows, width, block_size, device, seed):
    """A round's inputs; every row picks a vocabulary (2 or 5 tokens: n-grams repeat; distinct
    tokens: no repeat), a length in [1, MAX_LENGTH] (1 and 2 often), a generated count near
    MAX_NEW for some rows, and done for about a quarter. The block table ends before the longest
    rows' positions. history past a row's length is garbage the ops must not read."""
    gen = torch.Generator().manual_seed(seed)
    width_room = max(width, 12)
    history = torch.randint(100, 200, (rows, MAX_LENGTH + width_room), generator=gen)
    lengths = torch.randint(1, MAX_LENGTH + 1, (rows,), generator=gen)
    short = torch.rand(rows, generator=gen) < 0.2
    lengths[short] = torch.randint(1, 3, (int(short.sum()),), generator=gen)
    for b in range(rows):
        kind = int(torch.randint(0, 3, (1,), generator=gen))
        length = int(lengths[b])
        if kind == 2:  # no token repeats: no n-gram matches
            history[b, :length] = torch.randperm(1000, generator=gen)[:length] + 1000
        else:
            history[b, :length] = torch.randint(0, 2 if kind else 5, (length,), generator=gen)
    generated = torch.randint(0, MAX_NEW, (rows,), generator=gen)
    near = torch.rand(rows, generator=gen) < 0.4
    generated[near] = MAX_NEW - torch.randint(1, 4, (int(near.sum()),), generator=gen)
    done = torch.rand(rows, generator=gen) < 0.25
    generated[done & (torch.rand(rows, generator=gen) < 0.5)] = MAX_NEW
    max_blocks = max(1, (MAX_LENGTH * 3 // 4) // block_size)
    block_tables = torch.randperm(rows * max_blocks + 7, generator=gen)[:rows * max_blocks]
    state = dict(history=history, lengths=lengths, generated=generated, done=done,
                 block_tables=block_tables.to(torch.int32).view(rows, max_blocks),
                 stats=torch.randint(0, 50, (rows, 3), generator=gen))
    return {name: t.to(device) for name, t in state.items()}


def poisoned_outputs(rows, width, device):
    return dict(feed=torch.full((rows, width), -7, dtype=torch.int64, device=device),
                proposal_lens=torch.full((rows,), -7, dtype=torch.int64, device=device),
                positions=torch.full((rows * width,), -7, dtype=torch.int32, device=device),
                slot_mapping=torch.full((rows * width,), -7, dtype=torch.int32, device=device),
                context_lens=torch.full((rows * width,), -7, dtype=torch.int32, device=device))


def per_row(max_new, state):
    """max_new_tokens for every row of state (the ops take one per row)."""
    return torch.full_like(state["lengths"], max_new)


def propose(state, out, k, max_ngram, block_size, max_new=MAX_NEW):
    ops.lookup_propose(state["history"], state["lengths"], state["generated"], state["done"],
                       state["block_tables"], out["feed"], out["proposal_lens"], out["positions"],
                       out["slot_mapping"], out["context_lens"], per_row(max_new, state), k, max_ngram, block_size)


def accept(state, out, greedy, eos_ids, max_new=MAX_NEW):
    ops.lookup_accept(greedy, out["feed"], out["proposal_lens"], eos_ids, state["history"],
                      state["lengths"], state["generated"], state["done"], state["stats"], per_row(max_new, state))


def expected_proposal(state, width, k, max_ngram, block_size, max_new=MAX_NEW):
    cpu = {name: t.cpu() for name, t in state.items()}
    return reference.propose(cpu["history"], cpu["lengths"], cpu["generated"], cpu["done"],
                             cpu["block_tables"], width, per_row(max_new, cpu), k, max_ngram, block_size)


def expected_accept(state, out, greedy, eos_ids, max_new=MAX_NEW):
    cpu = {name: t.cpu() for name, t in state.items()}
    return reference.accept(greedy.cpu(), out["feed"].cpu(), out["proposal_lens"].cpu(), eos_ids.cpu(),
                            cpu["history"], cpu["lengths"], cpu["generated"], cpu["done"], cpu["stats"],
                            per_row(max_new, cpu))


def random_greedy(out, seed):
    """Per row: the proposal fully matched, matched up to a random point, or not at all (tokens
    from the same small vocabularies, so the eos ids below occur inside accepted runs)."""
    gen = torch.Generator().manual_seed(seed)
    feed = out["feed"].cpu()
    rows, width = feed.shape
    greedy = torch.randint(0, 5, (rows, width), generator=gen)
    for b in range(rows):
        m = int(out["proposal_lens"][b])
        agree = [m, int(torch.randint(0, m + 1, (1,), generator=gen)), 0][int(torch.randint(0, 3, (1,), generator=gen))]
        greedy[b, :agree] = feed[b, 1:1 + agree]
        if agree < m:
            greedy[b, agree] = feed[b, 1 + agree] + 1  # the first disagreement
    return greedy.flatten().to(out["feed"].device)


def assert_equal(got, want, names):
    for name in names:
        assert torch.equal(got[name].cpu(), want[name]), f"{name}: {got[name].tolist()} != {want[name].tolist()}"


EOS = [[], [3], [1, 4]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("max_ngram", NGRAMS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_round_matches_reference(device, rows, width, k, max_ngram, block_size):
    seed = rows * 100_000 + width * 1000 + k * 100 + max_ngram * 10 + block_size
    state = random_state(rows, width, block_size, device, seed)
    out = poisoned_outputs(rows, width, device)
    want = expected_proposal(state, width, k, max_ngram, block_size)
    propose(state, out, k, max_ngram, block_size)
    assert_equal(out, want, OUTPUTS)

    eos_ids = torch.tensor(EOS[seed % 3], dtype=torch.int64, device=device)
    greedy = random_greedy(out, seed)
    want = expected_accept(state, out, greedy, eos_ids)
    accept(state, out, greedy, eos_ids)
    assert_equal(state, want, STATE)


def fake_model(feed, positions):
    """Greedy tokens that depend only on each fed token and its position (a deterministic stand-in
    for the verification forward): often the token after a repeat, so proposals get accepted."""
    return ((feed.flatten() * 3 + positions.long() // 7) % 5).to(feed.device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("width", [1, 5])
def test_rounds_in_a_row(device, width):
    """Rounds of propose -> fake verification -> accept equal the reference's, until every row
    is done (EOS or max_new: each round emits at least one token), as generate() runs them."""
    k, max_ngram, block_size, max_new = width - 1, 3, 16, 40
    state = random_state(6, width, block_size, device, seed=width)
    state["generated"].zero_()
    state["done"].zero_()
    state["done"][5] = True  # a padding row of the batch bucket
    state["lengths"].clamp_(max=MAX_LENGTH - max_new)
    eos_ids = torch.tensor([4], device=device)
    want = {name: t.cpu().clone() for name, t in state.items()}
    for _ in range(max_new):
        out = poisoned_outputs(6, width, device)
        propose(state, out, k, max_ngram, block_size, max_new)
        proposal = expected_proposal(want, width, k, max_ngram, block_size, max_new)
        assert_equal(out, proposal, OUTPUTS)
        greedy = fake_model(out["feed"], out["positions"])
        accept(state, out, greedy, eos_ids, max_new)
        want.update(reference.accept(greedy.cpu(), proposal["feed"], proposal["proposal_lens"], eos_ids.cpu(),
                                     want["history"], want["lengths"], want["generated"], want["done"],
                                     want["stats"], per_row(max_new, want)))
        assert_equal(state, want, STATE)
    assert bool(state["done"].all())


@pytest.mark.cuda
def test_captured_in_a_cuda_graph():
    """Both ops in one CUDA graph (no host sync, no allocation); a replay equals the reference."""
    width, k, max_ngram, block_size = 5, 4, 3, 16
    state = random_state(9, width, block_size, "cuda", seed=5)
    out = poisoned_outputs(9, width, "cuda")
    greedy = torch.zeros(9 * width, dtype=torch.int64, device="cuda")
    eos_ids = torch.tensor([3], device="cuda")
    start = {name: t.clone() for name, t in state.items()}
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        propose(state, out, k, max_ngram, block_size)
        greedy.copy_(fake_model(out["feed"], out["positions"]))
        accept(state, out, greedy, eos_ids)
    for name, t in start.items():
        state[name].copy_(t)
    graph.replay()
    torch.cuda.synchronize()
    proposal = expected_proposal(start, width, k, max_ngram, block_size)
    assert_equal(out, proposal, OUTPUTS)
    want = expected_accept(start, out, greedy, eos_ids)
    assert_equal(state, want, STATE)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    state = random_state(3, 5, 16, device, seed=1)
    out = poisoned_outputs(3, 5, device)
    torch.library.opcheck(torch.ops.pagedkv.lookup_propose.default,
                          (state["history"], state["lengths"], state["generated"], state["done"],
                           state["block_tables"], out["feed"], out["proposal_lens"], out["positions"],
                           out["slot_mapping"], out["context_lens"], per_row(MAX_NEW, state), 4, 3, 16))
    propose(state, out, 4, 3, 16)
    greedy = random_greedy(out, 1)
    torch.library.opcheck(torch.ops.pagedkv.lookup_accept.default,
                          (greedy, out["feed"], out["proposal_lens"], torch.tensor([3], device=device),
                           state["history"], state["lengths"], state["generated"], state["done"],
                           state["stats"], per_row(MAX_NEW, state)))


def test_bad_calls():
    state = random_state(3, 5, 16, "cpu", seed=2)
    out = poisoned_outputs(3, 5, "cpu")
    before = {name: t.clone() for name, t in {**state, **out}.items()}
    with pytest.raises(RuntimeError, match=r"history has dtype Int; it must be Long"):
        propose(dict(state, history=state["history"].int()), out, 4, 3, 16)
    with pytest.raises(RuntimeError, match=r"feed must have shape \[rows, width\] = \[3, width >= 1\]"):
        propose(state, dict(out, feed=out["feed"][:, :0]), 4, 3, 16)
    with pytest.raises(RuntimeError, match=r"slot_mapping must have shape \[rows \* width\] = \[15\]"):
        propose(state, dict(out, slot_mapping=out["slot_mapping"][:14]), 4, 3, 16)
    with pytest.raises(RuntimeError, match=r"done has dtype Long; it must be Bool"):
        propose(dict(state, done=state["done"].long()), out, 4, 3, 16)
    with pytest.raises(RuntimeError, match=r"max_new must have shape \[rows\] = \[3\]"):
        ops.lookup_propose(state["history"], state["lengths"], state["generated"], state["done"],
                           state["block_tables"], out["feed"], out["proposal_lens"], out["positions"],
                           out["slot_mapping"], out["context_lens"], state["lengths"][:2], 4, 3, 16)
    with pytest.raises(RuntimeError, match=r"history must have shape \[rows, max_length\] with max_length >= 1"):
        propose(dict(state, history=state["history"][:, :0]), out, 4, 3, 16)
    for k, max_ngram, block_size, match in [(-1, 3, 16, r"k must be >= 0, got -1"),
                                            (4, 0, 16, r"max_ngram must be >= 1, got 0"),
                                            (4, 3, 0, r"block_size must be >= 1, got 0")]:
        with pytest.raises(RuntimeError, match=match):
            propose(state, out, k, max_ngram, block_size)
    greedy = torch.zeros(15, dtype=torch.int64)
    eos_ids = torch.tensor([3])
    with pytest.raises(RuntimeError, match=r"greedy must have shape \[rows \* width\] = \[15\]"):
        accept(state, out, greedy[:10], eos_ids)
    with pytest.raises(RuntimeError, match=r"stats must have shape \[rows, 3\] = \[3, 3\]"):
        accept(dict(state, stats=state["stats"][:, :2].contiguous()), out, greedy, eos_ids)
    with pytest.raises(RuntimeError, match=r"eos_ids has dtype Int; it must be Long"):
        accept(state, out, greedy, eos_ids.int())
    for name, t in {**state, **out}.items():  # a refused call writes nothing
        assert torch.equal(t, before[name]), name
