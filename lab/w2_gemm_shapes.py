"""How far W2's GEMMs are from their bound, and what a tuned kernel reaches there (issue 28).

W2's decode steps run Qwen3-0.6B's four projections a layer at 1-256 rows; at > 8 rows pagedkv
hands them to cuBLAS (torch.mm). Session 19 measured 6-9 us each at ~190 rows against 1.4-4.2 us
of weight bytes. This times, per shape and row count, CUDA-graph replays of:
  - torch.mm (cuBLAS, what pagedkv runs),
  - torch.addmm with a zero bias (cuBLASLt's path in ATen),
  - torch.compile(mode="max-autotune-no-cudagraphs") of x @ w.T (Triton templates tuned against
    cuBLAS: what a tuned kernel for exactly this shape reaches),
  - pagedkv.ops.linear (the weight-streaming kernels where they apply, else cuBLAS),
and prints each beside the shape's bound: max(weight + x + out bytes over copy bandwidth,
FLOPs over the measured bf16 matmul peak).

    python lab/w2_gemm_shapes.py [--rows 16,32,64,128,192,256] [--no-compile]
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
from timing import copy_bandwidth_gbs, median_time_us  # noqa: E402

import pagedkv  # noqa: E402

# (name, out features n, in features k) of one Qwen3-0.6B layer; gate_up is gate and up stacked.
SHAPES = [("qkv", 4096, 1024), ("o", 1024, 2048), ("gate_up", 6144, 1024), ("down", 1024, 3072)]


def matmul_tflops() -> float:
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    us = median_time_us(lambda: a @ a, "cuda", repeats=10, graph=False)
    return 2 * 8192**3 / (us * 1e-6) / 1e12


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="16,32,64,128,192,256")
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()
    copy = copy_bandwidth_gbs("cuda")
    peak = matmul_tflops()
    print(f"{torch.cuda.get_device_name()}: copy {copy:.0f} GB/s, bf16 matmul {peak:.0f} TFLOP/s")
    print("| shape | rows | bound us | torch.mm | addmm | max-autotune | pagedkv.ops.linear | mm / bound | best / bound |")
    print("|---|---|---|---|---|---|---|---|---|")
    totals: dict[int, list[float]] = {}
    for name, n, k in SHAPES:
        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
        bias = torch.zeros(n, dtype=torch.bfloat16, device="cuda")
        for m in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            nbytes = 2 * (n * k + m * k + m * n)
            bound = max(nbytes / (copy * 1e9), 2 * m * n * k / (peak * 1e12)) * 1e6
            times = {
                "mm": median_time_us(lambda: torch.mm(x, w.t()), "cuda"),
                "addmm": median_time_us(lambda: torch.addmm(bias, x, w.t()), "cuda"),
                "ops": median_time_us(lambda: pagedkv.ops.linear(x, w), "cuda"),
            }
            if not args.no_compile:
                torch._dynamo.reset()
                fn = torch.compile(lambda a, b: a @ b.t(), mode="max-autotune-no-cudagraphs", dynamic=False)
                fn(x, w)
                times["tuned"] = median_time_us(lambda: fn(x, w), "cuda")
            best = min(times.values())
            totals.setdefault(m, [0.0, 0.0, 0.0])
            totals[m][0] += bound
            totals[m][1] += times["mm"]
            totals[m][2] += best
            print(f"| {name} {n}x{k} | {m} | {bound:.2f} | {times['mm']:.2f} | {times['addmm']:.2f} | "
                  f"{times.get('tuned', float('nan')):.2f} | {times['ops']:.2f} | {times['mm'] / bound:.2f} | "
                  f"{best / bound:.2f} |", flush=True)
    print("\nA layer's four GEMMs (us), x 28 layers = a decode step's GEMM time:")
    for m, (bound, mm, best) in sorted(totals.items()):
        print(f"rows {m}: bound {bound:.1f}, torch.mm {mm:.1f}, best of the four {best:.1f}; "
              f"a step: torch.mm {28 * mm / 1e3:.2f} ms, best {28 * best / 1e3:.2f} ms, bound {28 * bound / 1e3:.2f} ms")


if __name__ == "__main__":
    main()
