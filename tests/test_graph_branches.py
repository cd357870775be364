"""runtime/graph_branches.py: a branched graph runs only the branch its device-side flag picks.
Prompt lookup's captured rounds branch to a decode step when no row proposes
(runtime/lookup_rounds.py): the tokens and counts of unbranched rounds."""

from __future__ import annotations

import pytest
import torch

import pagedkv
from pagedkv.runtime import lookup_rounds
from pagedkv.runtime.graph_branches import branches_supported
from pagedkv.runtime.graphs import CudaGraphs
from pagedkv.runtime.model import PREPARED_ATTR
import test_lookup_rounds
from test_lookup_rounds import mixed_rows
from test_prompt_lookup import GREEDY, assert_cache_empty, batch, stats, walker


no_host_rounds = test_lookup_rounds.no_host_rounds  # the fixture


def needs_branches():
    if not branches_supported():
        pytest.skip(f"this build or torch {torch.__version__} cannot branch graphs (graph_branches.branches_supported)")


@pytest.mark.cuda
def test_a_branched_graph_runs_only_the_branch_its_flag_picks():
    """The head copies a value the host sets into the flag; each replay runs the branch it
    picks, with the head's other writes before it. The warm-up ran all three once."""
    needs_branches()
    wanted = torch.zeros((), dtype=torch.bool, device="cuda")
    flag = torch.zeros((), dtype=torch.bool, device="cuda")
    counts = torch.zeros(3, device="cuda")  # [3]: runs of the head, of the if branch, of the else branch

    def head():
        flag.copy_(wanted)
        counts[0].add_(1)

    graphs = CudaGraphs("test")
    step = graphs.capture_branched("key", head, lambda: counts[1].add_(counts[0]),
                                   lambda: counts[2].add_(1), flag)
    torch.cuda.synchronize()
    assert counts.tolist() == [1, 1, 1]  # the warm-up; capturing ran nothing
    counts.zero_()
    for value, expected in ((True, [1, 1, 0]), (False, [2, 1, 1]), (False, [3, 1, 2]), (True, [4, 5, 2])):
        wanted.fill_(value)
        step.replay()
        torch.cuda.synchronize()
        assert counts.tolist() == expected, value
    assert graphs.get("key") is step


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


def test_sampled_rounds_do_not_branch():
    key = lookup_rounds.RoundKey(1, 5, 4, 4, 2, 0, (), True)
    assert not lookup_rounds.branched_rounds_wanted(key, torch.device("cuda"))
    greedy = lookup_rounds.RoundKey(1, 5, 4, 4, 2, 0, (), False)
    assert lookup_rounds.branched_rounds_wanted(greedy, torch.device("cuda")) == branches_supported()
    assert not lookup_rounds.branched_rounds_wanted(greedy, torch.device("cuda"), native=False)
