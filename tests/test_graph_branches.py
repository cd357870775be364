"""runtime/graph_branches.py: a captured graph runs only the branch its device-side flag picks; the
warm-up (not capturing) runs both. Prompt lookup's captured rounds branch to a decode step when no
row proposes (runtime/lookup_rounds.py): the tokens and counts of unbranched rounds."""

from __future__ import annotations

import pytest
import torch

import pagedkv
from pagedkv.runtime import lookup_rounds
from pagedkv.runtime.graph_branches import branches_supported, run_branches
from pagedkv.runtime.model import PREPARED_ATTR
import test_lookup_rounds
from test_lookup_rounds import mixed_rows
from test_prompt_lookup import GREEDY, assert_cache_empty, batch, stats, walker


no_host_rounds = test_lookup_rounds.no_host_rounds  # the fixture


def needs_branches():
    if not branches_supported():
        pytest.skip(f"torch {torch.__version__} cannot capture CUDA graph conditional nodes")


def test_not_capturing_runs_both_branches():
    ran = []
    run_branches(torch.tensor(True), lambda: ran.append("if"), lambda: ran.append("else"))
    assert ran == ["if", "else"]


@pytest.mark.cuda
def test_a_captured_graph_runs_only_the_branch_its_flag_picks():
    needs_branches()
    flag = torch.zeros((), dtype=torch.bool, device="cuda")
    counts = torch.zeros(2, device="cuda")  # [2]: runs of the if branch, of the else branch

    def step():
        run_branches(flag, lambda: counts[0].add_(1), lambda: counts[1].add_(1))

    step()  # the warm-up runs both
    torch.cuda.synchronize()
    assert counts.tolist() == [1, 1]
    counts.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    torch.cuda.synchronize()
    assert counts.tolist() == [0, 0]  # capturing ran nothing
    for value, expected in ((True, [1, 0]), (False, [1, 1]), (False, [1, 2]), (True, [2, 2])):
        flag.fill_(value)
        graph.replay()
        torch.cuda.synchronize()
        assert counts.tolist() == expected, value


@pytest.mark.cuda
def test_branched_rounds_give_the_unbranched_rounds_tokens_and_counts(no_host_rounds, monkeypatch):
    """The noise row alone proposes nothing in its first rounds (its decode branch runs, which
    writes the round's `decoded` buffer); with the other rows, rounds mix both branches."""
    needs_branches()
    model = walker().to("cuda")
    rows = mixed_rows(model)
    rounds = getattr(model, PREPARED_ATTR).fixed_batch._lookup._rounds
    for subset in (rows[1:2], rows):
        ids, mask = batch(subset)
        ids, mask = ids.to("cuda"), mask.to("cuda")
        expected = pagedkv.generate(model, ids, attention_mask=mask, max_new_tokens=30, **GREEDY)
        runs = []
        for switch in ("0", "1"):
            monkeypatch.setenv(lookup_rounds.BRANCHES_SWITCH, switch)
            got = pagedkv.generate(model, ids, attention_mask=mask, max_new_tokens=30,
                                   prompt_lookup_num_tokens=4, **GREEDY)
            runs.append((got, stats(model)))
            assert torch.equal(got, expected), (len(subset), switch)
            assert_cache_empty(model)
        assert runs[0][1] == runs[1][1], runs
        decoded = {branched: state.decoded for (key, branched), (_, state, _) in rounds.items()
                   if key.rows == (1 if len(subset) == 1 else 4)}
        assert sorted(decoded) == [False, True]
        assert bool(decoded[True].any()) and not bool(decoded[False].any())


@pytest.mark.cuda
def test_sampled_rounds_do_not_branch():
    key = lookup_rounds.RoundKey(1, 5, 4, 4, 2, 0, (), do_sample=True)
    assert not lookup_rounds.branched_rounds_wanted(key, torch.device("cuda"))
    assert lookup_rounds.branched_rounds_wanted(lookup_rounds.RoundKey(1, 5, 4, 4, 2, 0, ()),
                                                torch.device("cuda")) == branches_supported()
