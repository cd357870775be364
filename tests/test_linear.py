"""pagedkv.ops.linear and gate_up_silu (both activations) against PyTorch: the CUDA-core kernel
(1-2 rows), the tensor-core kernel (3-16 rows) and the cuBLAS path (more rows, fp32)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICES
from pagedkv import ops
from tolerance import assert_close_to_baseline

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# CUDA: 1-2 CUDA cores, 3-8 tensor cores, 9-16 tensor cores for matrices < 4 MiB, beyond cuBLAS
ROWS = [1, 2, 3, 8, 9, 16, 17, 33]
SHAPES = [(64, 64), (200, 1024), (4608, 3584), (129, 18944)]  # (n, k)
MMA_DTYPES = [torch.float16, torch.bfloat16]
MMA_ROWS = list(range(3, 17))  # one n-tile to 8 rows, two to 16
# W1's qkv and o; n not a multiple of the 16-row tile with k not a multiple of the 32-wide slice;
# k of 41 whole slices (2 pipelined steps of 16, 9 more, one partial) and k under one step.
MMA_SHAPES = [(4608, 3584), (3584, 3584), (37, 3592), (200, 1048), (45, 1320), (24, 200)]
ACTIVATIONS = ["silu", "gelu_tanh"]  # gate_up_silu's: Llama's, Gemma's


def fp64_on_cpu(t):
    """The float64 reference runs on the CPU: under compute-sanitizer the GPU's float64 GEMMs of
    the large shapes take minutes each, and the tolerance check compares on the CPU anyway."""
    return None if t is None else t.cpu().double()


def reference(x, weight, bias):
    return F.linear(fp64_on_cpu(x), fp64_on_cpu(weight), fp64_on_cpu(bias))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear(device, dtype, rows, n, k, with_bias):
    if device == "cpu" and (n * k > 1 << 20 or rows == 33):
        pytest.skip("CPU covers the small shapes; the large ones exercise the CUDA kernel")
    x = torch.randn(rows, k, dtype=dtype, device=device)
    weight = torch.randn(n, k, dtype=dtype, device=device) / k**0.5
    bias = torch.randn(n, dtype=dtype, device=device) if with_bias else None
    out = torch.full((rows, n), float("nan"), dtype=dtype, device=device)
    ops.linear(x, weight, bias, out=out)
    assert_close_to_baseline(out, F.linear(x, weight, bias), reference(x, weight, bias))


def strided_rows(rows, k, dtype):
    """x [rows, k] as a row-strided view (16-byte aligned) of a wider random tensor."""
    return torch.randn(rows, k + 24, dtype=dtype, device="cuda")[:, 8 : 8 + k]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", MMA_DTYPES)
@pytest.mark.parametrize("rows", MMA_ROWS)
@pytest.mark.parametrize("n, k", MMA_SHAPES)
def test_linear_tensor_core_rows(dtype, rows, n, k):
    x = strided_rows(rows, k, dtype)
    weight = torch.randn(n, k, dtype=dtype, device="cuda") / k**0.5
    bias = torch.randn(n, dtype=dtype, device="cuda")
    out = torch.full((rows, n), float("nan"), dtype=dtype, device="cuda")
    ops.linear(x, weight, bias, out=out)
    assert_close_to_baseline(out, F.linear(x, weight, bias), reference(x, weight, bias))


@pytest.mark.parametrize("device", DEVICES)
def test_strided_rows_and_leading_dims(device):
    """x may be a row-strided view (a slice of a fused projection) and have leading dims."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    fused = torch.randn(4, 3 * 256, dtype=dtype, device=device)
    x = fused[:, 256:512]  # row stride 768, last dim contiguous
    weight = torch.randn(96, 256, dtype=dtype, device=device)
    assert_close_to_baseline(ops.linear(x, weight), F.linear(x, weight), reference(x, weight, None))
    x3 = torch.randn(2, 3, 256, dtype=dtype, device=device)
    assert ops.linear(x3, weight).shape == (2, 3, 96)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    x = torch.randn(2, 64, device=device)
    weight = torch.randn(32, 64, device=device)
    out = torch.empty(2, 32, device=device)
    torch.library.opcheck(torch.ops.pagedkv.linear.default, (out, x, weight, torch.randn(32, device=device)))


@pytest.mark.parametrize("device", DEVICES)
def test_bad_calls(device):
    x = torch.randn(2, 64, device=device)
    weight = torch.randn(32, 64, device=device)
    with pytest.raises(RuntimeError, match=r"weight must be \[n, k\] with k = x.size\(-1\) = 64"):
        ops.linear(x, weight[:, :32].contiguous())
    with pytest.raises(RuntimeError, match=r"weight has dtype Half but x has Float"):
        ops.linear(x, weight.half())
    with pytest.raises(RuntimeError, match=r"bias must be \[n\] = \[32\]"):
        ops.linear(x, weight, torch.randn(31, device=device))
    with pytest.raises(RuntimeError, match=r"out must have shape \[2, 32\]"):
        ops.linear(x, weight, out=torch.empty(2, 31, device=device))


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [1, 8])
def test_captured_in_cuda_graph(rows):
    x = torch.randn(rows, 3584, dtype=torch.bfloat16, device="cuda")
    weight = torch.randn(4608, 3584, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(rows, 4608, dtype=torch.bfloat16, device="cuda")
    ops.linear(x, weight, out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.linear(x, weight, out=out)
    x.normal_()
    out.fill_(float("nan"))
    graph.replay()
    assert_close_to_baseline(out, F.linear(x, weight), reference(x, weight, None))


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [1, 2, 5])
@pytest.mark.parametrize("in_graph", [False, True])
def test_chained_products_read_finished_inputs(rows, in_graph):
    """Each product reads the one before it, as in a decoder layer: outputs are NaN until
    written, so a GEMV that read x before the kernel before it finished (e.g. a launch overlapped
    with its predecessor, as the programmatic-dependent-launch experiment did) shows as NaN or a
    wrong product."""
    k = 2048
    x = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
    weights = [torch.randn(k, k, dtype=torch.bfloat16, device="cuda") / k**0.5 for _ in range(6)]
    gate_up = torch.randn(2 * k, k, dtype=torch.bfloat16, device="cuda") / k**0.5
    outs = [torch.empty(rows, k, dtype=torch.bfloat16, device="cuda") for _ in range(len(weights) + 1)]

    def chain():
        h = x
        for w, o in zip(weights, outs):
            ops.linear(h, w, out=o)
            h = o
        ops.gate_up_silu(h, gate_up, out=outs[-1])

    graph = None
    if in_graph:
        chain()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            chain()
    for o in outs:
        o.fill_(float("nan"))
    if graph is None:
        chain()
    else:
        graph.replay()
    inputs = [x, *outs[:-1]]
    for i, w in enumerate(weights):
        assert_close_to_baseline(outs[i], F.linear(inputs[i], w), reference(inputs[i], w, None),
                                 name=f"product {i}")
    h = outs[len(weights) - 1]
    assert_close_to_baseline(outs[-1], reference_gate_up_silu(h, gate_up),
                             reference_gate_up_silu(fp64_on_cpu(h), fp64_on_cpu(gate_up)), name="gate_up")


def reference_gate_up_silu(x, gate_up, activation="silu"):
    """HF's MLP first half in x's dtype: act_fn(gate_proj(x)) * up_proj(x), act_fn rounded to the
    dtype, then the product (silu, or gelu_pytorch_tanh: torch's tanh-approximated gelu)."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    return act * up


def assert_gate_up_close(out, x, gate_up, activation):
    assert_close_to_baseline(out, reference_gate_up_silu(x, gate_up, activation),
                             reference_gate_up_silu(fp64_on_cpu(x), fp64_on_cpu(gate_up), activation))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 5, 12])  # 12: the tensor-core kernel's second n-tile
@pytest.mark.parametrize("i, k", [(64, 64), (1000, 256), (18944, 3584)])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gate_up_silu(device, dtype, rows, i, k, activation):
    if device == "cpu" and i * k > 1 << 20:
        pytest.skip("CPU covers the small shapes; the large one exercises the CUDA kernel")
    x = torch.randn(rows, k, dtype=dtype, device=device)
    gate_up = torch.randn(2 * i, k, dtype=dtype, device=device) / k**0.5
    out = torch.full((rows, i), float("nan"), dtype=dtype, device=device)
    ops.gate_up_silu(x, gate_up, out=out, activation=activation)
    assert_gate_up_close(out, x, gate_up, activation)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", MMA_DTYPES)
@pytest.mark.parametrize("rows", MMA_ROWS)
@pytest.mark.parametrize("i, k", [(18944, 3584), (37, 3592), (1000, 1048), (45, 1320)])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gate_up_silu_tensor_core_rows(dtype, rows, i, k, activation):
    x = strided_rows(rows, k, dtype)
    gate_up = torch.randn(2 * i, k, dtype=dtype, device="cuda") / k**0.5
    out = torch.full((rows, i), float("nan"), dtype=dtype, device="cuda")
    ops.gate_up_silu(x, gate_up, out=out, activation=activation)
    assert_gate_up_close(out, x, gate_up, activation)


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [1, 8])  # the CUDA-core kernel, the tensor-core one
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gate_up_silu_captured_in_cuda_graph(rows, activation):
    x = torch.randn(rows, 3584, dtype=torch.bfloat16, device="cuda")
    gate_up = torch.randn(2 * 18944, 3584, dtype=torch.bfloat16, device="cuda") / 3584**0.5
    out = torch.empty(rows, 18944, dtype=torch.bfloat16, device="cuda")
    ops.gate_up_silu(x, gate_up, out=out, activation=activation)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.gate_up_silu(x, gate_up, out=out, activation=activation)
    x.normal_()
    out.fill_(float("nan"))
    graph.replay()
    assert_gate_up_close(out, x, gate_up, activation)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gate_up_silu_opcheck(device, activation):
    x = torch.randn(2, 64, device=device)
    gate_up = torch.randn(64, 64, device=device)
    out = torch.empty(2, 32, device=device)
    torch.library.opcheck(torch.ops.pagedkv.gate_up_silu.default, (out, x, gate_up, activation))


@pytest.mark.parametrize("device", DEVICES)
def test_gate_up_silu_bad_calls(device):
    x = torch.randn(2, 64, device=device)
    with pytest.raises(RuntimeError, match=r"gate_up must be \[2 \* intermediate, k\]"):
        ops.gate_up_silu(x, torch.randn(31, 64, device=device))
    with pytest.raises(RuntimeError, match=r"out must have shape \[2, 16\]"):
        ops.gate_up_silu(x, torch.randn(32, 64, device=device), out=torch.empty(2, 32, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_gate_up_silu_unknown_activation_is_named(device):
    """The wrapper refuses it before anything runs; the op itself (the C++ check) too."""
    x = torch.randn(2, 64, device=device)
    gate_up = torch.randn(32, 64, device=device)
    message = r"activation must be 'silu' or 'gelu_tanh', got 'gelu'"
    with pytest.raises(ValueError, match=message):
        ops.gate_up_silu(x, gate_up, activation="gelu")
    with pytest.raises(RuntimeError, match=message):
        torch.ops.pagedkv.gate_up_silu(torch.empty(2, 16, device=device), x, gate_up, "gelu")
