"""paged_decode_attention's row_order (CUDA launch order of the rows' CTAs: longest contexts
first) changes no output, eagerly and under CUDA-graph replay, with and without splits; and the
decode layer sets it from the context lengths only where the CTAs fill several waves."""

from __future__ import annotations

import pytest
import torch

from pagedkv import ops
from pagedkv.layers.attention import ForwardMetadata, attention_workspace
from test_paged_decode_attention import make_paged_cache


def _ragged(batch: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 700, (batch,), generator=g).tolist()


@pytest.mark.cuda
@pytest.mark.parametrize("batch, num_splits", [(7, 1), (300, 0), (300, 3)])
def test_row_order_changes_no_output(batch, num_splits):
    lens_list = _ragged(batch)
    lens_list[batch // 2] = 0  # a padding row: zeros wherever it is launched
    k_cache, v_cache, table, lens = make_paged_cache(lens_list, 8, 128, 16, torch.bfloat16, "cuda")
    q = torch.randn(batch, 16, 128, dtype=torch.bfloat16, device="cuda")
    order = torch.argsort(lens, descending=True).to(torch.int32)
    scale = 128 ** -0.5

    def run(row_order):
        ws = ops.paged_decode_workspace(q, k_cache, table, num_splits)
        return ops.paged_decode_attention(q, k_cache, v_cache, table, lens, scale, workspace=ws,
                                          num_splits=num_splits, row_order=row_order)

    plain = run(None)
    assert torch.equal(run(order), plain)
    assert torch.equal(run(order.flip(0).contiguous()), plain)
    assert (plain[batch // 2] == 0).all()


@pytest.mark.cuda
def test_row_order_under_graph_replay():
    batch = 300
    k_cache, v_cache, table, lens = make_paged_cache(_ragged(batch), 8, 128, 16, torch.bfloat16, "cuda")
    q = torch.randn(batch, 16, 128, dtype=torch.bfloat16, device="cuda")
    meta = ForwardMetadata(positions=lens - 1, slot_mapping=torch.zeros_like(lens), block_tables=table,
                           context_lens=lens)
    out = torch.empty_like(q)

    def step():
        ws = attention_workspace(q, k_cache, meta)
        ops.paged_decode_attention(q, k_cache, v_cache, table, lens, 128 ** -0.5, out=out,
                                   workspace=ws, row_order=meta.row_order)

    step()
    assert meta.row_order is not None  # 300 rows x 8 kv heads: several waves on any GPU
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    # other lengths (each within its row's blocks): the captured argsort orders them anew
    lens.copy_(torch.minimum(lens, torch.tensor(_ragged(batch, seed=1), dtype=torch.int32, device="cuda")))
    out.fill_(float("nan"))
    graph.replay()
    ws = ops.paged_decode_workspace(q, k_cache, table)
    expected = ops.paged_decode_attention(q, k_cache, v_cache, table, lens, 128 ** -0.5, workspace=ws)
    assert torch.equal(out, expected)


def test_few_rows_or_the_cpu_get_no_order():
    k_cache, v_cache, table, lens = make_paged_cache([5, 40], 2, 64, 16, torch.float32, "cpu")
    q = torch.randn(2, 4, 64)
    meta = ForwardMetadata(positions=lens - 1, slot_mapping=torch.zeros_like(lens), block_tables=table,
                           context_lens=lens)
    attention_workspace(q, k_cache, meta)
    assert meta.row_order is None
    # the CPU accepts an order (the CUDA launch order) and computes the same rows
    order = torch.tensor([1, 0], dtype=torch.int32)
    assert torch.equal(ops.paged_decode_attention(q, k_cache, v_cache, table, lens, 0.125, row_order=order),
                       ops.paged_decode_attention(q, k_cache, v_cache, table, lens, 0.125))


def test_the_cpu_rejects_an_order_that_is_not_a_permutation():
    k_cache, v_cache, table, lens = make_paged_cache([5, 40, 7], 2, 64, 16, torch.float32, "cpu")
    q = torch.randn(3, 4, 64)
    for bad, entry in (([0, 0, 2], "entry 1 is 0"), ([0, 1, 3], "entry 2 is 3")):
        with pytest.raises(RuntimeError, match=f"row_order must be a permutation of range\\(3\\); {entry}"):
            ops.paged_decode_attention(q, k_cache, v_cache, table, lens, 0.125,
                                       row_order=torch.tensor(bad, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="row_order must be an int32"):
        ops.paged_decode_attention(q, k_cache, v_cache, table, lens, 0.125, row_order=torch.arange(3))
