"""A CPU model of W2's decode steps (no GPU): where the time over the bound lies, and how much a
decode-attention launch in the engine's row order loses to a tail of long rows started last.

    python lab/w2_tail_model.py [--ratios 2.15,1.50,1.39,1.31,1.29] [--slots 528] [--cta-gbps 16]

W2's lengths are drawn as the workload defines them (random.seed(0), 256 requests, prompt and
output each uniform in [100, 1024]); every request decodes from the first step, one token a
step. A step's bound is (the weights + every running row's K/V context) / copy bandwidth; the
device time of each row bucket is its bound times a measured device/bound ratio (--ratios:
session 33's on an H200). The attention tail: one layer's CTAs (row x kv head, K/V bytes of the
row's context) run in launch order on `slots` resident CTAs that share the copy bandwidth, each
at most --cta-gbps (its bytes in flight over the load latency); the makespan in the engine's
order, and longest first, against bytes / bandwidth. A model to rank ideas, not a measurement.
"""

from __future__ import annotations

import argparse
import random

HIDDEN, INTER, LAYERS, Q, KV, HEAD_DIM, VOCAB = 1024, 3072, 28, 16, 8, 128, 151936  # Qwen3-0.6B
WEIGHT_BYTES = 2 * (LAYERS * (HIDDEN * (Q + 2 * KV) * HEAD_DIM + Q * HEAD_DIM * HIDDEN + 3 * HIDDEN * INTER)
                    + VOCAB * HIDDEN)
KV_BYTES_A_TOKEN = LAYERS * KV * HEAD_DIM * 2 * 2  # K and V, bf16, every layer
BUCKETS = [32, 64, 128, 192, 256]  # a step's rows: <= 32, 33-64, ...


def w2_requests() -> list[tuple[int, int]]:
    random.seed(0)
    return [(random.randint(100, 1024), random.randint(100, 1024)) for _ in range(256)]


def makespan(works: list[float], slots: int, bandwidth: float, cta_cap: float) -> float:
    """Processor sharing: the running CTAs split `bandwidth`, each at most cta_cap; a CTA starts
    (in list order) when a slot frees. Bytes and bytes/us in, us out."""
    t, running, i = 0.0, [], 0
    while i < len(works) and len(running) < slots:
        running.append(works[i])
        i += 1
    while running:
        rate = min(cta_cap, bandwidth / len(running))
        done = min(running)
        t += done / rate
        running = [r - done for r in running if r - done > 1e-9]
        while i < len(works) and len(running) < slots:
            running.append(works[i])
            i += 1
    return t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ratios", default="2.15,1.50,1.39,1.31,1.29")
    parser.add_argument("--copy-gbps", type=float, default=4222.0)
    parser.add_argument("--slots", type=int, default=528, help="resident CTAs (H100: 132 SMs x 4)")
    parser.add_argument("--cta-gbps", type=float, default=16.0)
    parser.add_argument("--tail-steps", default="0,300,600,900")
    args = parser.parse_args()
    ratios = dict(zip(BUCKETS, map(float, args.ratios.split(","))))
    requests = w2_requests()
    bandwidth = args.copy_gbps * 1e3  # bytes / us
    rows_of = [[p + s for p, o in requests if s < o] for s in range(max(o for _, o in requests))]

    print("| rows in the step | steps | bound, s | device at the ratio, s | excess, s |\n|---|---|---|---|---|")
    for low, high in zip([0, *BUCKETS], BUCKETS):
        steps = [r for r in rows_of if low < len(r) <= high]
        bound = sum(WEIGHT_BYTES + sum(r) * KV_BYTES_A_TOKEN for r in steps) / bandwidth / 1e6
        print(f"| {low + 1}-{high} ({ratios[high]}x) | {len(steps)} | {bound:.3f} | "
              f"{bound * ratios[high]:.3f} | {bound * (ratios[high] - 1):.3f} |")

    print("\n| step | rows | one layer's K/V, MB | bytes / bandwidth, us | engine order, us | longest first, us |\n|---|---|---|---|---|---|")
    for s in map(int, args.tail_steps.split(",")):
        works = [c * HEAD_DIM * 2 * 2 for c in rows_of[s] for _ in range(KV)]  # a CTA: one row, one kv head
        ideal = sum(works) / bandwidth
        ordered = makespan(works, args.slots, bandwidth, args.cta_gbps * 1e3)
        longest = makespan(sorted(works, reverse=True), args.slots, bandwidth, args.cta_gbps * 1e3)
        print(f"| {s} | {len(rows_of[s])} | {sum(works) / 1e6:.0f} | {ideal:.1f} | {ordered:.1f} | {longest:.1f} |")


if __name__ == "__main__":
    main()
