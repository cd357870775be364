"""W1: decode steps of a Qwen2.5-7B-shaped model (random bf16 weights), HF generate and the
best compiled PyTorch decoder against pagedkv in the same run, for batch 1 / 8 / 32: ms per
decode step, tokens/s, % of the roofline (weight + KV bytes over measured copy bandwidth), kernel
launches per step, speed-up over HF eager and over the compiled decoder.

    python benchmarks/bench_generate.py [--out DIR] [--batches 1,8,32] [--hf-static] [--small]
                                        [--pagedkv-only] [--no-compiled] [--processed] [--beams]
                                        [--compiled-mode reduce-overhead|max-autotune]

Per-step time = (time of generate with 1 + N new tokens - time with 1) / N: prefill excluded.
The compiled decoder (pagedkv.tools.baselines.StaticCacheDecoder: gpt-fast's recipe, torch.compile
over a static cache, mode reduce-overhead unless --compiled-mode says max-autotune; on CUDA only,
compiled once per batch, 1-2 minutes each) is what BENCHMARKS.md calls the best compiled PyTorch
decoder; --no-compiled leaves it out. Its greedy tokens and HF eager's are compared with pagedkv's.
--hf-static adds HF's static cache (auto-compiled; slow to compile). --small uses a 2-layer
model of the same widths (smoke test, also on CPU). --pagedkv-only leaves HF out (for A/B runs of
pagedkv changes, lab/gpu_ab.sh, whose A side has HF's rows; the speed-up columns are empty).
--processed adds generate()'s processed path (a Python logits_processor that adds 0, so the
tokens stay greedy: HF's processors run on the host each step) against HF eager with the same
processor; its "speed-up vs HF eager" is over that HF row. --beams adds beam search (num_beams
4, eager steps over 4 rows a prompt) against HF eager's beam search, its speed-up over that row.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import torch
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList, Qwen2Config

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from report import markdown_table, save_bar_plot, save_table  # noqa: E402
from timing import copy_bandwidth_gbs  # noqa: E402

import pagedkv  # noqa: E402
from pagedkv.tools.baselines import StaticCacheDecoder  # noqa: E402

W1 = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
          num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False,
          max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6)
PROMPT, NEW = 128, 128


def build_model(small: bool, device: str):
    config = Qwen2Config(**{**W1, "num_hidden_layers": 2 if small else 28})
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    model.generation_config.eos_token_id = None  # every request produces its full length
    model.generation_config.pad_token_id = 0
    return model.eval()


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def seconds(fn, device, repeats=3):
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - start)
    return best


class AddZero(LogitsProcessor):
    """A Python logits processor that changes nothing: what the processed path costs by itself."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return scores + 0.0


class CompiledGenerate:
    """generate(ids, n) on StaticCacheDecoder, one decoder (fused weights, cache, compiled step)
    per batch size, the last one freed before the next is built."""

    def __init__(self, model, max_seq: int, mode: str):
        self.model, self.max_seq, self.mode = model, max_seq, mode
        self.decoder: StaticCacheDecoder | None = None

    def __call__(self, ids: torch.Tensor, n: int) -> torch.Tensor:
        if self.decoder is None or self.decoder.batch != ids.shape[0]:
            self.decoder = None
            torch.cuda.empty_cache()
            self.decoder = StaticCacheDecoder(self.model, ids.shape[0], self.max_seq, self.mode)
        return self.decoder.generate(ids, n)


def first_differences(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per row, the first step whose greedy token differs ([batch, steps] each; steps if none)."""
    differ = torch.cat([a != b, torch.ones_like(a[:, :1], dtype=torch.bool)], dim=1)
    return differ.int().argmax(dim=1)


def describe_agreement(name: str, steps: torch.Tensor, total: int) -> str:
    low, high = int(steps.min()), int(steps.max())
    spread = f"{low}" if low == high else f"{low}-{high} (median {int(steps.median())})"
    return f"{name}: rows equal to pagedkv's greedy tokens for {spread} of {total} steps"


def per_step_ms(generate, ids, device, new=NEW):
    """ms per decode step: a (1 + new)-token generate's time minus a 1-token one's (the prefill
    cancels), each the best of 3. Where the prefill's own spread swamps the steps (a batch-8 MoE
    prefill that dequantizes every expert: session 38 read -3.64 ms) the difference comes out <= 0:
    then the median of step_ms_pairs, and nan if that is not positive either, never a negative time."""
    generate(ids, 1 + new)  # warm-up (graphs, compilation, allocator)
    t_long = seconds(lambda: generate(ids, 1 + new), device)
    t_short = seconds(lambda: generate(ids, 1), device)
    ms = 1e3 * (t_long - t_short) / new
    if ms > 0:
        return ms
    median = statistics.median(step_ms_pairs(generate, ids, device, new))
    return median if median > 0 else float("nan")


def step_ms_pairs(generate, ids, device, new=NEW, pairs=5) -> list[float]:
    """ms per decode step from `pairs` back-to-back (1 + new, 1)-token generates, one value a pair
    (their median and range say how much the prefill's spread leaves in the difference)."""
    generate(ids, 1 + new)  # warm-up
    out = []
    for _ in range(pairs):
        t_long = seconds(lambda: generate(ids, 1 + new), device, repeats=1)
        t_short = seconds(lambda: generate(ids, 1), device, repeats=1)
        out.append(1e3 * (t_long - t_short) / new)
    return out


def kernels_per_step(generate, ids, device, new=16):
    if device != "cuda":
        return float("nan")
    from torch.profiler import ProfilerActivity, profile

    counts = []
    for n in (1, 1 + new):
        generate(ids, n)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            generate(ids, n)
            sync(device)
        counts.append(sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                          and "Memcpy" not in e.name and "Memset" not in e.name))
    return (counts[1] - counts[0]) / new


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"))
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--hf-static", action="store_true")
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--pagedkv-only", action="store_true")
    parser.add_argument("--no-compiled", action="store_true", help="leave the compiled decoder out")
    parser.add_argument("--processed", action="store_true",
                        help="add the processed path (a logits_processor adding 0) against HF with it")
    parser.add_argument("--beams", action="store_true",
                        help="add beam search (num_beams 4) against HF eager's beam search")
    parser.add_argument("--compiled-mode", default="reduce-overhead",
                        choices=["reduce-overhead", "max-autotune"],
                        help="torch.compile mode of the compiled decoder")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = args.device
    model = build_model(args.small, device)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    copy_gbs = copy_bandwidth_gbs(device) if device == "cuda" else float("nan")
    cfg = model.config
    kv_bytes_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 2

    hf_eager = "HF eager (DynamicCache, sdpa)"
    systems = {} if args.pagedkv_only else {
        hf_eager: lambda ids, n: model.generate(ids, max_new_tokens=n, do_sample=False)}
    systems["pagedkv eager"] = lambda ids, n: pagedkv.generate(model, ids, max_new_tokens=n, do_sample=False,
                                                               use_cuda_graphs=False)
    if device == "cuda":
        systems["pagedkv CUDA graphs"] = lambda ids, n: pagedkv.generate(model, ids, max_new_tokens=n,
                                                                         do_sample=False)
    compiled = f"compiled PyTorch (gpt-fast recipe, {args.compiled_mode})"
    if device == "cuda" and not args.pagedkv_only and not args.no_compiled:
        # gpt-fast's Inductor setting: tune the generated kernels' launch shapes.
        torch._inductor.config.coordinate_descent_tuning = True
        systems[compiled] = CompiledGenerate(model, PROMPT + NEW, args.compiled_mode)
    if args.hf_static:
        systems["HF static cache (compiled)"] = lambda ids, n: model.generate(
            ids, max_new_tokens=n, do_sample=False, cache_implementation="static")

    baseline_of = {}  # a system's HF row for the speed-up column (default: HF eager)
    if args.processed:
        hf_processed = "HF eager + logits_processor (adds 0)"
        if not args.pagedkv_only:
            systems[hf_processed] = lambda ids, n: model.generate(
                ids, max_new_tokens=n, do_sample=False, logits_processor=LogitsProcessorList([AddZero()]))
        processed = "pagedkv processed path (logits_processor adds 0)"
        systems[processed] = lambda ids, n: pagedkv.generate(
            model, ids, max_new_tokens=n, do_sample=False, logits_processor=LogitsProcessorList([AddZero()]))
        baseline_of[processed] = hf_processed
    if args.beams:  # 4 beams a row: the step's batch is 4x the row's; HF reorders its cache, pagedkv forks
        hf_beams = "HF eager beam search (num_beams 4)"
        if not args.pagedkv_only:
            systems[hf_beams] = lambda ids, n: model.generate(ids, max_new_tokens=n, num_beams=4, do_sample=False)
        beams = "pagedkv beam search (num_beams 4)"
        systems[beams] = lambda ids, n: pagedkv.generate(model, ids, max_new_tokens=n, num_beams=4,
                                                         do_sample=False)
        baseline_of[beams] = hf_beams
    rows, plot = [], {name: [] for name in systems}
    batches = [int(b) for b in args.batches.split(",")]
    for batch in batches:
        ids = torch.randint(3, cfg.vocab_size, (batch, PROMPT), device=device)
        # Mean KV read per step over the run: contexts from PROMPT to PROMPT + NEW.
        kv_bytes = batch * (PROMPT + NEW / 2) * kv_bytes_per_token
        roofline_ms = 1e3 * (weight_bytes + kv_bytes) / (copy_gbs * 1e9)
        times = {}
        for name, gen in systems.items():
            times[name] = ms = per_step_ms(gen, ids, device)
            launches = kernels_per_step(gen, ids, device)
            rows.append([batch, name, ms, batch * 1e3 / ms, f"{100 * roofline_ms / ms:.0f}%", launches])
            plot[name].append(ms)
            print(rows[-1], flush=True)
        if compiled in systems:
            # bf16 greedy tokens part at near-ties, which random weights make common: HF eager's
            # agreement with pagedkv, beside it, says what parting is normal.
            ours = pagedkv.generate(model, ids, max_new_tokens=NEW, do_sample=False)[:, PROMPT:]
            for name in (hf_eager, compiled):
                if name in systems:
                    theirs = systems[name](ids, NEW)[:, -NEW:]
                    print(f"batch {batch}: " + describe_agreement(name, first_differences(theirs, ours), NEW),
                          flush=True)
            systems[compiled].decoder = None
        for row in rows[-len(systems):]:
            name, ms = row[1], row[2]
            base = baseline_of.get(name, hf_eager)
            row += ["" if base not in times else times[base] / ms,
                    "" if compiled not in times else times[compiled] / ms]
    header = ["batch", "system", "ms / decode step", "tokens/s", "% of roofline", "kernels / step",
              "speed-up vs HF eager", "speed-up vs compiled PyTorch"]
    name = "W1 (Qwen2.5-7B shape)" if not args.small else "W1 widths, 2 layers (smoke)"
    title = (f"{name}, bf16, prompt {PROMPT}, {NEW} new tokens, greedy; "
             f"{torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}; weights "
             f"{weight_bytes / 1e9:.2f} GB, copy bandwidth {copy_gbs:.0f} GB/s")
    save_table(args.out, "bench_generate", title, markdown_table(header, rows))
    save_bar_plot(args.out, "bench_generate", title.split(";")[0], [f"batch {b}" for b in batches],
                  plot, "ms per decode step")


if __name__ == "__main__":
    main()
