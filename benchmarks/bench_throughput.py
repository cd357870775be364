"""W2: offline throughput of many requests, nano-vllm's workload: a Qwen3-0.6B-shaped model
(random bf16 weights), 256 requests, prompt and output lengths each uniform in [100, 1024]
(random.seed(0), prompt ids uniform in [0, 10000], temperature 0.6, EOS ignored). pagedkv.LLM
against HF's continuous batching (``generate_batch``'s manager, attn_implementation
"paged|sdpa") in the same run: output tokens / s end to end, the table, and a PNG of tok/s over
time for both.

    python benchmarks/bench_throughput.py [--out DIR] [--num-requests 256] [--no-hf] [--small]
                                          [--serial-too] [--kv-cache-dtype auto|fp8]

--small: a 2-layer narrow model, 16 short requests, on the CPU (a smoke test of the script).
--serial-too: also run pagedkv.LLM with overlap_steps=False (each step waits for the one before),
the engine's own A/B of its host/device overlap in the same run.
--kv-cache-dtype fp8: pagedkv.LLM stores K/V as e4m3 (kv_cache_dtype="fp8") with LLM's default
scales (the random-weight model carries no k_scale/v_scale: 1.0 for K and V in every layer; the
table says which it used); default auto, the model's dtype. HF has no fp8 cache: its row keeps its
model-dtype cache, and each row's "of the bound" is against the bound of its own cache's bytes.
"""

from __future__ import annotations

import argparse
import pathlib
import random
import sys
import time

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3Config

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from report import markdown_table, save_table  # noqa: E402
from throughput_bound import matmul_tflops, w2_bound_seconds  # noqa: E402
from timing import copy_bandwidth_gbs  # noqa: E402

import pagedkv  # noqa: E402

W2 = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
          num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
          max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6)
SMALL = dict(W2, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, vocab_size=10496)
TEMPERATURE = 0.6


def workload(num_requests: int, lo: int, hi: int) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's bench.py: prompts then output lengths, from random.seed(0)."""
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(lo, hi))]
               for _ in range(num_requests)]
    max_tokens = [random.randint(lo, hi) for _ in range(num_requests)]
    return prompts, max_tokens


def build_model(small: bool, device: str):
    config = Qwen3Config(**(SMALL if small else W2))
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def cache_label(cache) -> str:
    """The KV cache as the table names it: its dtype, and an fp8 cache's per-layer scales."""
    if cache.kv_scales is None:
        return str(cache.kv.dtype).removeprefix("torch.")
    low, high = cache.kv_scales.min().item(), cache.kv_scales.max().item()
    scales = f"scale {low:g}" if low == high else f"scales {low:g} to {high:g}"
    return f"fp8 e4m3, {scales} (K and V, every layer)"


def run_pagedkv(model, prompts, max_tokens, device, args, overlap_steps: bool | None = None
                ) -> tuple[float, int, list[tuple[float, int]], str]:
    """(seconds, output tokens, [(t, cumulative output tokens)] after each step, cache_label)."""
    llm = pagedkv.LLM(model, max_num_seqs=args.max_num_seqs, overlap_steps=overlap_steps,
                      kv_cache_dtype=args.kv_cache_dtype,
                      max_num_batched_tokens=args.max_num_batched_tokens,
                      max_model_len=4096 if device == "cuda" else 2048,
                      kv_cache_memory=args.kv_cache_fraction if device == "cuda" else 256 << 20)
    # Warm-up: the decode batch shrinks by one a step, so every batch bucket's graph is captured.
    # Its prompts share no prefix with the workload's (no prefix-cache hits carried over).
    warm = min(args.max_num_seqs, len(prompts))
    llm.generate([[10001 + i] * 16 for i in range(warm)],
                 [pagedkv.SamplingParams(max_tokens=i + 1, temperature=TEMPERATURE, ignore_eos=True)
                  for i in range(warm)], use_tqdm=False)
    params = [pagedkv.SamplingParams(max_tokens=m, temperature=TEMPERATURE, ignore_eos=True, seed=i)
              for i, m in enumerate(max_tokens)]
    generated0 = llm.stats.num_generated_tokens
    for prompt, p in zip(prompts, params):
        llm.add_request(prompt, p)
    sync(device)
    start = time.perf_counter()
    timeline = [(0.0, 0)]
    while llm.has_unfinished_requests():
        llm.step(partial=False)
        timeline.append((time.perf_counter() - start, llm.stats.num_generated_tokens - generated0))
    sync(device)
    seconds = time.perf_counter() - start
    tokens = llm.stats.num_generated_tokens - generated0
    cache = cache_label(llm.cache)
    print(f"pagedkv: {llm.stats}, KV cache {cache}")
    del llm
    if device == "cuda":
        torch.cuda.empty_cache()
    return seconds, tokens, timeline, cache


def run_hf(model, prompts, max_tokens, device) -> tuple[float, int, list[tuple[float, int]]]:
    """HF continuous batching through generate_batch's manager (per-request max_new_tokens)."""
    model.set_attn_implementation("paged|sdpa")
    config = GenerationConfig(do_sample=True, temperature=TEMPERATURE, top_k=0, top_p=1.0,
                              eos_token_id=None, pad_token_id=0, max_new_tokens=max(max_tokens))
    model.generate_batch(inputs=[prompts[0][:64]] * 4, generation_config=config, max_new_tokens=8)
    finish_times: list[tuple[float, int]] = []
    with model.continuous_batching_context_manager(generation_config=config, block=True,
                                                   timeout=5) as manager:
        sync(device)
        start = time.perf_counter()  # the manager's warm-up (on entering) is not timed
        for i, (prompt, m) in enumerate(zip(prompts, max_tokens)):
            manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=m, record_timestamps=True)
        done: dict[str, object] = {}
        while len(done) < len(prompts):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                done[result.request_id] = result
                finish_times.append((time.perf_counter() - start, len(result.generated_tokens)))
            elif result is None and not manager.is_running():
                raise RuntimeError("HF's continuous batching thread stopped")
    sync(device)
    seconds = time.perf_counter() - start
    tokens = sum(len(r.generated_tokens) for r in done.values())
    stamps = sorted(t for r in done.values() for t in (getattr(r, "timestamps", None) or []))
    if stamps and start <= stamps[0] and stamps[-1] <= start + seconds:  # per-token stamps
        timeline = [(0.0, 0)] + [(t - start, i + 1) for i, t in enumerate(stamps)] + [(seconds, tokens)]
    else:  # no per-token perf_counter stamps: a request's tokens count when it finishes
        timeline, total = [(0.0, 0)], 0
        for t, n in sorted(finish_times):
            total += n
            timeline.append((t, total))
    return seconds, tokens, timeline


def rate_curve(timeline: list[tuple[float, int]], bins: int = 60) -> tuple[list[float], list[float]]:
    end = timeline[-1][0]
    width = end / bins if end > 0 else 1.0
    xs, ys, j = [], [], 0
    prev = 0
    for b in range(1, bins + 1):
        t = b * width
        while j + 1 < len(timeline) and timeline[j + 1][0] <= t:
            j += 1
        xs.append(t)
        ys.append((timeline[j][1] - prev) / width)
        prev = timeline[j][1]
    return xs, ys


def save_rate_plot(out_dir: pathlib.Path, curves: dict[str, list[tuple[float, int]]],
                   bound: float | None = None, bound_label: str = "bound") -> pathlib.Path:
    """Left: tok/s over time, log scale (HF runs ~35x slower, flat on a linear axis); right: each
    system's end-to-end tok/s beside the bound."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bars) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    for label, timeline in curves.items():
        ax.plot(*rate_curve(timeline), label=label)
    ax.set_yscale("log", nonpositive="mask")
    ax.set_xscale("log")
    ax.set_xlabel("seconds since the requests were queued (log)")
    ax.set_ylabel("output tokens / s (log)")
    ax.set_title("W2 throughput over time")
    ax.legend(fontsize=8)
    names = list(curves)
    rates = [curves[n][-1][1] / curves[n][-1][0] for n in names]
    bars.barh(names, rates, color=[f"C{i}" for i in range(len(names))])
    for i, rate in enumerate(rates):
        bars.text(rate, i, f" {rate:,.0f}", va="center", fontsize=8)
    if bound is not None:
        bars.axvline(bound, color="k", linestyle="--", label=f"{bound_label} {bound:,.0f}")
        bars.legend(fontsize=8, loc="lower right")
    if max(rates + [bound or 0]) > 10 * min(rates):  # HF beside pagedkv: a log axis
        from matplotlib.ticker import NullFormatter

        bars.set_xscale("log")
        bars.xaxis.set_minor_formatter(NullFormatter())
        bars.set_xlabel("output tokens / s, end to end (log)")
    else:
        bars.set_xlabel("output tokens / s, end to end")
    bars.tick_params(axis="y", labelsize=8)
    fig.tight_layout()
    path = out_dir / "bench_throughput.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def kv_bounds(model, prompts, max_tokens, copy_gbs: float, tflops: float, kv_size: int
              ) -> tuple[dict[int, float], str]:
    """W2's bound in tok/s by bytes per cached K/V element, for pagedkv's cache (kv_size) and HF's
    (the model's dtype), and the note that explains them."""
    model_kv_size = model.dtype.itemsize
    whose = {kv_size: "pagedkv's cache"}
    whose[model_kv_size] = "HF's cache" if model_kv_size != kv_size else "pagedkv's and HF's caches"
    bounds, notes = {}, []
    for size, who in whose.items():
        decode_s, prefill_s = w2_bound_seconds(model, prompts, max_tokens, copy_gbs, tflops, size)
        bounds[size] = sum(max_tokens) / (decode_s + prefill_s)
        notes.append(f"{bounds[size]:,.0f} tok/s with K/V at {size} B an element ({who}; "
                     f"decode {decode_s:.2f} s, prefill {prefill_s:.2f} s)")
    return bounds, (
        f"\n\nBound (benchmarks/throughput_bound.py): every decode step reads the weights and each running "
        f"sequence's K/V once at the measured copy bandwidth {copy_gbs:.0f} GB/s, all requests running from "
        f"the first step, plus the prompts' FLOPs at {tflops:.0f} TFLOP/s: " + "; ".join(notes)
        + ". Each row's \"of the bound\" is against its own cache's.")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"))
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--kv-cache-fraction", type=float, default=0.8)
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                        help="pagedkv.LLM's KV cache: auto (the model's dtype) or fp8 (e4m3)")
    parser.add_argument("--no-hf", action="store_true", help="skip HF's continuous batching")
    parser.add_argument("--small", action="store_true", help="tiny model, 16 short requests, CPU")
    parser.add_argument("--serial-too", action="store_true",
                        help="also run pagedkv.LLM with overlap_steps=False")
    args = parser.parse_args(argv)
    device = "cpu" if args.small or not torch.cuda.is_available() else "cuda"
    if args.small:
        args.num_requests, args.max_num_seqs, args.max_num_batched_tokens = 16, 8, 256
    lo, hi = (10, 40) if args.small else (100, 1024)
    prompts, max_tokens = workload(args.num_requests, lo, hi)
    if device == "cuda":  # the device's ceilings, measured before any workload has run on it
        copy_gbs, tflops = copy_bandwidth_gbs(device, 4 << 30), matmul_tflops(device)
        torch.cuda.empty_cache()
    model = build_model(args.small, device)
    # Bytes per cached K/V element, HF's (the model's dtype) and pagedkv's: each row's bound counts its own.
    model_kv_size = model.dtype.itemsize
    kv_size = torch.float8_e4m3fn.itemsize if args.kv_cache_dtype == "fp8" else model_kv_size
    hf_cache = str(model.dtype).removeprefix("torch.") + (" (HF has no fp8 cache)" if kv_size != model_kv_size else "")
    # The plot's labels name the caches too when they differ.
    tag, hf_tag = ("", "") if kv_size == model_kv_size else (", fp8 cache", f", {hf_cache.split()[0]} cache")

    results, curves = {}, {}  # name: (seconds, output tokens, KV cache, bytes per K/V element)
    seconds, tokens, timeline, cache = run_pagedkv(model, prompts, max_tokens, device, args)
    results["pagedkv.LLM"] = (seconds, tokens, cache, kv_size)
    curves[f"pagedkv.LLM{tag}"] = timeline
    print(f"pagedkv.LLM: {tokens} output tokens in {seconds:.2f} s, {tokens / seconds:,.0f} tok/s", flush=True)
    if args.serial_too:
        seconds, tokens, timeline, cache = run_pagedkv(model, prompts, max_tokens, device, args, overlap_steps=False)
        results["pagedkv.LLM, serial steps"] = (seconds, tokens, cache, kv_size)
        curves[f"pagedkv.LLM, serial steps{tag}"] = timeline
        print(f"pagedkv.LLM, serial steps: {tokens / seconds:,.0f} tok/s", flush=True)
    hf_note = ""
    if not args.no_hf:
        try:
            seconds, tokens, timeline = run_hf(model, prompts, max_tokens, device)
            results["HF generate_batch (paged|sdpa)"] = (seconds, tokens, hf_cache, model_kv_size)
            curves[f"HF generate_batch (paged|sdpa){hf_tag}"] = timeline
        except Exception as error:  # an older/newer transformers without this API: say so
            hf_note = f"HF generate_batch unavailable here: {type(error).__name__}: {error}"
            print(hf_note)
    hf = results.get("HF generate_batch (paged|sdpa)")
    bounds, bound_note = {}, ""
    if device == "cuda":
        bounds, bound_note = kv_bounds(model, prompts, max_tokens, copy_gbs, tflops, kv_size)
    rows = []
    for name, (seconds, tokens, cache, size) in results.items():
        rate = tokens / seconds
        rows.append([name, cache, tokens, round(seconds, 2), round(rate, 1),
                     f"{rate / (hf[1] / hf[0]):.2f}x" if hf else "-",
                     f"{100 * rate / bounds[size]:.0f}%" if bounds else "-"])
    shape = "small (2 layers, CPU)" if args.small else "Qwen3-0.6B shape, bf16"
    title = (f"W2: {args.num_requests} requests, prompt/output lengths uniform in [{lo}, {hi}], "
             f"{shape}, {device}, torch {torch.__version__}; pagedkv's KV cache: {results['pagedkv.LLM'][2]}"
             + ("; torch.float8_e4m3fn, pagedkv.LLM's default scales (none passed, none in the random-weight model)"
                if args.kv_cache_dtype == "fp8" else "")
             + (f"\n\n{hf_note}" if hf_note else "") + bound_note)
    table = markdown_table(["system", "KV cache", "output tokens", "seconds", "tok/s", "vs HF", "of the bound"], rows)
    save_table(args.out, "bench_throughput", title, table)
    print("plot:", save_rate_plot(args.out, curves, bounds.get(kv_size), f"bound{tag}"))


if __name__ == "__main__":
    main()
