"""Where W2's wall time goes: per engine step, the device's time against the host's.

Runs W2 (benchmarks/bench_throughput.py's workload and model) through pagedkv.LLM and records,
for every launched step, CUDA events around the step's device work (from the runner's launch to
the sampler's last kernel). Device time is what the GPU spent from the step's first to its last
kernel (with serial steps it includes the runner's own host time); the run's wall time minus the
sum is time the GPU waited on the host.
Each decode-only step's device time is set beside its bound (weights + the rows' K/V at the
measured copy bandwidth). A torch.profiler window over ~20 decode steps at full batch breaks the
device time down by kernel.

    python lab/engine_timeline.py [--profile-at 300] [--out DIR] [--serial]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_throughput import TEMPERATURE, build_model, workload  # noqa: E402
from timing import copy_bandwidth_gbs  # noqa: E402

import pagedkv  # noqa: E402
from pagedkv.runtime.sampler import Sampler  # noqa: E402


class _TimedSampler(Sampler):
    """The engine's sampler with an event recorded after its last kernel."""

    end_events: list = []

    def __call__(self, *args, **kwargs):
        out = super().__call__(*args, **kwargs)
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        _TimedSampler.end_events.append(event)
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(os.environ.get("OUT", "results")))
    parser.add_argument("--profile-at", type=int, default=300, help="step to start the profiler window")
    parser.add_argument("--profile-steps", type=int, default=20)
    parser.add_argument("--serial", action="store_true", help="overlap_steps=False")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    copy_gbs = copy_bandwidth_gbs("cuda", 4 << 30)
    torch.cuda.empty_cache()
    prompts, max_tokens = workload(256, 100, 1024)
    model = build_model(False, "cuda")
    config = model.config
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 2

    llm = pagedkv.LLM(model, max_num_seqs=256, max_num_batched_tokens=16384, max_model_len=4096,
                      kv_cache_memory=0.8, overlap_steps=not args.serial)
    llm.generate([[10001 + i] * 16 for i in range(256)],
                 [pagedkv.SamplingParams(max_tokens=i + 1, temperature=TEMPERATURE, ignore_eos=True)
                  for i in range(256)], use_tqdm=False)
    llm.sampling.sampler.__class__ = _TimedSampler
    run = llm.runner.run
    start_events = []
    launches = []  # (rows, decode-only, context tokens) per launched step

    def timed_run(step):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        start_events.append(event)
        launches.append((len(step.seq_ids), step.query_lens is None,
                         sum(llm.cache.seq_len(s) for s in step.seq_ids)))
        return run(step)

    llm.runner.run = timed_run
    for i, (prompt, m) in enumerate(zip(prompts, max_tokens)):
        llm.add_request(prompt, pagedkv.SamplingParams(max_tokens=m, temperature=TEMPERATURE,
                                                       ignore_eos=True, seed=i))
    steps = []  # wall seconds of each step() call
    profiler = None
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while llm.has_unfinished_requests():
        n = len(steps)
        if n == args.profile_at:
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                          torch.profiler.ProfilerActivity.CUDA])
            profiler.__enter__()
        begin = time.perf_counter()
        llm.step(partial=False)
        steps.append(time.perf_counter() - begin)
        while len(_TimedSampler.end_events) < len(start_events):  # a step with no sample
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            _TimedSampler.end_events.append(event)
        if profiler is not None and n == args.profile_at + args.profile_steps - 1:
            profiler.__exit__(None, None, None)
            table = profiler.key_averages().table(sort_by="cuda_time_total", row_limit=25)
            (args.out / "engine_profile.txt").write_text(table)
            print(table)
            profiler = None
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    device = [s.elapsed_time(e) / 1e3 for s, e in zip(start_events, _TimedSampler.end_events)]
    print(f"{'serial' if args.serial else 'overlapped'} steps: {len(steps)} step() calls, {len(device)} "
          f"launched steps, wall {wall:.3f} s (profiler window included), tokens {llm.stats.num_generated_tokens}")
    print(f"sum of step() walls {sum(steps):.3f} s, sum of device {sum(device):.3f} s, "
          f"device idle {sum(steps) - sum(device):.3f} s")
    decode = [(d, rows, ctx) for (rows, only, ctx), d in zip(launches, device) if only]
    mixed = [d for (rows, only, ctx), d in zip(launches, device) if not only]
    bound = [(weight_bytes + kv_per_token * ctx) / (copy_gbs * 1e9) for _, _, ctx in decode]
    print(f"decode-only steps {len(decode)}: device {sum(d for d, *_ in decode):.3f} s, bound "
          f"{sum(bound):.3f} s (copy {copy_gbs:.0f} GB/s); mixed steps {len(mixed)}: device {sum(mixed):.3f} s")
    print("rows | steps | device ms/step | bound ms/step | device/bound")
    buckets: dict[int, list] = {}
    for (d, rows, ctx), b in zip(decode, bound):
        key = next(k for k in (32, 64, 128, 192, 256) if rows <= k)
        buckets.setdefault(key, []).append((d, b))
    for key in sorted(buckets):
        items = buckets[key]
        n = len(items)
        d, b = (sum(x[i] for x in items) / n * 1e3 for i in range(2))
        print(f"<={key} | {n} | {d:.3f} | {b:.3f} | {d / b:.2f}")


if __name__ == "__main__":
    main()
