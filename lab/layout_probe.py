"""W3's paged decode over other physical cache layouts and block orders, against dense SDPA, in
one run with the rounds interleaved (a question for the cache's design, not a benchmark of
record: bench_attention.py is that). The op reads any cache strides but head_dim's, so each
layout below is a view of one allocation and needs no kernel change:

  separate            K and V each [num_blocks, 16, Hkv, D] (what the cache manager allocates)
  kv_block            [num_blocks, 2, 16, Hkv, D]: a block's K and V adjacent (64 KB runs)
  kv_token            [num_blocks, 16, 2, Hkv, D]: a token's K and V rows adjacent
  kv_block_headmajor  [num_blocks, 2, Hkv, 16, D]
  kv_head             [num_blocks, Hkv, 2, 16, D]: one head's K and V of a block adjacent
  skew_<bytes>        separate K and V in one allocation, V starting <bytes> after K's end (the
                      kernel reads a stage's K and V rows together; two tensors of whole 2 MB
                      pages put them a multiple of 2 MB apart)

Block orders: shuffled (a random permutation of the pool), sorted (the same blocks, each
sequence's in ascending physical order), sequential (each sequence's blocks one after another).

    python lab/layout_probe.py [--points 16x4096,...] [--layouts separate,...] [--rounds N]
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
from timing import copies_past_l2, median_time_us, rotating  # noqa: E402

from pagedkv import ops  # noqa: E402

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
LAYOUTS = ["separate", "kv_block", "kv_token", "kv_block_headmajor", "kv_head"]


def make_caches(layout: str, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V caches as [num_blocks, 16, Hkv, D] views (strides per layout) of one allocation."""
    def randn(*shape):
        return torch.randn(num_blocks, *shape, dtype=DTYPE, device="cuda")

    b, h, d = BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM
    if layout == "separate":
        return randn(b, h, d), randn(b, h, d)
    if layout == "kv_block":
        kv = randn(2, b, h, d)
        return kv[:, 0], kv[:, 1]
    if layout == "kv_token":
        kv = randn(b, 2, h, d)
        return kv[:, :, 0], kv[:, :, 1]
    if layout == "kv_block_headmajor":
        kv = randn(2, h, b, d)
        return kv[:, 0].transpose(1, 2), kv[:, 1].transpose(1, 2)
    if layout == "kv_head":
        kv = randn(h, 2, b, d)
        return kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
    if layout.startswith("skew_"):
        skew = int(layout.removeprefix("skew_"))
        elems = num_blocks * b * h * d
        if skew % 16 or skew < 0:
            raise ValueError(f"layout {layout!r}: the skew must be a non-negative multiple of 16 bytes")
        flat = torch.randn(2 * elems + skew // DTYPE.itemsize, dtype=DTYPE, device="cuda")
        v0 = elems + skew // DTYPE.itemsize
        return flat[:elems].view(num_blocks, b, h, d), flat[v0:v0 + elems].view(num_blocks, b, h, d)
    raise ValueError(f"unknown layout {layout!r}; allowed: {', '.join(LAYOUTS)}, skew_<bytes>")


def time_rotating(calls) -> float:
    fn, calls_per_graph = rotating(calls)
    return median_time_us(fn, "cuda", calls_per_graph=calls_per_graph)


def probe_point(batch: int, context: int, layouts: list[str], rounds: int) -> None:
    max_blocks = context // BLOCK_SIZE
    num_blocks = batch * max_blocks
    kv_bytes = 2 * num_blocks * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize
    copies = copies_past_l2(kv_bytes, "cuda")
    q = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    shuffled = torch.randperm(num_blocks, device="cuda").view(batch, max_blocks).int()
    tables = {"shuffled": shuffled, "sorted": shuffled.sort(dim=1).values.contiguous(),
              "sequential": torch.arange(num_blocks, device="cuda").view(batch, max_blocks).int()}
    out = torch.empty_like(q)
    scale = HEAD_DIM**-0.5
    dense = [tuple(torch.randn(batch, NUM_KV_HEADS, context, HEAD_DIM, dtype=DTYPE, device="cuda")
                   for _ in range(2)) for _ in range(copies)]

    def sdpa(k, v):
        return F.scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=scale, enable_gqa=True)

    times: dict[str, list[float]] = {}
    for _ in range(rounds):
        times.setdefault("dense SDPA", []).append(time_rotating([lambda d=d: sdpa(*d) for d in dense]))
        for layout in layouts:
            caches = [make_caches(layout, num_blocks) for _ in range(copies)]
            workspace = ops.paged_decode_workspace(q, caches[0][0], shuffled)
            for order, table in tables.items():
                def call(k, v, table=table):
                    ops.paged_decode_attention(q, k, v, table, lens, scale, out=out, workspace=workspace)

                times.setdefault(f"{layout}, {order}", []).append(
                    time_rotating([lambda c=c: call(*c) for c in caches]))
            del caches
            torch.cuda.empty_cache()

    sdpa_us = sorted(times["dense SDPA"])[len(times["dense SDPA"]) // 2]
    print(f"\n## {batch}x{context} (K/V {kv_bytes / 1e9:.3f} GB, {copies} cache copies)")
    print("| layout, order | us per round | GB/s per round | dense SDPA's median time / this |")
    print("|---|---|---|---|")
    for name, us in times.items():
        gbs = [kv_bytes / (u * 1e-6) / 1e9 for u in us]
        print(f"| {name} | {' / '.join(f'{u:.1f}' for u in us)} | {' / '.join(f'{g:.0f}' for g in gbs)} "
              f"| {' / '.join(f'{sdpa_us / u:.3f}' for u in us)} |")


def check_views(layouts: list[str]) -> None:
    """Each layout's strided views give what contiguous copies of them give (ragged lengths)."""
    for layout in layouts:
        k, v = make_caches(layout, 64)
        q = torch.randn(4, NUM_Q_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
        table = torch.randperm(64, device="cuda").view(4, 16).int()
        lens = torch.tensor([1, 16, 17, 256], dtype=torch.int32, device="cuda")
        strided = ops.paged_decode_attention(q, k, v, table, lens, HEAD_DIM**-0.5)
        packed = ops.paged_decode_attention(q, k.contiguous(), v.contiguous(), table, lens, HEAD_DIM**-0.5)
        if not torch.equal(strided, packed):
            raise SystemExit(f"layout {layout}: strided views and contiguous copies disagree")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", default="16x4096,64x2048,256x1024,1x32768", help="BATCHxCONTEXT,...")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("layout_probe.py needs a CUDA GPU")
    torch.manual_seed(0)
    layouts = args.layouts.split(",")
    check_views(layouts)
    for point in args.points.split(","):
        batch, context = map(int, point.split("x"))
        probe_point(batch, context, layouts, args.rounds)


if __name__ == "__main__":
    main()
