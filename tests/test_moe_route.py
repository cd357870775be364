"""moe_route (layers/moe.py), HF's router fused into one op, against route()'s plain-PyTorch body
over a grid: on the CPU bit for bit (it runs HF's own ATen ops), on CUDA the same experts wherever
the logits do not nearly tie, and the documented order of exact ties (lower expert index first);
route() takes it for decode-sized steps; CUDA-graph capture."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICES
from pagedkv.layers import moe

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EXPERTS = [8, 60, 64, 128]
TOP_K = [1, 2, 4, 8]
TOKENS_HIDDEN = [(1, 2048), (5, 100), (17, 2048), (64, 64)]  # 100: the bf16/fp16 scalar path
OPTIONS = [(True, True), (True, False), (False, True), (False, False)]  # (normalize, fp32_weights)


def reference(x, router, top_k, normalize, fp32_weights):
    """route()'s torch body: HF's router (logits in the dtype, fp32 softmax, topk, renormalise, cast)."""
    probs = torch.softmax(F.linear(x, router), dim=-1, dtype=torch.float32)
    top, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return ids, top if fp32_weights else top.to(x.dtype)


def random_inputs(num_tokens, hidden, num_experts, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    router = torch.randn(num_experts, hidden, generator=gen) * 2 / hidden ** 0.5  # logits ~ N(0, 4)
    return x.to(dtype).to(device), router.to(dtype).to(device)


def tied_inputs(num_tokens, hidden, num_experts, dtype, device):
    """x[t] one-hot at column t, so logits[t] = router[:, t] exactly in any summation order; each
    column takes 4 values, so most experts tie with others."""
    gen = torch.Generator().manual_seed(1)
    x = torch.zeros(num_tokens, hidden)
    x[torch.arange(num_tokens), torch.arange(num_tokens) % hidden] = 1
    router = torch.randint(0, 4, (num_experts, hidden), generator=gen) * 0.5
    return x.to(dtype).to(device), router.to(dtype).to(device)


def poisoned(num_tokens, top_k, dtype, device):
    return (torch.full((num_tokens, top_k), -7, dtype=torch.int64, device=device),
            torch.full((num_tokens, top_k), float("nan"), dtype=dtype, device=device))


def assert_routes_agree(ids, weights, x, router, top_k, normalize, fp32_weights):
    """ids: a top-k of the exact logits up to the tolerance of their rounding to x's dtype (equal
    to the reference's wherever the k-th and (k+1)-th logits are further apart), descending up to
    it; weights: HF's of those ids, up to the same tolerance."""
    exact = (x.double() @ router.double().T).cpu()  # [T, E]
    ids, weights = ids.cpu(), weights.cpu().double()
    num_experts = router.shape[0]
    tol = 2 * torch.finfo(x.dtype).eps * max(exact.abs().max().item(), 1.0) + 1e-6
    assert ((ids >= 0) & (ids < num_experts)).all(), f"ids outside [0, {num_experts}): {ids}"
    assert all(len(set(row)) == top_k for row in ids.tolist()), f"an expert chosen twice: {ids}"
    chosen = exact.gather(1, ids)  # [T, k]
    ranked = exact.sort(dim=-1, descending=True).values
    assert (chosen[:, -1] >= ranked[:, top_k - 1] - tol).all(), "an expert outside the top k chosen"
    assert (chosen[:, :-1] >= chosen[:, 1:] - tol).all(), "top-k not in descending order"
    ref_ids, _ = reference(x, router, top_k, normalize, fp32_weights)
    for t in range(ids.shape[0]):
        if top_k == num_experts or ranked[t, top_k - 1] - ranked[t, top_k] > tol:
            assert set(ids[t].tolist()) == set(ref_ids[t].tolist()), f"token {t}: not torch's experts"
    probs = torch.softmax(exact.to(x.dtype).double(), dim=-1).gather(1, ids)
    expected = probs / probs.sum(-1, keepdim=True) if normalize else probs
    w_eps = torch.finfo(torch.float32 if fp32_weights else x.dtype).eps
    torch.testing.assert_close(weights, expected, atol=2 * tol + 2 * w_eps, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens_hidden", TOKENS_HIDDEN)
@pytest.mark.parametrize("num_experts", EXPERTS)
@pytest.mark.parametrize("top_k", TOP_K)
@pytest.mark.parametrize("options", OPTIONS)
def test_moe_route(device, dtype, tokens_hidden, num_experts, top_k, options):
    (num_tokens, hidden), (normalize, fp32_weights) = tokens_hidden, options
    x, router = random_inputs(num_tokens, hidden, num_experts, dtype, device)
    ids, weights = poisoned(num_tokens, top_k, torch.float32 if fp32_weights else dtype, device)
    moe.moe_route(x, router, top_k, normalize, fp32_weights, expert_ids=ids, weights=weights)
    if device == "cpu":  # HF's own ATen ops: every bit, ties in torch.topk's order included
        ref_ids, ref_weights = reference(x, router, top_k, normalize, fp32_weights)
        assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_weights)
    assert_routes_agree(ids, weights, x, router, top_k, normalize, fp32_weights)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_experts", [8, 64, 128])
@pytest.mark.parametrize("top_k", TOP_K)
def test_ties(device, dtype, num_experts, top_k):
    """Exactly equal probs: on the CPU torch.topk's own order (HF's); on CUDA descending with the
    lower expert index first (torch.topk on CUDA keeps the lowest indices of a tie at the k-th
    place too, and leaves the order among equal probs to an unstable sort)."""
    x, router = tied_inputs(16, 64, num_experts, dtype, device)
    ids, weights = moe.moe_route(x, router, top_k, True, False)
    if device == "cpu":
        ref_ids, ref_weights = reference(x, router, top_k, True, False)
        assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_weights)
    else:
        logits = router.float().T[:16].cpu().tolist()  # logits[t] = router[:, t]
        expected = [sorted(range(num_experts), key=lambda e: (-row[e], e))[:top_k] for row in logits]
        assert ids.cpu().tolist() == expected
        ref_ids, _ = reference(x, router, top_k, True, False)
        assert [set(r) for r in ids.tolist()] == [set(r) for r in ref_ids.tolist()], "not torch's set"
    assert_routes_agree(ids, weights, x, router, top_k, True, False)


def test_route_takes_the_fused_op_for_decode_sizes(monkeypatch):
    calls = []
    fused = moe.moe_route
    monkeypatch.setattr(moe, "moe_route", lambda *args: calls.append(args[0].shape[0]) or fused(*args))
    x, router = random_inputs(moe.FUSED_ROUTE_MAX_TOKENS + 1, 64, 8, torch.bfloat16, "cpu")
    w = moe.MoEWeights(router=router, gate_up=router, down=router, top_k=2, normalize=True, fp32_weights=False,
                       shared_gate=None)
    decode, prefill = moe.route(x[:3], w), moe.route(x, w)
    assert calls == [3]
    ref = reference(x, router, 2, True, False)
    assert torch.equal(decode[0], ref[0][:3]) and torch.equal(decode[1], ref[1][:3])
    assert torch.equal(prefill[0], ref[0]) and torch.equal(prefill[1], ref[1])


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    x, router = random_inputs(3, 64, 8, torch.float32, device)
    ids, weights = poisoned(3, 2, torch.float32, device)
    torch.library.opcheck(torch.ops.pagedkv.moe_route.default, (ids, weights, x, router, True))


@pytest.mark.cuda
def test_cuda_graph_capture():
    """No host sync: captured once, replayed on new inputs, it gives the eager results."""
    x, router = random_inputs(4, 256, 64, torch.bfloat16, "cuda")
    ids, weights = poisoned(4, 8, torch.bfloat16, "cuda")
    moe.moe_route(x, router, 8, True, False, expert_ids=ids, weights=weights)  # warm up off the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe.moe_route(x, router, 8, True, False, expert_ids=ids, weights=weights)
    x.copy_(random_inputs(4, 256, 64, torch.bfloat16, "cuda", seed=5)[0])
    graph.replay()
    expected = moe.moe_route(x, router, 8, True, False)
    assert torch.equal(ids, expected[0]) and torch.equal(weights, expected[1])


def test_bad_arguments_are_named():
    x, router = random_inputs(3, 64, 8, torch.float32, "cpu")
    with pytest.raises(RuntimeError, match="top_k .* is 9; allowed: 1 to 8"):
        moe.moe_route(x, router, 9, True, True)
    with pytest.raises(RuntimeError, match=r"router must have shape \[num_experts, hidden\] = \[E, 64\]"):
        moe.moe_route(x, router[:, :32].contiguous(), 2, True, True)
    with pytest.raises(RuntimeError, match="router has 5000 experts; allowed: 1 to 4096"):
        moe.moe_route(x, torch.randn(5000, 64), 2, True, True)
    with pytest.raises(RuntimeError, match="weights has dtype Half; allowed: torch.float32 or x's Float"):
        moe.moe_route(x, router, 2, True, True, weights=torch.empty(3, 2, dtype=torch.half))
