"""Residual add + RMSNorm: pagedkv's fused kernel against HF's own Qwen2RMSNorm module (plain
PyTorch: add, then norm) in the same run. bf16, hidden 3584 (Qwen2.5-7B), tokens 1..4096.

    python benchmarks/bench_norm.py [--out DIR] [--device cuda|cpu]
Prints and saves bench_norm.md and bench_norm.png: microseconds, GB/s of bytes moved, speed-up.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from report import markdown_table, save_bar_plot, save_table  # noqa: E402
from timing import median_time_us  # noqa: E402

from pagedkv import ops  # noqa: E402

HIDDEN = 3584
TOKENS = [1, 8, 32, 256, 4096]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32

    hf_norm = Qwen2RMSNorm(HIDDEN, eps=1e-6).to(device=device, dtype=dtype)
    with torch.no_grad():
        hf_norm.weight.uniform_(0.5, 1.5)
    weight = hf_norm.weight.detach()

    rows = []
    for n in TOKENS:
        x = torch.randn(n, HIDDEN, device=device, dtype=dtype)
        residual = torch.randn_like(x)

        def hf_step():
            with torch.no_grad():
                r = x + residual
                return hf_norm(r), r

        def pagedkv_step():
            # In place, as in the decode loop: the values drift but the work per call is fixed.
            ops.fused_add_rms_norm(x, residual, weight, 1e-6)

        hf_us = median_time_us(hf_step, device)
        ours_us = median_time_us(pagedkv_step, device)
        moved = 4 * x.numel() * x.element_size()  # fewest bytes: read x, residual; write both
        rows.append([n, hf_us, ours_us, moved / ours_us / 1e3, hf_us / ours_us])

    header = ["tokens", "HF add+Qwen2RMSNorm us", "pagedkv fused us", "pagedkv GB/s", "speed-up vs HF"]
    title = f"add + RMSNorm, hidden {HIDDEN}, {dtype}, {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}"
    save_table(args.out, "bench_norm", title, markdown_table(header, rows))
    save_bar_plot(args.out, "bench_norm", title, [str(r[0]) for r in rows],
                  {"HF": [r[1] for r in rows], "pagedkv": [r[2] for r in rows]}, "microseconds")


if __name__ == "__main__":
    main()
