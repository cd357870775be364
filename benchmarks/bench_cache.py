"""Host cost of the paged KV cache's bookkeeping: building one decode step's metadata (block
tables, context lengths, slots, positions; plus the one pinned->device copy on CUDA) for
B = 1, 64, 256 running sequences of 1k-4k tokens, and add / append / fork / free throughput.

There is no HF counterpart of block bookkeeping, so the table puts the goal beside it (under
50 us per step at B=256: the host must never hold the GPU back) and, as "the HF way" of a decode
step's cache work, DynamicCache.update (a torch.cat of K and V per layer) for one token at the
same batch and lengths, Qwen3-0.6B's cache shape (28 layers, 8 kv heads, head_dim 128, bf16),
where it fits in memory.

    python benchmarks/bench_cache.py [--out DIR] [--device cuda|cpu] [--no-hf]
Prints and saves bench_cache.md and bench_cache.png.
"""

from __future__ import annotations

import argparse
import pathlib
import random
import statistics
import sys
import time
from typing import Callable

import torch
from transformers import DynamicCache

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from report import markdown_table, save_bar_plot, save_table  # noqa: E402
from timing import median_time_us  # noqa: E402

from pagedkv import KVCache  # noqa: E402

BATCHES = [1, 64, 256]
MIN_LEN, MAX_LEN = 1024, 4096
STEPS = 200  # timed decode steps; sequences grow by one token each
BLOCK_SIZE = 16
GOAL_US = 50.0  # per decode step at B=256
# The bookkeeping does not depend on the model shape: a tiny K/V keeps the cache small.
TINY = dict(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float16, block_size=BLOCK_SIZE)
HF_LAYERS, HF_KV_HEADS, HF_HEAD_DIM = 28, 8, 128  # Qwen3-0.6B


def host_us(fn: Callable[[], object], repeats: int, device: str) -> float:
    """Median host microseconds of one call. On CUDA the device is synced between calls, outside
    the timing, as the token read-back of a real step does."""
    samples = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


def running_cache(batch: int, device: str, rng: random.Random) -> tuple[KVCache, list[int]]:
    lens = [rng.randint(MIN_LEN, MAX_LEN) for _ in range(batch)]
    max_seq_len = MAX_LEN + 2 * STEPS + 64
    cache = KVCache(**TINY, num_blocks=batch * -(-max_seq_len // BLOCK_SIZE), device=device,
                    max_seq_len=max_seq_len, max_batch_size=max(batch, 8))
    for seq_id, n in enumerate(lens):
        cache.add_sequence(seq_id, [rng.randrange(32000) for _ in range(n)])
    return cache, list(range(batch))


def hf_update_us(batch: int, lens: list[int], device: str) -> float | None:
    """DynamicCache.update of one new token in every layer, past length max(lens) (a dense batch
    pads to its longest sequence); None when the cache would not fit comfortably."""
    past = max(lens)
    nbytes = 2 * HF_LAYERS * batch * HF_KV_HEADS * past * HF_HEAD_DIM * 2
    budget = torch.cuda.mem_get_info()[0] * 0.3 if device == "cuda" else 4 << 30
    if 2 * nbytes > budget:  # torch.cat holds old and new tensors at once
        return None
    shape = (batch, HF_KV_HEADS, past, HF_HEAD_DIM)
    layers = [(torch.randn(shape, dtype=torch.bfloat16, device=device),) * 2 for _ in range(HF_LAYERS)]
    hf_cache = DynamicCache(layers)
    new = torch.randn(batch, HF_KV_HEADS, 1, HF_HEAD_DIM, dtype=torch.bfloat16, device=device)

    def step():
        for layer in range(HF_LAYERS):
            hf_cache.update(new, new, layer)

    us = median_time_us(step, device, repeats=20, graph=False)
    del hf_cache, layers
    return us


def decode_rows(device: str, with_hf: bool) -> list[list[object]]:
    rows = []
    for batch in BATCHES:
        rng = random.Random(batch)
        cache, seq_ids = running_cache(batch, device, rng)
        lens = [cache.seq_len(s) for s in seq_ids]
        build = host_us(lambda: cache.build_metadata(seq_ids), STEPS, device)
        tokens = [rng.randrange(32000) for _ in seq_ids]

        def decode_step():
            cache.append_batch(seq_ids, tokens)
            return cache.build_metadata(seq_ids)

        step = host_us(decode_step, STEPS, device)
        hf = hf_update_us(batch, lens, device) if with_hf else None
        goal = GOAL_US if batch == 256 else "-"
        rows.append([batch, f"{min(lens)}-{max(lens)}", build, step, goal, "-" if hf is None else hf])
        del cache
    return rows


def throughput_rows(device: str) -> list[list[object]]:
    rng = random.Random(0)
    batch, prompt_len = 256, 1024
    max_seq_len = 4096
    cache = KVCache(**TINY, num_blocks=8 * batch * max_seq_len // BLOCK_SIZE, device=device,
                    max_seq_len=max_seq_len, max_batch_size=batch)
    prompts = [[rng.randrange(32000) for _ in range(prompt_len)] for _ in range(batch)]
    rows = []

    def timed(label: str, calls: int, items_per_call: int, item: str, fn: Callable[[int], object]) -> None:
        start = time.perf_counter()
        for i in range(calls):
            fn(i)
        us = (time.perf_counter() - start) * 1e6 / calls
        rows.append([label, us, f"{items_per_call / us * 1e6:,.0f} {item}/s"])

    timed(f"add, {prompt_len}-token prompt, no prefix hit", batch, prompt_len, "tokens",
          lambda i: cache.add_sequence(i, prompts[i]))
    ids = list(range(batch))
    timed(f"append_batch, B={batch}, 1 token each", 100, batch, "tokens",
          lambda i: cache.append_batch(ids, [i] * batch))
    timed("append_tokens, 1 sequence, 1 token", 1000, 1, "tokens", lambda i: cache.append_tokens(i % batch, [i]))
    timed(f"fork, {prompt_len + 100}-token sequence", batch, 1, "forks", lambda i: cache.fork(i, batch + i))
    timed("free", 2 * batch, 1, "frees", lambda i: cache.free(i))
    timed(f"add, {prompt_len}-token prompt, {prompt_len - BLOCK_SIZE} tokens cached", batch, prompt_len, "tokens",
          lambda i: cache.add_sequence(i, prompts[0][: prompt_len - 8] + prompts[i][:8]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-hf", action="store_true", help="skip the DynamicCache column")
    args = parser.parse_args()
    where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    copy = " + pinned->device copy" if args.device == "cuda" else ""

    decode = decode_rows(args.device, not args.no_hf)
    header = ["batch", "seq lens", f"build_metadata{copy} us", "append_batch + build us", "goal us",
              "HF way: DynamicCache.update, 28 layers, us"]
    ops = throughput_rows(args.device)
    title = (f"paged KV cache bookkeeping, block {BLOCK_SIZE}, host time per decode step ({where}); "
             "no HF equivalent of block bookkeeping: goal < 50 us at B=256")
    text = (markdown_table(header, decode) + "\n\nadd / append / fork / free throughput\n\n"
            + markdown_table(["operation", "us per call", "throughput"], ops))
    save_table(args.out, "bench_cache", title, text)
    save_bar_plot(args.out, "bench_cache", title.split(";")[0], [f"B={r[0]}" for r in decode],
                  {"build_metadata": [r[2] for r in decode], "append_batch + build": [r[3] for r in decode],
                   "goal (B=256)": [GOAL_US] * len(decode)}, "microseconds per step")


if __name__ == "__main__":
    main()
