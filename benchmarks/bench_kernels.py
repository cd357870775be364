"""The decode-step kernels side by side with the HF way, in the same run (Qwen2.5-7B shapes):
  rope     pagedkv rope_and_write_kv vs HF apply_rotary_pos_emb + DynamicCache's torch.cat
           (past of 1024 tokens) for one layer
  silu     pagedkv silu_and_mul vs HF's act_fn(gate) * up (intermediate 18944)
  sample   pagedkv sample vs HF's argmax (greedy) and its Temperature/TopK/TopP warpers +
           softmax + multinomial (T=0.7, top-k 20, top-p 0.9), vocab 151936, fp32 logits
  copy     pagedkv copy_blocks vs a per-layer `cache[dst] = cache[src]` (28 layers, 16 blocks)

    python benchmarks/bench_kernels.py [--out DIR] [--device cuda|cpu]
Prints and saves bench_kernels.md and one bench_kernels_<op>.png per op: microseconds, speed-up.
CUDA timings replay CUDA graphs, except HF's sampling (eager, as generate() runs it) and copy
(eager on both sides: copy-on-write is issued from the host).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch
import torch.nn.functional as F
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from report import markdown_table, save_bar_plot, save_table  # noqa: E402
from timing import median_time_us  # noqa: E402

from pagedkv import ops  # noqa: E402

HQ, HKV, D, INTERMEDIATE, VOCAB, LAYERS = 28, 4, 128, 18944, 151936, 28
PAST = 1024


def bench_rope(device, dtype, sizes):
    cos_sin = torch.randn(PAST + 4096 + 1, D, device=device)
    rows = []
    for n in sizes:
        qkv = torch.randn(n, (HQ + 2 * HKV) * D, device=device, dtype=dtype)
        q = qkv[:, : HQ * D].view(n, HQ, D)
        k = qkv[:, HQ * D : (HQ + HKV) * D].view(n, HKV, D)
        v = qkv[:, (HQ + HKV) * D :].view(n, HKV, D)
        # HF decode (n sequences, 1 new token each) or prefill (1 sequence of n tokens).
        batch, seq = (n, 1) if n <= 256 else (1, n)
        past_k = torch.randn(batch, HKV, PAST, D, device=device, dtype=dtype)
        past_v = torch.randn_like(past_k)
        cos = torch.randn(batch, seq, D, device=device, dtype=dtype)
        sin = torch.randn_like(cos)
        hq = q.view(batch, seq, HQ, D).transpose(1, 2)
        hk = k.view(batch, seq, HKV, D).transpose(1, 2)
        hv = v.view(batch, seq, HKV, D).transpose(1, 2)

        def hf_step():
            q_embed, k_embed = apply_rotary_pos_emb(hq, hk, cos, sin)
            return q_embed, torch.cat([past_k, k_embed], dim=-2), torch.cat([past_v, hv], dim=-2)

        num_blocks = (n + PAST + 15) // 16 * 2
        k_cache = torch.zeros(num_blocks, 16, HKV, D, device=device, dtype=dtype)
        v_cache = torch.zeros_like(k_cache)
        slots = torch.arange(n, dtype=torch.int32, device=device) + PAST
        positions = slots.clone()
        hf_us = median_time_us(hf_step, device)
        ours_us = median_time_us(
            lambda: ops.rope_and_write_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slots), device)
        rows.append([n, hf_us, ours_us, hf_us / ours_us])
    return ["tokens", "HF rope + cat us", "pagedkv us", "speed-up"], rows


def bench_silu(device, dtype, sizes):
    rows = []
    for n in sizes:
        x = torch.randn(n, 2 * INTERMEDIATE, device=device, dtype=dtype)
        gate, up = x.chunk(2, dim=-1)
        out = torch.empty(n, INTERMEDIATE, device=device, dtype=dtype)
        hf_us = median_time_us(lambda: F.silu(gate) * up, device)
        ours_us = median_time_us(lambda: ops.silu_and_mul(x, out=out), device)
        moved = 3 * n * INTERMEDIATE * x.element_size()
        rows.append([n, hf_us, ours_us, moved / ours_us / 1e3, hf_us / ours_us])
    return ["tokens", "HF silu(gate)*up us", "pagedkv us", "pagedkv GB/s", "speed-up"], rows


def bench_sample(device, sizes):
    warpers = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(20), TopPLogitsWarper(0.9)])
    rows = []
    for batch in sizes:
        logits = torch.randn(batch, VOCAB, device=device) * 3
        out = torch.empty(batch, dtype=torch.int64, device=device)
        full = lambda v, dt: torch.full((batch,), v, dtype=dt, device=device)  # noqa: E731
        params = (full(0.7, torch.float32), full(20, torch.int32), full(0.9, torch.float32),
                  torch.arange(batch, device=device), full(0, torch.int64))

        def hf_sample():
            probs = F.softmax(warpers(None, logits), dim=-1)
            return torch.multinomial(probs, num_samples=1)

        hf_greedy = median_time_us(lambda: logits.argmax(-1), device)
        ours_greedy = median_time_us(lambda: ops.sample(logits, out=out), device)
        hf_us = median_time_us(hf_sample, device, graph=False)
        ours_us = median_time_us(lambda: ops.sample(logits, *params, out=out), device)
        rows.append([batch, hf_greedy, ours_greedy, hf_us, ours_us, hf_us / ours_us])
    header = ["batch", "HF argmax us", "pagedkv greedy us", "HF top-k/top-p us", "pagedkv top-k/top-p us",
              "sampling speed-up"]
    return header, rows


def bench_copy(device, dtype, sizes):
    rows = []
    for pairs in sizes:
        k_caches = [torch.randn(256, 16, HKV, D, device=device, dtype=dtype) for _ in range(LAYERS)]
        v_caches = [torch.randn_like(c) for c in k_caches]
        src = torch.arange(pairs, dtype=torch.int32, device=device)
        dst = src + 128

        def torch_loop():
            for c in k_caches + v_caches:
                c[dst] = c[src]

        # Eager on both sides: copy-on-write is issued from the host, outside the step's graph.
        torch_us = median_time_us(torch_loop, device, graph=False)
        ours_us = median_time_us(lambda: ops.copy_blocks(k_caches, v_caches, src, dst), device, graph=False)
        rows.append([pairs, torch_us, ours_us, torch_us / ours_us])
    return ["block pairs", "per-layer indexing us", "pagedkv us", "speed-up"], rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = args.device
    cuda = device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    where = torch.cuda.get_device_name() if cuda else "cpu"
    args.out.mkdir(parents=True, exist_ok=True)

    sections = []
    for name, title, (header, rows) in [
        ("rope", f"RoPE + KV write, {HQ}/{HKV} heads x {D}, {dtype}",
         bench_rope(device, dtype, [1, 8, 32, 128, 4096] if cuda else [1, 8, 32])),
        ("silu", f"SiLU * mul, intermediate {INTERMEDIATE}, {dtype}",
         bench_silu(device, dtype, [1, 8, 32, 256, 4096] if cuda else [1, 8, 32])),
        ("sample", f"sampling, vocab {VOCAB}, float32 logits",
         bench_sample(device, [1, 8, 32, 128] if cuda else [1, 4])),
        ("copy", f"copy_blocks, {LAYERS} layers, blocks of 16 x {HKV} x {D}, {dtype}",
         bench_copy(device, dtype, [1, 16] if cuda else [1, 4])),
    ]:
        sections.append(f"### {title}\n\n{markdown_table(header, rows)}")
        baseline, ours = (3, 4) if name == "sample" else (1, 2)
        save_bar_plot(args.out, f"bench_kernels_{name}", f"{title}, {where}", [str(r[0]) for r in rows],
                      {header[baseline]: [r[baseline] for r in rows], header[ours]: [r[ours] for r in rows]},
                      "microseconds")
    save_table(args.out, "bench_kernels", f"Decode-step kernels vs the HF way, {where}", "\n\n".join(sections))


if __name__ == "__main__":
    main()
