"""Decode-sized matrix products on the W1 (Qwen2.5-7B) layer shapes: pagedkv.ops.linear's
weight-streaming kernel against F.linear (cuBLAS, what HF runs) in the same run, bf16, for 1 and
8 rows. Weights are rotated among copies totalling > 4x the L2 so each call reads from memory.

    python benchmarks/bench_linear.py [--out DIR] [--rows 1,2,4,8] [--shapes w1|smollm2]
Prints and saves bench_linear.md/.png: microseconds, GB/s of weight bytes, % of copy bandwidth.
"""

from __future__ import annotations

import argparse
import itertools
import pathlib
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from report import markdown_table, save_bar_plot, save_table  # noqa: E402
from timing import copies_past_l2, copy_bandwidth_gbs, median_time_us, rotating  # noqa: E402

from pagedkv import ops  # noqa: E402

# name: (n, k, bias) for Qwen2.5-7B: hidden 3584, 28 q / 4 kv heads of 128, inter 18944.
SHAPES = {
    "qkv": (4608, 3584, True), "o": (3584, 3584, False), "gate_up": (37888, 3584, False),
    "down": (3584, 18944, False), "lm_head": (152064, 3584, False),
}
LAYERS = 28
# --shapes smollm2: the default model, SmolLM2-135M (hidden 576, 9 q / 3 kv heads of 64, inter
# 1536, vocab 49152, 30 layers): matrices of 0.7-3.5 MB, where a launch's fixed cost decides.
SMOLLM2_SHAPES = {
    "qkv": (960, 576, False), "o": (576, 576, False), "gate_up": (3072, 576, False),
    "down": (576, 1536, False), "lm_head": (49152, 576, False),
}
SMOLLM2_LAYERS = 30
ROWS = [1, 2, 4, 8]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"))
    parser.add_argument("--shapes", choices=("w1", "smollm2"), default="w1")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)),
                        help="rows of x, comma-separated (9-16: speculative verification steps)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_linear.py needs a CUDA GPU (it measures memory bandwidth)")
    device, dtype = "cuda", torch.bfloat16
    copy_gbs = copy_bandwidth_gbs(device)
    rows_out, totals = [], {}
    row_counts = [int(r) for r in args.rows.split(",")]
    shapes, layers = (SHAPES, LAYERS) if args.shapes == "w1" else (SMOLLM2_SHAPES, SMOLLM2_LAYERS)
    for (name, (n, k, with_bias)), m in itertools.product(shapes.items(), row_counts):
        nbytes = n * k * 2
        weights = [torch.randn(n, k, device=device, dtype=dtype) for _ in range(copies_past_l2(nbytes, device))]
        bias = torch.randn(n, device=device, dtype=dtype) if with_bias else None
        x = torch.randn(m, k, device=device, dtype=dtype)
        out = torch.empty(m, n, device=device, dtype=dtype)
        hf_call, calls = rotating([lambda w=w: F.linear(x, w, bias) for w in weights])
        ours_call, _ = rotating([lambda w=w: ops.linear(x, w, bias, out=out) for w in weights])
        hf_us = median_time_us(hf_call, device, calls_per_graph=calls)
        ours_us = median_time_us(ours_call, device, calls_per_graph=calls)
        hf_gbs, ours_gbs = nbytes / hf_us / 1e3, nbytes / ours_us / 1e3
        per_step = 1 if name == "lm_head" else layers
        totals.setdefault(m, [0.0, 0.0])
        totals[m][0] += per_step * hf_us
        totals[m][1] += per_step * ours_us
        rows_out.append([f"{name} {n}x{k}", m, hf_us, ours_us, hf_gbs, ours_gbs,
                         f"{100 * ours_gbs / copy_gbs:.0f}%", hf_us / ours_us])
        del weights
    for m, (hf_total, ours_total) in totals.items():
        rows_out.append([f"all of one {args.shapes} decode step", m, hf_total, ours_total, "", "", "",
                         hf_total / ours_total])
    header = ["matrix", "rows", "F.linear (cuBLAS) us", "pagedkv us", "cuBLAS GB/s", "pagedkv GB/s",
              "pagedkv % of copy", "speed-up"]
    title = (f"decode GEMV, bf16, {torch.cuda.get_device_name()}, copy bandwidth {copy_gbs:.0f} GB/s "
             f"(read + write)")
    save_table(args.out, "bench_linear", title, markdown_table(header, rows_out))
    single = [r for r in rows_out if r[1] == row_counts[0] and not str(r[0]).startswith("all")]
    save_bar_plot(args.out, "bench_linear", title + f", {row_counts[0]} row(s)", [r[0].split()[0] for r in single],
                  {"cuBLAS": [r[4] for r in single], "pagedkv": [r[5] for r in single]}, "GB/s of weights")


if __name__ == "__main__":
    main()
