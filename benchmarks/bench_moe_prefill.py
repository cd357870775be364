"""Issue 32's MoE prefill: the time to the first token of one long prompt on Qwen3-30B-A3B's shape
(random bf16 weights), where every expert is hit. pagedkv with torch's grouped GEMM (one launch a
projection, no host sync), pagedkv with one GEMM per hit expert (the form before it, still used
where the grouped GEMM does not run), and HF eager (its own grouped_mm experts) in the same run,
beside the compute bound: the larger of the step's matrix-product FLOPs over the bf16 GEMM rate measured here and its
weight bytes (every expert is hit; the embedding's rows aside) over the copy bandwidth measured
here.

    python benchmarks/bench_moe_prefill.py [--out DIR] [--prompts 512,2048,8192] [--layers 16]
        [--no-hf] [--small]

Each time is the best of 3 `generate(max_new_tokens=1)` calls (prefill + one sampled token), the
prefix cache dropped before each: a repeated prompt would otherwise find its K/V cached and
compute one token (session 35's first table timed exactly that).
--layers keeps the widths with fewer layers (HF and pagedkv share the weights: 16 layers are
~20 GB); --small: 2 layers, a 1024-token vocabulary, short prompts (a smoke test, CPU too).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import torch
from transformers import Qwen3MoeConfig

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_architectures import QWEN3_30B_A3B, build  # noqa: E402
from bench_generate import seconds  # noqa: E402
from timing import copy_bandwidth_gbs  # noqa: E402
from report import markdown_table, save_bar_plot, save_table  # noqa: E402

import pagedkv  # noqa: E402
from pagedkv.layers import moe  # noqa: E402


def gemm_tflops(device: str, dtype: torch.dtype, n: int = 8192) -> float:
    """The bf16 rate of one large square matrix product here (best of 5), in TFLOP/s."""
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    best = min(seconds(lambda: a @ b, device, repeats=1) for _ in range(5))
    return 2 * n ** 3 / best / 1e12


def prefill_flops(config, tokens: int) -> float:
    """Matrix-product FLOPs of one prompt's prefill: q/k/v/o, the router, top-k experts' three
    projections a token, causal attention (QK^T and PV over half the square), the LM head for one
    token."""
    d, hq, hkv, dh = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    per_token = (d * (hq + 2 * hkv) * dh + hq * dh * d + d * config.num_experts
                 + config.num_experts_per_tok * 3 * d * config.moe_intermediate_size)
    attention = 2 * hq * dh * tokens * tokens  # 2 products x (tokens^2 / 2) x hq x dh, x 2 FLOPs
    return config.num_hidden_layers * (2 * per_token * tokens + attention) + 2 * d * config.vocab_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"))
    parser.add_argument("--prompts", default="512,2048,8192")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    prompts = [64, 256] if args.small else [int(p) for p in args.prompts.split(",")]
    model = build(Qwen3MoeConfig, QWEN3_30B_A3B, 2 if args.small else args.layers, device, dtype,
                  1024 if args.small else None)
    tflops = gemm_tflops(device, dtype, 1024 if args.small else 8192)
    gbs = copy_bandwidth_gbs(device, 1 << 26 if args.small else 1 << 30)
    embed = model.get_input_embeddings().weight
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p is not embed)
    if model.lm_head.weight is embed:  # tied: the LM head reads the table once
        weight_bytes += embed.numel() * embed.element_size()
    read_ms = 1e3 * weight_bytes / (gbs * 1e9)
    print(f"Qwen3-30B-A3B shape, {model.config.num_hidden_layers} layers; GEMM {tflops:.3g} TFLOP/s; copy "
          f"{gbs:.0f} GB/s: weights read once {read_ms:.1f} ms", flush=True)

    def pagedkv_prefill(ids: torch.Tensor) -> torch.Tensor:
        cache = pagedkv.kv_cache_of(model)
        if cache is not None:
            cache.drop_prefix_cache()
        return pagedkv.generate(model, ids, max_new_tokens=1, do_sample=False)

    grouped_mm_runs = moe.grouped_mm_runs
    systems = {"pagedkv, grouped GEMM": pagedkv_prefill, "pagedkv, GEMM per expert": pagedkv_prefill}
    if not args.no_hf:
        systems["HF eager"] = lambda ids: model.generate(ids, max_new_tokens=1, do_sample=False)
    rows, plot = [], {name: [] for name in systems}
    for tokens in prompts:
        ids = torch.randint(3, model.config.vocab_size, (1, tokens), device=device,
                            generator=torch.Generator(device).manual_seed(tokens))
        ms = {}
        for name, run in systems.items():
            moe.grouped_mm_runs = (lambda x, w: False) if name.endswith("per expert") else grouped_mm_runs
            try:
                start = time.perf_counter()
                run(ids)  # warm-up: the cache, cuBLAS handles, kernels
                ms[name] = 1e3 * seconds(lambda: run(ids), device)
            finally:
                moe.grouped_mm_runs = grouped_mm_runs
            print(f"  {tokens} tokens, {name}: {ms[name]:.1f} ms (warm-up {time.perf_counter() - start:.1f} s)",
                  flush=True)
            plot[name].append(ms[name])
        bound = max(1e3 * prefill_flops(model.config, tokens) / (tflops * 1e12), read_ms)
        grouped, per_expert = ms["pagedkv, grouped GEMM"], ms["pagedkv, GEMM per expert"]
        hf = ms.get("HF eager")
        rows.append([tokens, f"{grouped:.1f}", f"{per_expert:.1f}", f"{hf:.1f}" if hf else "", f"{bound:.1f}",
                     f"{grouped / bound:.2f}x", f"{per_expert / grouped:.2f}x", f"{hf / grouped:.2f}x" if hf else ""])
    header = ["prompt tokens", "pagedkv grouped GEMM ms", "pagedkv GEMM per expert ms", "HF eager ms",
              "bound ms (compute or weight read)", "grouped / bound", "speed-up vs per expert", "speed-up vs HF"]
    where = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    title = (f"MoE prefill (time to the first token), Qwen3-30B-A3B shape, {model.config.num_hidden_layers} layers, "
             f"{str(dtype).split('.')[-1]}, batch 1; {where}; GEMM {tflops:.3g} TFLOP/s, copy {gbs:.0f} GB/s")
    save_table(args.out, "bench_moe_prefill", title, markdown_table(header, rows))
    save_bar_plot(args.out, "bench_moe_prefill", title.split(";")[0], [f"{t} tokens" for t in prompts], plot,
                  "ms to the first token")


if __name__ == "__main__":
    main()
