"""Where a decode step of the Qwen3-30B-A3B shape goes (issue 32's MoE row): kernel time per
decode step by kernel name (each kernel's time alone on the device), pagedkv.generate at batch B, from torch.profiler over (1 + N) - 1 new
tokens. Layers can be fewer than 48 (the per-layer cost is what matters).

    python lab/moe_step_profile.py [--layers 8] [--batch 1] [--new 32]
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_architectures import QWEN3_30B_A3B, build  # noqa: E402
from transformers import Qwen3MoeConfig  # noqa: E402

import pagedkv  # noqa: E402
from pagedkv.tools.profiling import _busy_per_kernel  # noqa: E402


def kernel_us(fn) -> dict[str, float]:
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [(e.time_range.start, e.time_range.end, e.name[:90]) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA]
    # Each kernel charged the time it holds the device alone (programmatic dependent launch
    # overlaps a kernel's wait with its predecessor: plain durations count that twice).
    return {name: 1e3 * ms for name, (ms, _) in _busy_per_kernel(kernels).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--new", type=int, default=32)
    args = parser.parse_args()
    model = build(Qwen3MoeConfig, QWEN3_30B_A3B, args.layers, "cuda", torch.bfloat16)
    ids = torch.randint(3, model.config.vocab_size, (args.batch, 128), device="cuda")
    run = lambda n: pagedkv.generate(model, ids, max_new_tokens=n, do_sample=False)  # noqa: E731
    run(1 + args.new)
    short, long = kernel_us(lambda: run(1)), kernel_us(lambda: run(1 + args.new))
    per_step = {k: (long.get(k, 0.0) - short.get(k, 0.0)) / args.new for k in long}
    total = sum(per_step.values())
    print(f"{args.layers} layers, batch {args.batch}: {total / 1e3:.3f} ms of kernels a decode step "
          f"({total / args.layers:.1f} us a layer)")
    for name, us in sorted(per_step.items(), key=lambda kv: -kv[1])[:25]:
        print(f"{us:9.1f} us  {us / args.layers:7.1f} us/layer  {name}")


if __name__ == "__main__":
    main()
