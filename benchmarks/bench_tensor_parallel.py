"""W1 over several GPUs: pagedkv.tensor_parallel against pagedkv on one GPU and HF generate on one
GPU, in the same run. ms per decode step for each batch, speed-ups, and where the tensor-parallel
greedy tokens first part from the one-GPU run's (bf16: the ranks' partial sums add in another
order).

    python benchmarks/bench_tensor_parallel.py [--gpus N] [--out DIR] [--batches 1,8,32]
                                               [--small] [--no-hf] [--new-tokens N]
                                               [--all-reduce peer,nccl]

Started plainly, it starts itself again under torchrun with N ranks (default: every visible
GPU; on a machine without CUDA, 2 ranks over gloo on the CPU, with --small a smoke test). Every
rank builds the same random model (same seed, checked); rank 0 also times HF eager and pagedkv
on its GPU alone while the others wait. --all-reduce times the tensor-parallel run once per
method of summing the decode steps' partial products (pagedkv.tensor_parallel's all_reduce:
peer memory fused with the add + RMSNorm, or NCCL), in the same run. Per-step time as bench_generate's: (time of 1 + N new
tokens - time of 1) / N, prefill excluded.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import subprocess
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_generate import NEW, PROMPT, build_model, describe_agreement, first_differences, per_step_ms  # noqa: E402
from report import markdown_table, save_bar_plot, save_table  # noqa: E402

import pagedkv  # noqa: E402
from pagedkv.runtime.model import PREPARED_ATTR, PreparedModel  # noqa: E402


def relaunch_under_torchrun(ranks: int, script: str = __file__) -> None:
    """Run `script` again with this call's arguments under torchrun with `ranks` ranks, and exit
    with its status."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               script, *sys.argv[1:]]
    sys.exit(subprocess.call(command))


def same_weights_everywhere(model, device) -> bool:
    """Every rank built the same random weights (same seed, same kind of device)."""
    probe = torch.stack([p.detach().float().sum() for p in model.parameters()]).to(device)
    every = [torch.empty_like(probe) for _ in range(dist.get_world_size())]
    dist.all_gather(every, probe)
    return all(torch.equal(e, every[0]) for e in every)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=None, help="ranks (default: every visible GPU)")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"))
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--small", action="store_true", help="2 layers of W1's widths (smoke test)")
    parser.add_argument("--no-hf", action="store_true", help="leave HF generate out")
    parser.add_argument("--new-tokens", type=int, default=NEW, help=f"decode steps timed (default {NEW})")
    parser.add_argument("--all-reduce", default=None,
                        help="all-reduce methods to time, the first as the headline (default: peer,nccl on "
                             "several GPUs; nccl, i.e. the process group's own, on the CPU)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if "RANK" not in os.environ:
        relaunch_under_torchrun(args.gpus or (torch.cuda.device_count() if cuda else 2))
    device = "cuda" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = [int(b) for b in args.batches.split(",")]
    new = args.new_tokens
    torch.manual_seed(0)
    model = build_model(args.small, device)
    if not same_weights_everywhere(model, device):
        raise SystemExit("bench_tensor_parallel: the ranks built different random weights")
    methods = (args.all_reduce or ("peer,nccl" if cuda and world > 1 else "nccl")).split(",")
    pagedkv.tensor_parallel(model, device=torch.device(device, torch.cuda.current_device()) if cuda else "cpu",
                            all_reduce="peer" if "peer" in methods else "nccl")
    sharded = getattr(model, PREPARED_ATTR)
    peer = sharded.tp.peer

    def use(method: str) -> None:  # the same shard, summed another way (a fresh runner and graphs)
        sharded.tp = dataclasses.replace(sharded.tp, peer=peer if method == "peer" else None)
        sharded.fixed_batch = None

    def prompt_ids(batch: int) -> torch.Tensor:  # the same prompts for every system and rank
        generator = torch.Generator().manual_seed(batch)
        return torch.randint(3, model.config.vocab_size, (batch, PROMPT), generator=generator).to(device)

    def run_pagedkv(ids, n):
        return pagedkv.generate(model, ids, max_new_tokens=n, do_sample=False)

    tp_ms, tp_tokens = {m: {} for m in methods}, {}
    for method in methods:
        use(method)
        for batch in batches:
            ids = prompt_ids(batch)
            tp_ms[method][batch] = per_step_ms(run_pagedkv, ids, device, new)
            if method == methods[0]:
                tp_tokens[batch] = run_pagedkv(ids, new)[:, PROMPT:].cpu()
            if rank == 0:
                print(f"batch {batch}: pagedkv on {world} ranks, {method} all-reduce "
                      f"{tp_ms[method][batch]:.2f} ms/step", flush=True)
    best = methods[0]  # the headline column: the first method named

    if rank == 0:  # this GPU alone: a runner of the whole model, and HF
        setattr(model, PREPARED_ATTR, PreparedModel.of(model))
        rows, agreement = [], []
        for batch in batches:
            ids = prompt_ids(batch)
            one_ms = per_step_ms(run_pagedkv, ids, device, new)
            one_tokens = run_pagedkv(ids, new)[:, PROMPT:].cpu()
            agreement.append(f"batch {batch}: " + describe_agreement(
                f"pagedkv on {world} ranks", first_differences(tp_tokens[batch], one_tokens), new))
            hf_ms = float("nan")
            if not args.no_hf:
                hf_ms = per_step_ms(lambda i, n: model.generate(i, max_new_tokens=n, do_sample=False), ids, device, new)
            tp = [tp_ms[m][batch] for m in methods]
            rows.append([batch, hf_ms, one_ms, *tp, one_ms / tp_ms[best][batch], hf_ms / tp_ms[best][batch]])
            print(f"batch {batch}: one rank alone {one_ms:.2f} ms/step, HF {hf_ms:.2f}", flush=True)
        setattr(model, PREPARED_ATTR, sharded)
        gpu = torch.cuda.get_device_name() if cuda else "CPU"
        title = (f"W1{' (--small)' if args.small else ''} on {world} x {gpu}: ms per decode step, prompt {PROMPT}, "
                 f"{new} new tokens (bench_tensor_parallel)")
        unit = "GPU" if cuda else "CPU rank"
        ranks = f"{world} {unit}{'s' if world > 1 else ''}"
        header = ["batch", f"HF eager, 1 {unit}", f"pagedkv, 1 {unit}",
                  *[f"pagedkv, {ranks}, {m} all-reduce" for m in methods],
                  f"speed-up of {ranks} ({best}) over 1", f"speed-up ({best}) over HF eager"]
        save_table(args.out, "bench_tensor_parallel", title,
                   markdown_table(header, rows) + "\n\n" + "\n".join(f"- {a}" for a in agreement))
        save_bar_plot(args.out, "bench_tensor_parallel", title, [f"batch {b}" for b in batches],
                      {f"pagedkv, 1 {unit}": [r[2] for r in rows],
                       **{f"pagedkv, {ranks}, {m}": [r[3 + i] for r in rows] for i, m in enumerate(methods)}},
                      "ms per decode step")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
