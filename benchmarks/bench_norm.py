"""Residual add + RMSNorm, and Gemma-2/3's sandwich (norm the sublayer output, add, norm the next
input): pagedkv's fused kernels against HF's own modules (plain PyTorch) in the same run, and the
sandwich in one launch against the two pagedkv launches it replaces. bf16, hidden 3584 (Qwen2.5-7B,
Gemma-2-9B), tokens 1..4096.

    python benchmarks/bench_norm.py [--out DIR] [--device cuda|cpu]
Prints and saves bench_norm.md / bench_norm_sandwich.md and their PNGs: microseconds, GB/s of the
fewest bytes each form must move, speed-ups.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch
from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from report import markdown_table, save_bar_plot, save_table  # noqa: E402
from timing import median_time_us  # noqa: E402

from pagedkv import ops  # noqa: E402

HIDDEN = 3584
TOKENS = [1, 8, 32, 256, 4096]
EPS = 1e-6


def add_norm_rows(device: str, dtype: torch.dtype) -> list[list[object]]:
    hf_norm = Qwen2RMSNorm(HIDDEN, eps=EPS).to(device=device, dtype=dtype)
    with torch.no_grad():
        hf_norm.weight.uniform_(0.5, 1.5)
    weight = hf_norm.weight.detach()
    rows: list[list[object]] = []
    for n in TOKENS:
        x = torch.randn(n, HIDDEN, device=device, dtype=dtype)
        residual = torch.randn_like(x)

        def hf_step():
            with torch.no_grad():
                r = x + residual
                return hf_norm(r), r

        def pagedkv_step():
            # In place, as in the decode loop: the values drift but the work per call is fixed.
            ops.fused_add_rms_norm(x, residual, weight, EPS)

        hf_us = median_time_us(hf_step, device)
        ours_us = median_time_us(pagedkv_step, device)
        moved = 4 * x.numel() * x.element_size()  # fewest bytes: read x, residual; write both
        rows.append([n, hf_us, ours_us, moved / ours_us / 1e3, hf_us / ours_us])
    return rows


def sandwich_rows(device: str, dtype: torch.dtype) -> list[list[object]]:
    post, pre = (Gemma2RMSNorm(HIDDEN, eps=EPS).to(device=device, dtype=dtype) for _ in range(2))
    with torch.no_grad():
        post.weight.normal_(0, 0.5)
        pre.weight.normal_(0, 0.5)
    post_w, pre_w = post.weight.detach(), pre.weight.detach()
    rows: list[list[object]] = []
    for n in TOKENS:
        x = torch.randn(n, HIDDEN, device=device, dtype=dtype)
        residual = torch.randn_like(x)
        normed = torch.empty_like(x)

        def hf_step():  # Gemma2DecoderLayer's order
            with torch.no_grad():
                r = residual + post(x)
                return pre(r), r

        def two_launches():  # what pagedkv's Gemma-2/3 decoder ran before the fused form
            ops.rms_norm(x, post_w, EPS, out=normed, gemma_style=True)
            ops.fused_add_rms_norm(normed, residual, pre_w, EPS, gemma_style=True)

        def one_launch():  # in place, as in the decoder: the values drift, the work does not
            ops.fused_add_rms_norm(x, residual, pre_w, EPS, gemma_style=True, input_weight=post_w)

        hf_us = median_time_us(hf_step, device)
        two_us = median_time_us(two_launches, device)
        one_us = median_time_us(one_launch, device)
        moved = 4 * x.numel() * x.element_size()  # fewest bytes: read x, residual; write both
        rows.append([n, hf_us, two_us, one_us, moved / one_us / 1e3, two_us / one_us, hf_us / one_us])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    where = torch.cuda.get_device_name() if device == "cuda" else "cpu"

    rows = add_norm_rows(device, dtype)
    header = ["tokens", "HF add+Qwen2RMSNorm us", "pagedkv fused us", "pagedkv GB/s", "speed-up vs HF"]
    title = f"add + RMSNorm, hidden {HIDDEN}, {dtype}, {where}"
    save_table(args.out, "bench_norm", title, markdown_table(header, rows))
    save_bar_plot(args.out, "bench_norm", title, [str(r[0]) for r in rows],
                  {"HF": [r[1] for r in rows], "pagedkv": [r[2] for r in rows]}, "microseconds")

    rows = sandwich_rows(device, dtype)
    header = ["tokens", "HF norm+add+Gemma2RMSNorm us", "pagedkv 2 launches us", "pagedkv 1 launch us",
              "1 launch GB/s", "1 launch vs 2", "1 launch vs HF"]
    title = f"Gemma-2 sandwich: RMSNorm + add + RMSNorm, hidden {HIDDEN}, {dtype}, {where}"
    save_table(args.out, "bench_norm_sandwich", title, markdown_table(header, rows))
    save_bar_plot(args.out, "bench_norm_sandwich", title, [str(r[0]) for r in rows],
                  {"HF": [r[1] for r in rows], "pagedkv, 2 launches": [r[2] for r in rows],
                   "pagedkv, 1 launch": [r[3] for r in rows]}, "microseconds")


if __name__ == "__main__":
    main()
