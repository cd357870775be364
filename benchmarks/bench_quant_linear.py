"""Decode-sized products with quantized weights on the W1 (Qwen2.5-7B) layer shapes: each format's
pagedkv kernel (FP8 128x128 blocks, int4 group 128, NF4 block 64) against F.linear on the bf16
weight (cuBLAS, what HF runs unquantized) and pagedkv's bf16 GEMV, in one run, for 1 and 8 rows.
Weights are rotated among copies totalling > 4x the L2, so each call reads from memory; the GB/s
count every byte a call must read (packed values and their scales, zeros, absmax) against the
copy bandwidth measured in the run (the bound). The last rows sum one decode step's products
(28 layers; the LM head stays bf16 in the checkpoints, so it is left out).

    python benchmarks/bench_quant_linear.py [--out DIR] [--rows 1,8] [--formats fp8,int4,nf4]
"""

from __future__ import annotations

import argparse
import itertools
import pathlib
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_linear import LAYERS, SHAPES  # noqa: E402
from report import markdown_table, save_bar_plot, save_table  # noqa: E402
from timing import copies_past_l2, copy_bandwidth_gbs, median_time_us, rotating  # noqa: E402

from pagedkv import ops, quant  # noqa: E402

GROUP, NF4_BLOCK, FP8_BLOCK = 128, 64, (128, 128)


def bytes_of(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def fp8_layer(n: int, k: int, device: str):
    """(call(x, out), bytes read) of a random FineGrainedFP8 layer."""
    weight = (torch.randn(n, k, device=device) * 0.5).to(torch.float8_e4m3fn)
    scales = torch.rand(-(-n // FP8_BLOCK[0]), -(-k // FP8_BLOCK[1]), device=device) * 0.01
    w = quant.Fp8Weight(weight, scales, FP8_BLOCK)
    return (lambda x, out: quant.linear_fp8(x, w, out=out)), bytes_of(weight, scales)


def int4_layer(n: int, k: int, device: str):
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, device=device)
    scales = (torch.rand(n, k // GROUP, device=device) * 0.01).to(torch.bfloat16)
    zeros = torch.randint(0, 16, (n, k // GROUP), dtype=torch.uint8, device=device)
    w = quant.pack_w4a16(quant.Int4Weight(q, scales, zeros, GROUP, None))
    return (lambda x, out: quant.linear_w4a16_weight(x, w, out=out)), bytes_of(w.packed, w.scales, w.zeros)


def nf4_layer(n: int, k: int, device: str):
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, device=device)
    absmax = torch.rand(n, k // NF4_BLOCK, device=device)
    code = torch.linspace(-1.0, 1.0, 16, device=device)
    w = quant.pack_nf4(quant.Nf4Weight(q, absmax, code, NF4_BLOCK))
    return (lambda x, out: quant.linear_nf4_weight(x, w, out=out)), bytes_of(w.packed, w.absmax)


def bf16_layer(n: int, k: int, device: str):
    weight = torch.randn(n, k, device=device, dtype=torch.bfloat16)
    return (lambda x, out: ops.linear(x, weight, None, out=out)), bytes_of(weight)


def cublas_layer(n: int, k: int, device: str):
    weight = torch.randn(n, k, device=device, dtype=torch.bfloat16)
    return (lambda x, out: F.linear(x, weight)), bytes_of(weight)


LAYER_MAKERS = {"cuBLAS bf16": cublas_layer, "pagedkv bf16": bf16_layer, "fp8": fp8_layer, "int4": int4_layer,
                "nf4": nf4_layer}


def time_format(make, n: int, k: int, m: int, device: str) -> tuple[float, int]:
    """Median us of one call and the bytes it reads, over weight copies past the L2."""
    _, nbytes = make(n, k, device)
    layers = [make(n, k, device)[0] for _ in range(copies_past_l2(nbytes, device))]
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    out = torch.empty(m, n, device=device, dtype=torch.bfloat16)
    call, calls = rotating([lambda f=f: f(x, out) for f in layers])
    return median_time_us(call, device, calls_per_graph=calls), nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"))
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--formats", default="fp8,int4,nf4")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_quant_linear.py needs a CUDA GPU (it measures memory bandwidth)")
    device = "cuda"
    formats = ["cuBLAS bf16", "pagedkv bf16"] + [f for f in args.formats.split(",") if f]
    unknown = [f for f in formats if f not in LAYER_MAKERS]
    if unknown:
        sys.exit(f"unknown --formats {unknown}; allowed: fp8, int4, nf4")
    copy_gbs = copy_bandwidth_gbs(device)
    table, totals = [], {}
    layer_shapes = {name: nk for name, nk in SHAPES.items() if name != "lm_head"}
    for (name, (n, k, _)), m in itertools.product(layer_shapes.items(), [int(r) for r in args.rows.split(",")]):
        cublas_us = None
        for fmt in formats:
            us, nbytes = time_format(LAYER_MAKERS[fmt], n, k, m, device)
            cublas_us = us if cublas_us is None else cublas_us
            gbs = nbytes / us / 1e3
            bound_us = nbytes / copy_gbs / 1e3
            total = totals.setdefault((fmt, m), [0.0, 0.0])
            total[0] += LAYERS * us
            total[1] += LAYERS * bound_us
            table.append([f"{name} {n}x{k}", m, fmt, f"{us:.1f}", f"{gbs:.0f}", f"{100 * gbs / copy_gbs:.0f}%",
                          f"{cublas_us / us:.2f}"])
    for (fmt, m), (us, bound_us) in totals.items():
        table.append([f"{LAYERS} layers' products", m, fmt, f"{us / 1e3:.3f} ms", "", f"{100 * bound_us / us:.0f}%",
                      f"{totals[('cuBLAS bf16', m)][0] / us:.2f}"])
    header = ["matrix", "rows", "kernel", "us (ms for sums)", "GB/s read", "% of copy bandwidth",
              "vs cuBLAS bf16"]
    title = (f"decode products with quantized weights, W1 shapes, bf16 x, {torch.cuda.get_device_name()}, "
             f"copy bandwidth {copy_gbs:.0f} GB/s (read + write)")
    save_table(args.out, "bench_quant_linear", title, markdown_table(header, table))
    first = [r for r in table if r[1] == table[0][1] and "layers" not in r[0]]
    labels = sorted({r[0].split()[0] for r in first}, key=list(layer_shapes).index)
    series = {fmt: [float(r[5].rstrip("%")) for r in first if r[2] == fmt] for fmt in formats}
    save_bar_plot(args.out, "bench_quant_linear", title + f", {table[0][1]} row(s)", labels, series,
                  "% of copy bandwidth")


if __name__ == "__main__":
    main()
