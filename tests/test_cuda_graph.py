"""The decode-step ops allocate nothing and never synchronize, so a CUDA graph captures them: one
graph of rope_and_write_kv + silu_and_mul + sample + copy_blocks, replayed on new inputs, gives
what the ops give when run eagerly."""

from __future__ import annotations

import pytest
import torch

from pagedkv import ops


def step_inputs(device="cuda"):
    gen = torch.Generator(device=device).manual_seed(0)
    randn = lambda *shape: torch.randn(*shape, device=device, generator=gen)  # noqa: E731
    return dict(
        qkv=randn(4, (8 + 2 * 2) * 64).bfloat16(),
        positions=torch.tensor([3, 10, 0, 7], dtype=torch.int32, device=device),
        slots=torch.tensor([3, 26, -1, 7], dtype=torch.int32, device=device),
        x=randn(4, 2 * 256).bfloat16(),
        logits=randn(4, 5000),
        temperatures=torch.tensor([0.0, 0.7, 1.0, 1.2], device=device),
        top_k=torch.tensor([0, 20, 0, 50], dtype=torch.int32, device=device),
        top_p=torch.tensor([1.0, 0.9, 0.8, 1.0], device=device),
        seeds=torch.tensor([1, 2, 3, 4], device=device),
        offsets=torch.tensor([0, 5, 9, 2], device=device),
        src=torch.tensor([0, 1], dtype=torch.int32, device=device),
        dst=torch.tensor([2, 3], dtype=torch.int32, device=device),
    )


def run_step(b, cos_sin, k_caches, v_caches, act_out, tokens):
    qkv = b["qkv"]
    q = qkv[:, : 8 * 64].view(4, 8, 64)
    k = qkv[:, 8 * 64 : 10 * 64].view(4, 2, 64)
    v = qkv[:, 10 * 64 :].view(4, 2, 64)
    ops.rope_and_write_kv(q, k, v, b["positions"], cos_sin, k_caches[0], v_caches[0], b["slots"])
    ops.silu_and_mul(b["x"], out=act_out)
    ops.sample(b["logits"], b["temperatures"], b["top_k"], b["top_p"], b["seeds"], b["offsets"], out=tokens)
    ops.copy_blocks(k_caches, v_caches, b["src"], b["dst"])


@pytest.mark.cuda
def test_decode_ops_replay_in_a_cuda_graph():
    cos_sin = torch.randn(64, 64, device="cuda")
    fresh = lambda: [torch.randn(4, 16, 2, 64, device="cuda").bfloat16() for _ in range(3)]  # noqa: E731
    static = step_inputs()
    k_caches, v_caches = fresh(), fresh()
    act_out = torch.empty(4, 256, device="cuda", dtype=torch.bfloat16)
    tokens = torch.empty(4, dtype=torch.int64, device="cuda")

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run_step(step_inputs(), cos_sin, fresh(), fresh(), act_out, tokens)  # warm-up
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_step(static, cos_sin, k_caches, v_caches, act_out, tokens)

    # New values in the captured buffers, then replay; compare with an eager run on copies.
    new = step_inputs()
    new["offsets"] += 1
    for name, t in new.items():
        static[name].copy_(t)
    k_ref, v_ref = [c.clone() for c in k_caches], [c.clone() for c in v_caches]
    ref = {name: t.clone() for name, t in new.items()}
    act_ref, tokens_ref = torch.empty_like(act_out), torch.empty_like(tokens)
    run_step(ref, cos_sin, k_ref, v_ref, act_ref, tokens_ref)
    graph.replay()
    torch.cuda.synchronize()

    assert torch.equal(static["qkv"], ref["qkv"])
    assert torch.equal(act_out, act_ref) and torch.equal(tokens, tokens_ref)
    assert all(torch.equal(a, b) for a, b in zip(k_caches + v_caches, k_ref + v_ref))
