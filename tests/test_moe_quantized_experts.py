"""The quantized expert ops (layers/moe_quantized_ops.py's moe_gate_up_silu_fp8 / _int4 and
moe_down_sum_fp8 / _int4): a quantized checkpoint's experts read as stored, FP8 (e4m3 with block,
per-channel and per-tensor scales) and int4 (group scales in fp32 / fp16 / bf16 and zero points).
Each equals its dense op (layers/moe.py) on the same experts dequantized to the activations' dtype
(dequantize_all), bit for bit, on the CPU and on CUDA, over a grid of dtypes, token counts, top-k,
shapes and formats; on CUDA an id outside the experts gives zeros as the dense ops do; bad calls
are named; the ops are capturable; moe_mlp runs the experts through them."""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICES
from pagedkv.layers import moe
from pagedkv.layers.moe_quantized import Fp8Experts, Int4Experts, dequantize_all
from pagedkv.layers.moe_quantized_ops import moe_down_sum_quantized, moe_gate_up_silu_quantized, quantized_kernels_take
from test_moe import random_ids

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
NUM_TOKENS = [1, 3, 9]
TOP_K = [1, 2, 8]
SIZES = [(64, 32), (256, 96), (2048, 768)]  # (hidden, intermediate); the last Qwen3-30B-A3B's
# FP8 scale blocks (fp8-*), int4 group sizes and scale dtypes (int4-*)
FORMATS = ["fp8-128x128", "fp8-32x16", "fp8-channel", "fp8-tensor", "int4-g128-bfloat16", "int4-g32-float16",
           "int4-g16-float32"]
NUM_EXPERTS = 8


def scale_block(block: str, rows: int, cols: int) -> tuple[int, int]:
    """The (block_n, block_k) of a projection [rows, cols]: FineGrainedFP8's square blocks, a small
    block with partial edge blocks, compressed-tensors' per channel, per tensor."""
    if block == "channel":
        return 1, cols
    if block == "tensor":
        return rows, cols
    n, k = block.split("x")
    return int(n), int(k)


def experts(fmt: str, rows: int, cols: int, gen: torch.Generator, device) -> Fp8Experts | Int4Experts:
    """One projection [E, rows, cols] of random stored values (a checkpoint's, not a quantizer's)
    under random positive scales; an int4 group is at most the projection's width."""
    kind, spec = fmt.split("-", 1)
    scale = 0.02 / cols ** 0.5
    if kind == "fp8":
        bn, bk = scale_block(spec, rows, cols)
        q = (torch.randn(NUM_EXPERTS, rows, cols, generator=gen) * 8).to(torch.float8_e4m3fn)
        scales = torch.rand(NUM_EXPERTS, -(-rows // bn), -(-cols // bk), generator=gen) * scale + 1e-4
        return Fp8Experts(q.to(device), scales.to(device), (bn, bk))
    group, scale_dtype = spec.split("-")
    group = min(int(group[1:]), cols)
    q = torch.randint(0, 16, (NUM_EXPERTS, rows, cols), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(NUM_EXPERTS, rows, cols // group, generator=gen) * scale + 1e-4).to(getattr(torch, scale_dtype))
    zeros = torch.randint(0, 16, (NUM_EXPERTS, rows, cols // group), generator=gen, dtype=torch.uint8)
    packed = q[..., 0::2] | (q[..., 1::2] << 4)
    return Int4Experts(packed.to(device), scales.to(device), zeros.to(device), group, None)


def layer(hidden: int, inter: int, fmt: str, device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return (experts(fmt, inter, hidden, gen, device), experts(fmt, inter, hidden, gen, device),
            experts(fmt, hidden, inter, gen, device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("top_k", TOP_K)
@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_equal_dense_ops_on_the_dequantized_experts(device, dtype, num_tokens, top_k, sizes, fmt):
    hidden, inter = sizes
    if device == "cpu" and hidden > 256:
        pytest.skip("the CPU runs the dense ops' code on the dequantized experts: small sizes cover it")
    gate, up, down = layer(hidden, inter, fmt, device)
    x = torch.randn(num_tokens, hidden, dtype=dtype, device=device)
    ids = random_ids(num_tokens, NUM_EXPERTS, top_k, device)
    weights = torch.rand(num_tokens, top_k, device=device).to(dtype)
    dense_gate_up = torch.cat([dequantize_all(gate, dtype), dequantize_all(up, dtype)], dim=1)  # [E, 2I, D]
    act = torch.full((num_tokens, top_k, inter), float("nan"), dtype=dtype, device=device)
    moe_gate_up_silu_quantized(x, gate, up, ids, out=act)
    assert torch.equal(act, moe.moe_gate_up_silu(x, dense_gate_up, ids))
    for w in (weights, weights.float()):  # the model dtype's weights, Mixtral's fp32 ones
        out = torch.full((num_tokens, hidden), float("nan"), dtype=dtype, device=device)
        moe_down_sum_quantized(act, down, ids, w, out=out)
        assert torch.equal(out, moe.moe_down_sum(act, dequantize_all(down, dtype), ids, w))


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["fp8-32x16", "int4-g32-bfloat16", "int4-g16-float32"])
@pytest.mark.parametrize("inter", [1, 15, 17, 33])
def test_gate_up_of_odd_widths_on_cuda(fmt, inter):
    """Odd expert widths: the CUDA gate/up computes two rows a warp for these formats, and the last
    warp's second row falls past the end (read again as the last row, never stored)."""
    gen = torch.Generator().manual_seed(inter)
    gate, up = experts(fmt, inter, 64, gen, "cuda"), experts(fmt, inter, 64, gen, "cuda")
    x = torch.randn(3, 64, dtype=torch.bfloat16, device="cuda")
    ids = random_ids(3, NUM_EXPERTS, 2, "cuda")
    dense_gate_up = torch.cat([dequantize_all(gate, x.dtype), dequantize_all(up, x.dtype)], dim=1)
    act = torch.full((3, 2, inter), float("nan"), dtype=x.dtype, device="cuda")
    moe_gate_up_silu_quantized(x, gate, up, ids, out=act)
    assert torch.equal(act, moe.moe_gate_up_silu(x, dense_gate_up, ids))


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["fp8-128x128", "int4-g32-float16"])
def test_ids_outside_the_experts_give_zeros_on_cuda(fmt):
    """As the dense ops on CUDA (no host read of the ids): the pair's activations are zero, its
    down product adds nothing."""
    gate, up, down = layer(256, 96, fmt, "cuda")
    x = torch.randn(2, 256, dtype=torch.bfloat16, device="cuda")
    ids = torch.tensor([[3, -1], [NUM_EXPERTS, 5]], device="cuda")
    weights = torch.rand(2, 2, device="cuda").bfloat16()
    dense_gate_up = torch.cat([dequantize_all(gate, x.dtype), dequantize_all(up, x.dtype)], dim=1)
    act = moe_gate_up_silu_quantized(x, gate, up, ids)
    assert torch.equal(act, moe.moe_gate_up_silu(x, dense_gate_up, ids))
    assert not act[0, 1].any() and not act[1, 0].any()
    assert torch.equal(moe_down_sum_quantized(act, down, ids, weights),
                       moe.moe_down_sum(act, dequantize_all(down, x.dtype), ids, weights))


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["fp8-32x16", "int4-g32-bfloat16"])
def test_captured_in_cuda_graph(fmt):
    gate, up, down = layer(256, 96, fmt, "cuda")
    x = torch.randn(3, 256, dtype=torch.bfloat16, device="cuda")
    ids = random_ids(3, NUM_EXPERTS, 2, "cuda")
    weights = torch.rand(3, 2, device="cuda").bfloat16()
    act = torch.empty(3, 2, 96, dtype=x.dtype, device="cuda")
    out = torch.empty(3, 256, dtype=x.dtype, device="cuda")
    moe_down_sum_quantized(moe_gate_up_silu_quantized(x, gate, up, ids, out=act), down, ids, weights, out=out)  # warm up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe_down_sum_quantized(moe_gate_up_silu_quantized(x, gate, up, ids, out=act), down, ids, weights, out=out)
    x.copy_(torch.randn_like(x))
    ids.copy_(random_ids(3, NUM_EXPERTS, 2, "cuda"))
    graph.replay()
    want = moe_down_sum_quantized(moe_gate_up_silu_quantized(x, gate, up, ids), down, ids, weights)
    assert torch.equal(out, want)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    gate, up, down = layer(64, 32, "fp8-32x16", device)
    x = torch.randn(3, 64, device=device)
    ids, weights = random_ids(3, NUM_EXPERTS, 2, device), torch.rand(3, 2, device=device)
    act = torch.empty(3, 2, 32, device=device)
    # test_schema compares inputs before and after with ops that have no float8 kernel on the CPU
    # (mul): it runs on the other three (as tests/test_quant_fp8.py's).
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.pagedkv.moe_gate_up_silu_fp8.default,
                          (act, x, gate.weight, gate.scales, up.weight, up.scales, ids, *gate.block), test_utils=utils)
    torch.library.opcheck(torch.ops.pagedkv.moe_down_sum_fp8.default,
                          (torch.empty(3, 64, device=device), act, down.weight, down.scales, ids, weights, *down.block),
                          test_utils=utils)
    gate, up, down = layer(64, 32, "int4-g16-float16", device)
    torch.library.opcheck(torch.ops.pagedkv.moe_gate_up_silu_int4.default,
                          (act, x, gate.packed, gate.scales, gate.zeros, up.packed, up.scales, up.zeros, ids, 16))
    torch.library.opcheck(torch.ops.pagedkv.moe_down_sum_int4.default,
                          (torch.empty(3, 64, device=device), act, down.packed, down.scales, down.zeros, ids, weights, 16))


def test_bad_arguments_are_named():
    gate, up, down = layer(64, 32, "fp8-32x16", "cpu")
    x, ids = torch.randn(3, 64), torch.zeros(3, 2, dtype=torch.int64)
    op = torch.ops.pagedkv.moe_gate_up_silu_fp8
    act = torch.empty(3, 2, 32)
    with pytest.raises(RuntimeError, match=r"block \(32, 8\) over 64 input columns; allowed: .* multiples of 16"):
        op(act, x, gate.weight, torch.ones(8, 1, 8), up.weight, torch.ones(8, 1, 8), ids, 32, 8)
    with pytest.raises(RuntimeError, match="gate has dtype Float; it must be torch.float8_e4m3fn"):
        op(act, x, gate.weight.float(), gate.scales, up.weight, up.scales, ids, 32, 16)
    with pytest.raises(RuntimeError, match=r"the scales of up must be \[num_experts, ceil"):
        op(act, x, gate.weight, gate.scales, up.weight, up.scales[:, :, :2], ids, 32, 16)
    with pytest.raises(RuntimeError, match=r"up must have shape \[num_experts, 32, 64\]"):
        op(act, x, gate.weight, gate.scales, up.weight[:4], up.scales[:4], ids, 32, 16)
    with pytest.raises(RuntimeError, match="expert_ids holds 8; allowed: 0 to 7"):
        moe_gate_up_silu_quantized(x, gate, up, torch.full((3, 2), 8))
    with pytest.raises(RuntimeError, match="the scales of down have dtype BFloat16; they must be torch.float32"):
        torch.ops.pagedkv.moe_down_sum_fp8(torch.empty(3, 64), act, down.weight, down.scales.bfloat16(), ids,
                                           torch.rand(3, 2), *down.block)
    gate, up, down = layer(64, 32, "int4-g16-float16", "cpu")
    op = torch.ops.pagedkv.moe_gate_up_silu_int4
    with pytest.raises(RuntimeError, match=r"gate: group_size 24 over 64 input columns; allowed: group_size and"):
        op(act, x, gate.packed, gate.scales, gate.zeros, up.packed, up.scales, up.zeros, ids, 24)
    with pytest.raises(RuntimeError, match=r"the zeros of up must be \[num_experts, n, k / group_size\]"):
        op(act, x, gate.packed, gate.scales, gate.zeros, up.packed, up.scales, up.zeros[..., :2], ids, 16)
    with pytest.raises(RuntimeError, match="the scales of gate have dtype Int; allowed: torch.float32"):
        op(act, x, gate.packed, gate.scales.int(), gate.zeros, up.packed, up.scales, up.zeros, ids, 16)
    with pytest.raises(RuntimeError, match=r"the scales of gate \(Half\) and of up \(Float\) must have one dtype"):
        op(act, x, gate.packed, gate.scales, gate.zeros, up.packed, up.scales.float(), up.zeros, ids, 16)
    with pytest.raises(RuntimeError, match=r"down \(packed\) must have shape \[num_experts, 64, 16\]"):
        torch.ops.pagedkv.moe_down_sum_int4(torch.empty(3, 64), act, down.packed[..., :8], down.scales, down.zeros,
                                            ids, torch.rand(3, 2), 16)


@pytest.mark.parametrize("fmt", ["fp8-32x16", "int4-g16-bfloat16"])
def test_moe_mlp_takes_the_quantized_ops(monkeypatch, fmt):
    """Experts the kernels take run through the two ops at any step size that does not group by
    expert (a decode step, and more pairs than experts); the output is the dense path's on the
    dequantized experts."""
    gate, up, down = layer(64, 32, fmt, "cpu")
    gen = torch.Generator().manual_seed(5)
    router = torch.randn(NUM_EXPERTS, 64, generator=gen)
    w = moe.MoEWeights(router=router, gate_up=(gate, up), down=down, top_k=2, normalize=True, fp32_weights=False,
                       shared_gate=None)
    dense = moe.MoEWeights(router=router, gate_up=torch.cat([dequantize_all(gate, torch.float32),
                                                             dequantize_all(up, torch.float32)], dim=1),
                           down=dequantize_all(down, torch.float32), top_k=2, normalize=True, fp32_weights=False,
                           shared_gate=None)
    calls = []
    fused = moe.moe_gate_up_silu_quantized
    monkeypatch.setattr(moe, "moe_gate_up_silu_quantized", lambda *args: calls.append(args[0].shape) or fused(*args))
    for num_tokens in (1, 7):  # 2 pairs, 14 pairs (> 8 experts)
        x = torch.randn(num_tokens, 64, generator=gen)
        assert torch.equal(moe.moe_mlp(x, w), moe.moe_mlp(x, dense))
    assert calls == [(1, 64), (7, 64)]


def test_kernels_take_only_what_they_can_read():
    gate, up, down = layer(64, 32, "fp8-32x16", "cpu")
    x = torch.randn(1, 64)
    assert quantized_kernels_take(x, gate, up, down)
    assert not quantized_kernels_take(x, gate, Fp8Experts(up.weight, up.scales[:, :, :2], (32, 32)), down)  # blocks
    odd = layer(64, 32, "fp8-channel", "cpu")[0]
    odd.block = (1, 8)  # block_k not a multiple of 16
    assert not quantized_kernels_take(x, odd, odd, down)
    assert not quantized_kernels_take(torch.randn(1, 65)[:, 1:], gate, up, down)  # x off 16-byte alignment
    int4 = layer(64, 32, "int4-g16-float16", "cpu")
    assert quantized_kernels_take(x, *int4)
    assert not quantized_kernels_take(x, gate, up, int4[2])  # formats mixed
    with_order = Int4Experts(int4[0].packed, int4[0].scales, int4[0].zeros, 16, torch.randperm(64).expand(8, -1))
    assert not quantized_kernels_take(x, with_order, int4[1], int4[2])  # GPTQ desc_act
    coarse = layer(64, 32, "int4-g32-float16", "cpu")
    assert not quantized_kernels_take(x, coarse[0], int4[1], int4[2])  # gate and up groups differ


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["fp8-32x16", "int4-g16-bfloat16"])
@pytest.mark.parametrize("experts_at_once", [NUM_EXPERTS, 3, 1])
@pytest.mark.parametrize("grouped_gemm", [True, False])
def test_prefill_dequantizes_experts_in_chunks(monkeypatch, device, dtype, fmt, experts_at_once, grouped_gemm):
    """A step that groups by expert (a prefill) dequantizes its experts as many at a time as
    PREFILL_DEQUANTIZED_BYTES holds (all, 3, 1 here: chunks of hit and of unhit experts, a short
    last chunk), with torch's grouped GEMM or one GEMM per expert: the dense experts' result."""
    gate, up, down = layer(64, 32, fmt, device)
    gen = torch.Generator().manual_seed(11)
    router = torch.randn(NUM_EXPERTS, 64, generator=gen).to(device, dtype)
    w = moe.MoEWeights(router=router, gate_up=(gate, up), down=down, top_k=2, normalize=True, fp32_weights=False,
                       shared_gate=None)
    dense = moe.dequantized(w, dtype)
    per_expert = dense.gate_up[0].nbytes + dense.down[0].nbytes
    monkeypatch.setattr(moe, "PREFILL_DEQUANTIZED_BYTES", experts_at_once * per_expert)
    monkeypatch.setattr(moe, "GROUPED_MIN_PAIRS", 0)
    if not grouped_gemm:
        monkeypatch.setattr(moe, "grouped_mm_runs", lambda x, w: False)
    x = torch.randn(37, 64, generator=gen).to(device, dtype)
    x[:35] = x[0]  # 3 distinct tokens: at most 6 of the 8 experts hit
    out = moe.moe_mlp(x, w)
    expected = moe.moe_mlp(x, dense)
    if grouped_gemm and experts_at_once < NUM_EXPERTS:  # fewer rows a grouped GEMM: another blocking
        torch.testing.assert_close(out, expected)
    else:
        assert torch.equal(out, expected)
