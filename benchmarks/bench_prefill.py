"""Paged prefill attention alone. bf16, 32 q / 8 kv heads, head_dim 128, block 16, physical blocks
shuffled; every sequence of a point has `new` tokens at the end of a `context` (new == context:
fresh prompts; new < context: a prefix-cache hit or a later chunk of a chunked prefill). Side by
side in one run:

- pagedkv.ops.paged_prefill_attention (CUDA graph replay; its split workspace allocated once);
- the HF way: gather the blocks into dense K/V, then scaled_dot_product_attention with the causal
  mask of the last `new` positions;
- dense SDPA on contiguous K/V (no gather), same mask: the bar for "paging costs nothing".

TFLOP/s counts 4 * Hq * D per (query, visible key) pair.

    python benchmarks/bench_prefill.py [--out DIR] [--device cuda|cpu] [--small]
--small runs small sizes (the default on the CPU). Prints and saves bench_prefill.md/.png.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from report import markdown_table, save_bar_plot, save_table  # noqa: E402
from timing import median_time_us  # noqa: E402

from pagedkv import ops  # noqa: E402

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
# batch, new, context; 1x128/8192: a short turn after a long cached conversation (key splits).
POINTS = [(1, 2048, 2048), (4, 1024, 1024), (1, 512, 8192), (1, 128, 8192), (8, 256, 2048),
          (16, 128, 4096)]
SMALL_POINTS = [(1, 128, 128), (2, 32, 256)]
DTYPE = torch.bfloat16


def bench_point(batch: int, new: int, context: int, device: str) -> dict:
    max_blocks = context // BLOCK_SIZE
    num_blocks = batch * max_blocks
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, dtype=DTYPE, device=device)
    v_cache = torch.randn(shape, dtype=DTYPE, device=device)
    table = torch.randperm(num_blocks, device=device).view(batch, max_blocks).to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=device) * new
    q = torch.randn(batch * new, NUM_Q_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    scale = HEAD_DIM**-0.5
    out = torch.empty_like(q)
    table_long = table.long()
    positions = context - new + torch.arange(new, device=device)
    mask = torch.arange(context, device=device)[None, :] <= positions[:, None]  # [new, context]
    q_dense = q.view(batch, new, NUM_Q_HEADS, HEAD_DIM).transpose(1, 2)

    workspace = ops.paged_prefill_workspace(q, k_cache, table, new)

    def pagedkv():
        ops.paged_prefill_attention(q, k_cache, v_cache, table, lens, qsl, scale, new, out=out,
                                    workspace=workspace)

    def gather(cache):  # [B, Hkv, context, D], as HF's paged path assembles K/V before SDPA
        return cache[table_long].view(batch, context, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2)

    def gather_sdpa():
        return F.scaled_dot_product_attention(q_dense, gather(k_cache), gather(v_cache), attn_mask=mask,
                                              scale=scale, enable_gqa=True)

    k_dense, v_dense = gather(k_cache).contiguous(), gather(v_cache).contiguous()

    def dense_sdpa():
        return F.scaled_dot_product_attention(q_dense, k_dense, v_dense, attn_mask=mask, scale=scale,
                                              enable_gqa=True)

    pagedkv()
    expected = dense_sdpa().transpose(1, 2).reshape_as(out)
    row = {"point": f"{batch}x{new}/{context}", "max_diff": (out.float() - expected.float()).abs().max().item(),
           "splits": ops.paged_prefill_num_splits(q, k_cache, table, new)}
    pairs = batch * (new * (context - new) + new * (new + 1) // 2)
    for name, fn in (("pagedkv", pagedkv), ("gather", gather_sdpa), ("dense", dense_sdpa)):
        us = median_time_us(fn, device)
        row[f"{name}_us"] = us
        row[f"{name}_tflops"] = 4 * NUM_Q_HEADS * HEAD_DIM * pairs / (us * 1e-6) / 1e12
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help="small sizes (always on the CPU)")
    args = parser.parse_args()
    device = args.device
    torch.manual_seed(0)
    rows = []
    for point in SMALL_POINTS if args.small or device == "cpu" else POINTS:
        rows.append(bench_point(*point, device))
        if device == "cuda":
            torch.cuda.empty_cache()

    header = ["batch x new/context", "key splits", "pagedkv us", "pagedkv TFLOP/s", "gather+SDPA us",
              "gather+SDPA TFLOP/s", "dense SDPA TFLOP/s", "speed-up vs gather+SDPA", "max abs diff vs SDPA"]
    table_rows = [[r["point"], r["splits"], r["pagedkv_us"], r["pagedkv_tflops"], r["gather_us"], r["gather_tflops"],
                   r["dense_tflops"], r["gather_us"] / r["pagedkv_us"], r["max_diff"]] for r in rows]
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    title = (f"Paged prefill attention, {str(DTYPE).removeprefix('torch.')}, {NUM_Q_HEADS} q / {NUM_KV_HEADS} kv "
             f"heads, head_dim {HEAD_DIM}, block {BLOCK_SIZE}, {name}")
    save_table(args.out, "bench_prefill", title, markdown_table(header, table_rows))
    series = {"pagedkv": [r["pagedkv_tflops"] for r in rows], "gather+SDPA": [r["gather_tflops"] for r in rows],
              "dense SDPA": [r["dense_tflops"] for r in rows]}
    save_bar_plot(args.out, "bench_prefill", title, [r["point"] for r in rows], series, "TFLOP/s")


if __name__ == "__main__":
    main()
