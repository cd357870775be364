"""Where a decode step goes, for issue 32's shapes (the Qwen3-30B-A3B MoE row, the Gemma-2-9B row)
and W1's (the Qwen2.5-7B shape: where a batch of 5 or 8 rows loses to batch 1, issues 33 and 34):
kernel time per decode step by kernel name (each kernel's time alone on the device), pagedkv.generate
at batch B after a prompt of P tokens, from torch.profiler over (1 + N) - 1 new tokens. Layers can be
fewer than the real count (the per-layer cost is what matters; the LM head's share grows).

    python lab/step_profile.py [--model moe|gemma2|w1] [--layers 8] [--batch 1] [--prompt 128] [--new 32]
        [--format fp8|int4] [--drop-norms]

--format: the model written as that format's checkpoint (benchmarks/quantized_w1.py: attention and,
for the MoE, experts quantized) and loaded back with pagedkv.from_pretrained_quantized.
--drop-norms: the step without its fused add + RMSNorm kernels (ops.fused_add_rms_norm made a
no-op: two launches a layer fewer, the tokens no longer the model's): what folding the norms into
the products around them could save at most, measured rather than summed from kernel times.
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_architectures import GEMMA2_9B, QWEN3_30B_A3B, build  # noqa: E402
from bench_generate import W1, per_step_ms  # noqa: E402
from quantized_w1 import FORMATS, write_checkpoint  # noqa: E402
from transformers import Gemma2Config, Qwen2Config, Qwen3MoeConfig  # noqa: E402

import pagedkv  # noqa: E402
from pagedkv.tools.profiling import _busy_per_kernel, _union_ms  # noqa: E402


def kernel_us(fn) -> tuple[dict[str, float], float, float]:
    """fn profiled: (us each kernel name holds the device alone, the kernels' union in us, their
    span from the first start to the last end in us)."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [(e.time_range.start, e.time_range.end, e.name[:90]) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA]
    # Each kernel charged the time it holds the device alone (programmatic dependent launch
    # overlaps a kernel's wait with its predecessor: plain durations count that twice).
    alone = {name: 1e3 * ms for name, (ms, _) in _busy_per_kernel(kernels).items()}
    span = max(k[1] for k in kernels) - min(k[0] for k in kernels) if kernels else 0.0
    return alone, 1e3 * _union_ms([(k[0], k[1]) for k in kernels]), span


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", choices=("moe", "gemma2", "w1"), default="moe")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--format", choices=("fp8", "int4"), default=None)
    parser.add_argument("--drop-norms", action="store_true")
    args = parser.parse_args()
    if args.drop_norms:  # before the first generate: its graphs are captured without them
        pagedkv.ops.fused_add_rms_norm = lambda *a, **k: None
    config_cls, shape = {"moe": (Qwen3MoeConfig, QWEN3_30B_A3B), "gemma2": (Gemma2Config, GEMMA2_9B),
                          "w1": (Qwen2Config, W1)}[args.model]
    model = build(config_cls, shape, args.layers, "cuda", torch.bfloat16)
    if args.format:
        folder = pathlib.Path(tempfile.mkdtemp(prefix="step_profile_"))
        try:
            write_checkpoint(model, folder, FORMATS[args.format])
            del model
            torch.cuda.empty_cache()
            model = pagedkv.from_pretrained_quantized(folder, dtype=torch.bfloat16, device="cuda")
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    ids = torch.randint(3, model.config.vocab_size, (args.batch, args.prompt), device="cuda")
    run = lambda n: pagedkv.generate(model, ids, max_new_tokens=n, do_sample=False)  # noqa: E731
    run(1 + args.new)
    wall = per_step_ms(lambda i, n: pagedkv.generate(model, i, max_new_tokens=n, do_sample=False), ids, "cuda",
                       args.new)
    (short, short_union, short_span), (long, long_union, long_span) = (kernel_us(lambda: run(1)),
                                                                      kernel_us(lambda: run(1 + args.new)))
    per_step = {k: (long.get(k, 0.0) - short.get(k, 0.0)) / args.new for k in long}
    total = sum(per_step.values())
    busy, span = (long_union - short_union) / args.new / 1e3, (long_span - short_span) / args.new / 1e3
    if args.drop_norms:
        print("fused add + RMSNorm dropped: timing only, the tokens are not the model's")
    print(f"{args.layers} layers, batch {args.batch}: {total / 1e3:.3f} ms of kernels a decode step "
          f"({total / args.layers:.1f} us a layer)")
    # Where a step's wall time goes: kernels running; the device idle between them (launch
    # latency, a dependent launch's release); outside the kernels' span (host work the device
    # waited for between steps). The last from the profiled run, so it includes the profiler's own cost.
    print(f"a decode step: {wall:.3f} ms wall (timed unprofiled); profiled: kernels' span {span:.3f} ms, busy "
          f"{busy:.3f} ms, idle between kernels {span - busy:.3f} ms ({(span - busy) / args.layers * 1e3:.1f} us a "
          f"layer)")
    for name, us in sorted(per_step.items(), key=lambda kv: -kv[1])[:25]:
        print(f"{us:9.1f} us  {us / args.layers:7.1f} us/layer  {name}")


if __name__ == "__main__":
    main()
