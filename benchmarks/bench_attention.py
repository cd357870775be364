"""W3: paged decode attention alone. bf16, 32 q / 8 kv heads, head_dim 128, block 16, every
sequence of the batch at the full context, physical blocks shuffled (`--table sequential`: each
sequence's blocks in order, one after another, as a fresh cache allocates them; what the shuffle
costs in DRAM locality). Side by side in one run:

- pagedkv.ops.paged_decode_attention (CUDA graph replay, workspace preallocated), and with the
  shuffled table also over the same caches through sequential tables (what block scatter costs);
- the HF way: gather the blocks into dense K/V, then scaled_dot_product_attention;
- pagedkv's tensor-core prefill kernel (ops.paged_prefill_attention) on the same decode batch,
  one query row per sequence and no split of the context: how fast an mma.sync path with K/V
  tiles staged in shared memory reads the cache where the grid is full (large batches), the
  question for a tensor-core decode kernel (head-major storage, measured here before, read no
  faster than the [block, kv_heads] layout: lab/measurements.md);
- dense SDPA on a contiguous cache (no gather): the bar for "paging costs nothing";
- pagedkv over dense SDPA's own tensors (each [B, Hkv, S, D] read as 16-row blocks through the
  cache strides): the kernel on the same bytes in the same order, so the gap to dense SDPA splits
  into the kernel's part and the paged layout's;
- FlashInfer's BatchDecodeWithPagedKVCacheWrapper, when `flashinfer` imports (skipped otherwise).

GB/s counts the K/V bytes read (B * context * kv_heads * head_dim * 2 bytes * 2), compared with
the measured device-to-device copy bandwidth (timing.copy_bandwidth_gbs). Every system's timed
calls rotate among copies of the caches totalling > 4x the L2 ("cache copies"), so each call
reads K/V from memory, as in a model step.

`--kv-dtypes bf16,fp8` (the default; either alone): all of the above over bf16 caches, then a
second table of pagedkv alone over e4m3 caches (torch.float8_e4m3fn: random normal values stored
as x / scale, one fp32 scale for K and one for V, 1/16, so no value near e4m3's +-448 and no NaN
byte; bf16 q and out), its GB/s counting the 1-byte K/V elements it reads, checked against dense
SDPA on the dequantized cache in bf16 (exact: e4m3 values times a power of two).

    python benchmarks/bench_attention.py [--out DIR] [--device cuda|cpu] [--small]
                                         [--table shuffled|sequential] [--kv-dtypes bf16,fp8]
--small runs small sizes (the default on the CPU), to smoke-test the script without a GPU.
Prints and saves bench_attention.md and bench_attention.png.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from report import markdown_table, save_bar_plot, save_table  # noqa: E402
from timing import copies_past_l2, copy_bandwidth_gbs, median_time_us, rotating  # noqa: E402

from pagedkv import ops  # noqa: E402

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
POINTS = [(1, 1024), (1, 8192), (1, 32768), (16, 4096), (64, 2048), (256, 1024)]  # batch, context
SMALL_POINTS = [(1, 256), (1, 2048), (4, 512), (16, 128)]
DTYPE = torch.bfloat16
FP8, FP8_SCALE = torch.float8_e4m3fn, 1 / 16  # a power of two: the dequantized cache is exact in bf16
KV_DTYPES = ("bf16", "fp8")


class FlashInferDecode:
    """FlashInfer's paged decode over the same NHD caches and block table, or why it cannot run."""

    def __init__(self, k_cache, v_cache, table, context, q):
        self.reason = ""
        try:
            import flashinfer
        except ImportError:
            self.reason = "flashinfer not installed"
            return
        batch, max_blocks = table.shape
        device = q.device
        try:
            # Tensor cores: FlashInfer's faster decode path for GQA groups of 4 and more.
            self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                torch.empty(128 << 20, dtype=torch.uint8, device=device), "NHD",
                use_tensor_cores=NUM_Q_HEADS // NUM_KV_HEADS >= 4,
            )
            self.wrapper.plan(
                torch.arange(batch + 1, dtype=torch.int32, device=device) * max_blocks,
                table.flatten(),
                torch.full((batch,), (context - 1) % BLOCK_SIZE + 1, dtype=torch.int32, device=device),
                NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE,
                pos_encoding_mode="NONE", q_data_type=q.dtype, kv_data_type=k_cache.dtype,
            )
        except Exception as err:  # an API this script does not know: report, do not fail
            self.reason = f"flashinfer {getattr(flashinfer, '__version__', '?')}: {type(err).__name__}: {err}"
            return
        self.caches, self.q = (k_cache, v_cache), q

    def __call__(self, caches=None):
        return self.wrapper.run(self.q, caches or self.caches)


def time_us(calls, device) -> float:
    """Median microseconds of one call, the calls (one per copy of the inputs) taken in turn."""
    fn, per_graph = rotating(calls)
    try:
        return median_time_us(fn, device, calls_per_graph=per_graph)
    except RuntimeError:  # not capturable in a CUDA graph: time plain launches instead
        torch.cuda.synchronize()
        return median_time_us(fn, device, graph=False)


def decode_batch(batch: int, context: int, device: str, table_order: str, cache_dtype: torch.dtype):
    """(cache copies, block table, context lens, q, K/V bytes a call reads) of one point. Copies of
    the caches to rotate among: a 1x8192 bf16 cache (34 MB) fits the H100's 50 MB L2, and timing
    repeats over one copy would measure the L2, not the memory a model step reads from."""
    max_blocks = context // BLOCK_SIZE
    num_blocks = batch * max_blocks
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    kv_bytes = 2 * num_blocks * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * cache_dtype.itemsize

    def random_cache():  # fp8: N(0, 1) stored as x / FP8_SCALE, clamped so that no byte is NaN
        if cache_dtype != FP8:
            return torch.randn(shape, dtype=cache_dtype, device=device)
        return (torch.randn(shape, device=device) / FP8_SCALE).clamp(-448, 448).to(FP8)

    caches = [(random_cache(), random_cache()) for _ in range(copies_past_l2(kv_bytes, device))]
    order = torch.randperm if table_order == "shuffled" else torch.arange
    table = order(num_blocks, device=device).view(batch, max_blocks).to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    return caches, table, lens, q, kv_bytes


def bench_point(batch: int, context: int, device: str, table_order: str = "shuffled") -> dict:
    max_blocks = context // BLOCK_SIZE
    num_blocks = batch * max_blocks
    caches, table, lens, q, kv_bytes = decode_batch(batch, context, device, table_order, DTYPE)
    copies = len(caches)
    scale = HEAD_DIM**-0.5
    out = torch.empty_like(q)
    workspace = ops.paged_decode_workspace(q, caches[0][0], table)
    table_long = table.long()

    def pagedkv(k_cache, v_cache, table=table):
        ops.paged_decode_attention(q, k_cache, v_cache, table, lens, scale, out=out, workspace=workspace)

    def gather(cache):  # [B, Hkv, context, D], as HF's paged path assembles K/V before SDPA
        return cache[table_long].view(batch, max_blocks * BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2)

    def gather_sdpa(k_cache, v_cache):
        return F.scaled_dot_product_attention(q.unsqueeze(2), gather(k_cache), gather(v_cache),
                                              scale=scale, enable_gqa=True)

    dense = [(gather(k).contiguous(), gather(v).contiguous()) for k, v in caches]

    def dense_sdpa(k_dense, v_dense):
        return F.scaled_dot_product_attention(q.unsqueeze(2), k_dense, v_dense, scale=scale, enable_gqa=True)

    row = {"point": f"{batch}x{context}", "splits": ops.paged_decode_num_splits(q, caches[0][0], table),
           "copies": copies}
    pagedkv(*caches[0])
    expected = dense_sdpa(*dense[0]).squeeze(2)
    row["max_diff"] = (out.float() - expected.float()).abs().max().item()
    row["pagedkv_us"] = time_us([lambda c=c: pagedkv(*c) for c in caches], device)
    row["sequential_us"] = None
    if table_order == "shuffled":  # the same caches, each sequence's blocks in order
        in_order = torch.arange(num_blocks, device=device).view(batch, max_blocks).to(torch.int32)
        row["sequential_us"] = time_us([lambda c=c: pagedkv(*c, table=in_order) for c in caches], device)
    row["gather_us"] = time_us([lambda c=c: gather_sdpa(*c) for c in caches], device)
    row["dense_us"] = time_us([lambda d=d: dense_sdpa(*d) for d in dense], device)
    # The kernel over dense SDPA's own [B, Hkv, S, D] tensors, each read as a cache of 16-row blocks
    # through the cache strides (sequence b's blocks b * Hkv * max_blocks + i): the same bytes in
    # the same order as dense SDPA's kernel, so the kernel's cost apart from the paged layout's.
    dense_blocks = (batch - 1) * NUM_KV_HEADS * max_blocks + max_blocks  # the view stays in bounds
    dense_table = (torch.arange(batch, device=device)[:, None] * (NUM_KV_HEADS * max_blocks)
                   + torch.arange(max_blocks, device=device)).to(torch.int32)

    def as_cache(t):  # [B, Hkv, S, D] -> [dense_blocks, block, Hkv, D], no copy
        return t.as_strided((dense_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM),
                            (BLOCK_SIZE * HEAD_DIM, HEAD_DIM, context * HEAD_DIM, 1))

    on_dense = [(as_cache(k), as_cache(v)) for k, v in dense]
    pagedkv(*on_dense[0], table=dense_table)
    row["max_diff_on_dense"] = (out.float() - expected.float()).abs().max().item()
    row["on_dense_us"] = time_us([lambda d=d: pagedkv(*d, table=dense_table) for d in on_dense], device)
    # The prefill kernel on the same batch: each sequence's one new token is row b of q.
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device=device)
    prefill_out = torch.empty_like(q)
    prefill_workspace = ops.paged_prefill_workspace(q, caches[0][0], table, 1)  # key splits at batch 1

    def pagedkv_prefill(k_cache, v_cache):
        ops.paged_prefill_attention(q, k_cache, v_cache, table, lens, query_start_loc, scale,
                                    max_query_len=1, out=prefill_out, workspace=prefill_workspace)

    pagedkv_prefill(*caches[0])
    row["max_diff_prefill"] = (prefill_out.float() - expected.float()).abs().max().item()
    row["prefill_us"] = time_us([lambda c=c: pagedkv_prefill(*c) for c in caches], device)
    row["flashinfer_us"] = None
    if device == "cuda":
        flashinfer = FlashInferDecode(*caches[0], table, context, q)
        if flashinfer.reason:
            row["flashinfer_note"] = flashinfer.reason
        else:
            fi_diff = (flashinfer().float() - expected.float()).abs().max().item()
            row["flashinfer_us"] = time_us([lambda c=c: flashinfer(c) for c in caches], device)
            row["flashinfer_note"] = f"FlashInfer max abs diff vs dense SDPA {fi_diff:.3g}"
    for name in ("pagedkv", "sequential", "on_dense", "prefill", "gather", "dense", "flashinfer"):
        us = row[f"{name}_us"]
        row[f"{name}_gbs"] = kv_bytes / (us * 1e-6) / 1e9 if us else None
    return row


def bench_fp8_point(batch: int, context: int, device: str, table_order: str = "shuffled") -> dict:
    """pagedkv over an e4m3 cache: us, GB/s of the 1-byte K/V read (shuffled or in-order blocks)
    and the max abs diff against dense SDPA on the dequantized cache."""
    caches, table, lens, q, kv_bytes = decode_batch(batch, context, device, table_order, FP8)
    k_scale, v_scale = (torch.full((1,), FP8_SCALE, dtype=torch.float32, device=device) for _ in range(2))
    scale = HEAD_DIM**-0.5
    out = torch.empty_like(q)
    workspace = ops.paged_decode_workspace(q, caches[0][0], table)

    def pagedkv(k_cache, v_cache, table=table):
        ops.paged_decode_attention(q, k_cache, v_cache, table, lens, scale, out=out, workspace=workspace,
                                   k_scale=k_scale, v_scale=v_scale)

    def dequantized(cache):  # [B, Hkv, context, D] in bf16
        return ((cache.to(DTYPE) * FP8_SCALE)[table.long()].view(batch, context, NUM_KV_HEADS, HEAD_DIM)
                .transpose(1, 2))

    row = {"point": f"{batch}x{context}", "splits": ops.paged_decode_num_splits(q, caches[0][0], table),
           "copies": len(caches)}
    pagedkv(*caches[0])
    expected = F.scaled_dot_product_attention(q.unsqueeze(2), *map(dequantized, caches[0]), scale=scale,
                                              enable_gqa=True).squeeze(2)
    row["max_diff"] = (out.float() - expected.float()).abs().max().item()
    row["pagedkv_us"] = time_us([lambda c=c: pagedkv(*c) for c in caches], device)
    row["sequential_us"] = None
    if table_order == "shuffled":
        in_order = torch.arange(table.numel(), device=device).view_as(table).to(torch.int32)
        row["sequential_us"] = time_us([lambda c=c: pagedkv(*c, table=in_order) for c in caches], device)
    for name in ("pagedkv", "sequential"):
        us = row[f"{name}_us"]
        row[f"{name}_gbs"] = kv_bytes / (us * 1e-6) / 1e9 if us else None
    return row


def fp8_table(rows: list[dict], bf16_rows: list[dict], copy_gbs: float) -> str:
    """The fp8 cache's rows; beside each, the bf16 cache's time at the same point over its own."""
    bf16_us = {r["point"]: r["pagedkv_us"] for r in bf16_rows}
    header = ["batch x context", "splits", "cache copies", "pagedkv us", "pagedkv GB/s", "% of copy BW",
              "pagedkv GB/s, blocks in order", "bf16 cache us / fp8 cache us", "max abs diff vs SDPA (dequantized)"]
    return markdown_table(header, [
        [r["point"], r["splits"], r["copies"], r["pagedkv_us"], r["pagedkv_gbs"], 100 * r["pagedkv_gbs"] / copy_gbs,
         r["sequential_gbs"] if r["sequential_gbs"] is not None else "n/a",
         bf16_us[r["point"]] / r["pagedkv_us"] if r["point"] in bf16_us else "n/a", r["max_diff"]] for r in rows])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help="small sizes (always on the CPU)")
    parser.add_argument("--table", choices=["shuffled", "sequential"], default="shuffled",
                        help="physical block order of the block tables (default shuffled)")
    parser.add_argument("--kv-dtypes", default=",".join(KV_DTYPES),
                        help="comma-separated cache dtypes to time: bf16 (every system), fp8 (e4m3, pagedkv)")
    args = parser.parse_args(argv)
    kv_dtypes = args.kv_dtypes.split(",")
    if set(kv_dtypes) - set(KV_DTYPES):
        parser.error(f"--kv-dtypes {args.kv_dtypes!r}: a comma-separated list of {', '.join(KV_DTYPES)}")
    device = args.device
    small = args.small or device == "cpu"
    torch.manual_seed(0)

    copy_gbs = copy_bandwidth_gbs(device, nbytes=(1 << 26) if small else (1 << 30))
    rows, fp8_rows, notes = [], [], []
    for batch, context in (SMALL_POINTS if small else POINTS) if "bf16" in kv_dtypes else []:
        r = bench_point(batch, context, device, args.table)
        rows.append(r)
        if r.get("flashinfer_note"):  # why it did not run (once), or its accuracy (per point)
            notes.append(r["flashinfer_note"] if r["flashinfer_us"] is None else f"{r['point']}: {r['flashinfer_note']}")
        if device == "cuda":
            torch.cuda.empty_cache()
    for batch, context in (SMALL_POINTS if small else POINTS) if "fp8" in kv_dtypes else []:
        fp8_rows.append(bench_fp8_point(batch, context, device, args.table))
        if device == "cuda":
            torch.cuda.empty_cache()

    def gbs(v):
        return v if v is not None else "n/a"

    def ratio(r, name):  # pagedkv's GB/s over another system's, from the same run
        return r["pagedkv_gbs"] / r[f"{name}_gbs"] if r[f"{name}_gbs"] else "n/a"

    header = ["batch x context", "splits", "cache copies", "pagedkv us", "pagedkv GB/s", "% of copy BW",
              "pagedkv GB/s, blocks in order", "pagedkv GB/s on dense SDPA's tensors", "prefill kernel GB/s",
              "gather+SDPA us", "gather+SDPA GB/s",
              "dense SDPA GB/s", "FlashInfer GB/s", "vs gather+SDPA", "vs dense SDPA", "vs FlashInfer",
              "on dense SDPA's tensors vs dense SDPA", "max abs diff vs SDPA"]
    table_rows = [[r["point"], r["splits"], r["copies"], r["pagedkv_us"], r["pagedkv_gbs"], 100 * r["pagedkv_gbs"] / copy_gbs,
                   gbs(r["sequential_gbs"]), r["on_dense_gbs"], r["prefill_gbs"], r["gather_us"], r["gather_gbs"],
                   r["dense_gbs"],
                   gbs(r["flashinfer_gbs"]), ratio(r, "gather"), ratio(r, "dense"), ratio(r, "flashinfer"),
                   r["on_dense_gbs"] / r["dense_gbs"],
                   max(r["max_diff"], r["max_diff_prefill"], r["max_diff_on_dense"])] for r in rows]
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    caches = {"bf16": "bf16 caches", "fp8": f"fp8 e4m3 caches (scale 1/{1 / FP8_SCALE:g} for K and V, pagedkv only)"}
    title = (f"W3 paged decode attention, {str(DTYPE).removeprefix('torch.')} q, "
             f"{' and '.join(caches[d] for d in KV_DTYPES if d in kv_dtypes)}, {NUM_Q_HEADS} q / {NUM_KV_HEADS} kv heads, "
             f"head_dim {HEAD_DIM}, block {BLOCK_SIZE}, {args.table} blocks, {name}; "
             f"copy bandwidth {copy_gbs:.0f} GB/s")
    text = "\n\n".join(
        ([markdown_table(header, table_rows)] if rows else [])
        + (["fp8 (e4m3) cache, pagedkv alone; GB/s of the 1-byte K/V elements read:\n\n"
            + fp8_table(fp8_rows, rows, copy_gbs)] if fp8_rows else []))
    if notes:
        text += "\n\n" + "\n".join(f"- {n}" for n in dict.fromkeys(notes))
    save_table(args.out, "bench_attention", title, text)
    series = {} if not rows else {
        "pagedkv": [r["pagedkv_gbs"] for r in rows],
        **({"pagedkv, blocks in order": [r["sequential_gbs"] for r in rows]} if args.table == "shuffled" else {}),
        "pagedkv on dense SDPA's tensors": [r["on_dense_gbs"] for r in rows],
        "pagedkv prefill kernel": [r["prefill_gbs"] for r in rows],
        "gather+SDPA": [r["gather_gbs"] for r in rows],
        "dense SDPA": [r["dense_gbs"] for r in rows]}
    if any(r["flashinfer_gbs"] for r in rows):
        series["FlashInfer"] = [r["flashinfer_gbs"] or 0.0 for r in rows]
    if fp8_rows:
        series["pagedkv, fp8 cache"] = [r["pagedkv_gbs"] for r in fp8_rows]
    plot_title = f"W3 paged decode attention, {name}; copy bandwidth {copy_gbs:.0f} GB/s"
    save_bar_plot(args.out, "bench_attention", plot_title, [r["point"] for r in rows or fp8_rows], series,
                  "GB/s of K/V read")


if __name__ == "__main__":
    main()
