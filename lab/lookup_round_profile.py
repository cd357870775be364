"""Where a greedy prompt-lookup round's device time goes (issue 34): generate() on the real
SmolLM2-135M-Instruct over the first --prompts input-grounded prompts, under torch.profiler, once
without speculation and once per --ks with prompt_lookup_num_tokens=k (runtime/lookup_rounds.py:
each round one CUDA graph). Prints, per kernel name, device microseconds per decode step
(without) and per round (with), and the wall time of each: a round must cost less than the new
tokens it gives times a decode step.

    python lab/lookup_round_profile.py [--prompts 4] [--ks 4,10] [--ngram 2] [--max-new 256] [--rows 18]
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_prompt_lookup import PROMPTS, load_prompts  # noqa: E402

import pagedkv  # noqa: E402
from pagedkv.runtime.model import prepared  # noqa: E402
from pagedkv.tools.default_model import load_default_model  # noqa: E402


def short_name(name: str) -> str:
    """A kernel's function name without namespaces, template arguments and parameters."""
    name = name.replace("(anonymous namespace)::", "").removeprefix("void ")
    for cut in ("<", "("):
        name = name.split(cut)[0]
    return name.split("::")[-1][:60] or name[:60]


def kernel_us(prof) -> collections.Counter:
    """Device microseconds by kernel name (shortened) over the profiled calls."""
    totals: collections.Counter = collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time > 0:
            totals[short_name(event.name)] += event.device_time
    return totals


def run(model, prompts, kwargs) -> tuple[float, int, int, collections.Counter]:
    """(wall seconds, new tokens, steps or rounds, kernel microseconds) over the prompts."""
    seconds = tokens = steps = 0
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = pagedkv.generate(model, ids, **kwargs)
            torch.cuda.synchronize()
            seconds += time.perf_counter() - start
            new = out.shape[1] - len(p)
            tokens += new
            stats = prepared(model).fixed_batch.last_prompt_lookup
            steps += stats.rounds if "prompt_lookup_num_tokens" in kwargs else new - 1
    return seconds, tokens, steps, kernel_us(prof)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--ks", default="4,10")
    parser.add_argument("--ngram", type=int, default=2)
    parser.add_argument("--max-new", type=int, default=256)
    parser.add_argument("--rows", type=int, default=18, help="kernel rows printed")
    args = parser.parse_args()
    model, tokenizer = load_default_model("cuda", torch.bfloat16)
    prompts = load_prompts(PROMPTS, tokenizer, args.prompts)
    greedy = dict(max_new_tokens=args.max_new, do_sample=False)
    systems = {"decode": greedy}
    for k in map(int, args.ks.split(",")):
        systems[f"k {k}"] = dict(greedy, prompt_lookup_num_tokens=k, max_matching_ngram_size=args.ngram)
    with torch.inference_mode():
        for kwargs in systems.values():  # warm-up: graphs captured
            pagedkv.generate(model, torch.tensor([prompts[0]], device="cuda"), **kwargs)
        results = {name: run(model, prompts, kwargs) for name, kwargs in systems.items()}
    base_wall = results["decode"][0] / results["decode"][2]
    for name, (seconds, tokens, steps, kernels) in results.items():
        wall = seconds / steps
        busy = sum(kernels.values()) / steps
        print(f"{name}: {steps} steps/rounds, {tokens} new tokens ({tokens / steps:.2f} a step), "
              f"wall {1e3 * wall:.3f} ms a step ({wall / base_wall:.2f}x a decode step), "
              f"kernels {busy / 1e3:.3f} ms a step, speed-up {base_wall * tokens / steps / wall:.2f}x")
    names = [n for n, _ in (results["decode"][3] + sum((r[3] for n, r in results.items() if n != "decode"),
                                                       collections.Counter())).most_common(args.rows)]
    print("\nkernel us per step / round: " + " | ".join(results))
    for n in names:
        print(f"{n:60s} " + " | ".join(f"{r[3][n] / r[2]:8.1f}" for r in results.values()))


if __name__ == "__main__":
    main()
