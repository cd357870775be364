"""Diagnostics for the two open speed gaps, for one device call (lab/gpu_counters.sh runs it):

  counters  one launch of each kernel below, between cudaProfilerStart/Stop, for Nsight Compute
            (`ncu --profile-from-start off`): the GEMV at 1 row (CUDA cores) against 8 rows
            (tensor cores) on W1's down and gate_up shapes (issue 5: 8 rows are ~7% slower per
            byte of weight), and paged decode attention against dense SDPA at 1 x 8192 and
            16 x 4096 (issue 4: 1.02 and 0.96 of dense SDPA's GB/s in session 9).
  sweep     paged decode attention's time over num_splits at a few batch x context points, by
            CUDA-graph replay of calls rotating among cache copies past the L2: is the automatic
            split count the best one?
  sweep-w1  the same at W1's decode shapes (28 q / 4 kv heads; block tables of 16 blocks, as
            generate() reserves for prompt 128 + 128 new tokens, the contexts 128-256 of the run):
            in a W1 step attention is ~5% of the time and latency-bound, with 4 splits chosen.

    python lab/kernel_counters.py counters|sweep|sweep-w1 [--points BxC,...] [--heads Q,KV] [--head-dim D]
(--points replaces a sweep's batch x context points; --heads and --head-dim its attention shape.)
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
from timing import copies_past_l2, median_time_us, rotating  # noqa: E402

from pagedkv import ops  # noqa: E402

HIDDEN, INTERMEDIATE = 3584, 18944  # W1 (Qwen2.5-7B)
# Paged decode vs dense SDPA: batch 1 (latency-bound) and 16 x 4096 (bandwidth-bound, 0.96 of
# SDPA in session 9: 2830 vs 2940 GB/s).
ATTENTION_POINTS = [(1, 8192), (16, 4096)]
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16


def attention_inputs(batch: int, context: int, heads=(NUM_Q_HEADS, NUM_KV_HEADS), table_tokens=None,
                     head_dim: int = HEAD_DIM):
    """q, caches, a shuffled block table of table_tokens (default: context) per row, lens."""
    num_q_heads, num_kv_heads = heads
    blocks = batch * (table_tokens or context) // BLOCK_SIZE
    k_cache = torch.randn(blocks, BLOCK_SIZE, num_kv_heads, head_dim, dtype=DTYPE, device="cuda")
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(blocks, device="cuda", dtype=torch.int32).view(batch, -1)
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, num_q_heads, head_dim, dtype=DTYPE, device="cuda")
    return q, k_cache, v_cache, table, lens


def cases() -> list[tuple[str, Callable[[], object]]]:
    out = []
    down = torch.randn(HIDDEN, INTERMEDIATE, dtype=DTYPE, device="cuda")
    gate_up = torch.randn(2 * INTERMEDIATE, HIDDEN, dtype=DTYPE, device="cuda")
    for rows in (1, 8):
        x_down = torch.randn(rows, INTERMEDIATE, dtype=DTYPE, device="cuda")
        x_up = torch.randn(rows, HIDDEN, dtype=DTYPE, device="cuda")
        out.append((f"down {HIDDEN}x{INTERMEDIATE}, {rows} rows", lambda x=x_down: ops.linear(x, down)))
        out.append((f"gate_up {2 * INTERMEDIATE}x{HIDDEN}, {rows} rows",
                    lambda x=x_up: ops.gate_up_silu(x, gate_up)))
    for batch, context in ATTENTION_POINTS:
        q, k_cache, v_cache, table, lens = attention_inputs(batch, context)
        workspace = ops.paged_decode_workspace(q, k_cache, table)
        out.append((f"paged decode {batch}x{context}", functools.partial(
            ops.paged_decode_attention, q, k_cache, v_cache, table, lens, HEAD_DIM ** -0.5,
            workspace=workspace)))
        k = torch.randn(batch, NUM_KV_HEADS, context, HEAD_DIM, dtype=DTYPE, device="cuda")
        v = torch.randn_like(k)
        q4 = q.view(batch, NUM_Q_HEADS, 1, HEAD_DIM)
        out.append((f"dense SDPA {batch}x{context}", functools.partial(
            F.scaled_dot_product_attention, q4, k, v, enable_gqa=True)))
    return out


def counters() -> None:
    todo = cases()
    for _, fn in todo:  # warm-up: allocator, cuBLAS/SDPA kernel choice
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for name, fn in todo:
        torch.cuda.nvtx.range_push(name)
        fn()
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print("profiled, in order:", "; ".join(name for name, _ in todo))


# (batch, context) points of the split sweep: batch 1 (W1's case), and batches whose automatic
# split counts are small (W3's larger points, where several waves of CTAs run) or in between.
SWEEP_POINTS = [(1, 1024), (1, 8192), (1, 32768), (4, 8192), (16, 4096), (64, 2048), (256, 1024)]
# W1: (batch, context) with tables of 256 tokens; contexts at the start, middle and end of the run.
W1_HEADS, W1_TABLE_TOKENS = (28, 4), 256
W1_SWEEP_POINTS = [(1, 128), (1, 192), (1, 256), (8, 192), (32, 192)]


def sweep(points, heads=(NUM_Q_HEADS, NUM_KV_HEADS), table_tokens=None, head_dim: int = HEAD_DIM) -> None:
    print(f"| batch x context ({heads[0]} q / {heads[1]} kv heads, head_dim {head_dim}) | num_splits | us | GB/s of K/V |")
    print("|---|---|---|---|")
    for batch, context in points:
        kv_bytes = 2 * batch * context * heads[1] * head_dim * DTYPE.itemsize
        # Copies rotated as in bench_attention: a cache smaller than the L2 would be timed from it.
        sets = [attention_inputs(batch, context, heads, table_tokens, head_dim)
                for _ in range(copies_past_l2(kv_bytes, "cuda"))]
        q, k_cache, _, table, _ = sets[0]
        auto = ops.paged_decode_num_splits(q, k_cache, table)
        max_blocks = table.shape[1]
        candidates = {1, 2, 3, 4, 6, 8, 16, 32, 48, 64, 96, 128, 256, auto, max(1, auto // 2), 2 * auto}
        for splits in sorted(candidates):
            if splits > max_blocks or splits > max(16, 4 * auto):
                continue
            workspace = ops.paged_decode_workspace(q, k_cache, table, splits)
            fn, per_graph = rotating([lambda s=s: ops.paged_decode_attention(
                *s[:5], head_dim ** -0.5, workspace=workspace, num_splits=splits) for s in sets])
            us = median_time_us(fn, "cuda", calls_per_graph=per_graph)
            mark = " (auto)" if splits == auto else ""
            print(f"| {batch}x{context} | {splits}{mark} | {us:.1f} | {kv_bytes / us / 1e3:.0f} |", flush=True)
        del sets
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["counters", "sweep", "sweep-w1"])
    parser.add_argument("--points", type=lambda text: [tuple(map(int, p.split("x"))) for p in text.split(",")],
                        help="batch x context points of a sweep, e.g. 1x512,8x512 (default: the mode's own)")
    parser.add_argument("--heads", type=lambda text: tuple(map(int, text.split(","))), default=None,
                        help="query,kv heads of a sweep (default: the mode's own), e.g. 16,8 for Gemma-2-9B")
    parser.add_argument("--head-dim", type=int, default=HEAD_DIM, help="head_dim of a sweep")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("kernel_counters.py: needs a CUDA GPU")
    if args.mode == "counters":
        counters()
    elif args.mode == "sweep":
        sweep(args.points or SWEEP_POINTS, args.heads or (NUM_Q_HEADS, NUM_KV_HEADS), head_dim=args.head_dim)
    else:
        sweep(args.points or W1_SWEEP_POINTS, args.heads or W1_HEADS, W1_TABLE_TOKENS, args.head_dim)


if __name__ == "__main__":
    main()
