"""Do tensor-parallel scripts exit by themselves? Each case is a small script run under torchrun
with 2 ranks (a 4-layer random Llama in bf16, pagedkv.generate with CUDA graphs), killed after
--timeout seconds; a table of exit codes and seconds per case. Also the all-reduce latency of
one decode-sized message per method (NCCL, pagedkv's peer memory), eager and in a CUDA graph.

    python lab/tp_exit_probe.py [--timeout 90]            # the driver: every case
    torchrun --nproc-per-node 2 lab/tp_exit_probe.py --case destroy   # one case (what the driver runs)

Cases: destroy (dist.destroy_process_group() at the end, as scripts do); unwrapped_destroy
(torch's own destroy_process_group, bypassing the graph release pagedkv wraps around it: the
session-17 hang, pytorch/pytorch#115388); no_destroy (the interpreter's exit alone); raise_rank1
(rank 1 raises after its first generate while rank 0 goes on).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist

CASES = ("destroy", "unwrapped_destroy", "no_destroy", "raise_rank1", "latency")


def model_on(device):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=4, vocab_size=4096, max_position_embeddings=512)
    return LlamaForCausalLM(config).to(device=device, dtype=torch.bfloat16)


def latency(device) -> None:
    """us per all-reduce + add + RMSNorm of [rows, 4096] bf16: NCCL then fused_add_rms_norm,
    against the peer-memory op; each in a CUDA graph of 64 calls (a decode step has 2 per layer)."""
    from pagedkv import ops
    from pagedkv.runtime.peer_all_reduce import PeerAllReduce
    peer = PeerAllReduce.connect(None, device)
    rank = dist.get_rank()
    weight = torch.ones(4096, dtype=torch.bfloat16, device=device)
    for rows in (1, 8, 32, 64, 128, 256):
        x = torch.randn(rows, 4096, dtype=torch.bfloat16, device=device)
        res = torch.randn_like(x)
        times = {}
        for name in ("nccl", "peer"):
            if name == "peer" and (peer is None or not peer.fits(x)):
                continue

            def body():
                for _ in range(64):
                    if name == "nccl":
                        dist.all_reduce(x)
                        ops.fused_add_rms_norm(x, res, weight, 1e-6)
                    else:
                        peer.add_rms_norm(x, res, weight, 1e-6)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                body()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                body()
            for _ in range(3):
                graph.replay()
            torch.cuda.synchronize()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(20):
                graph.replay()
            torch.cuda.synchronize()
            times[name] = (time.perf_counter() - start) / 20 / 64 * 1e6
            del graph
        if rank == 0:
            print(f"latency rows {rows}: " + ", ".join(f"{k} {v:.1f} us" for k, v in times.items()), flush=True)


def one_case(case: str) -> None:
    import pagedkv
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", device_id=device)
    if case == "latency":
        latency(device)
        dist.destroy_process_group()
        return
    model = pagedkv.tensor_parallel(model_on("cpu"), device=device)
    ids = torch.randint(3, 4096, (2, 16), device=device)
    out = pagedkv.generate(model, ids, max_new_tokens=16, do_sample=False)
    print(f"rank {rank}: generated {tuple(out.shape)}", flush=True)
    if case == "raise_rank1":
        if rank == 1:
            raise RuntimeError("rank 1 fails on purpose")
        pagedkv.generate(model, ids, max_new_tokens=16, do_sample=False)  # waits for rank 1
    if case == "destroy":
        dist.destroy_process_group()
    elif case == "unwrapped_destroy":
        dist.barrier()
        dist.destroy_process_group.pagedkv_original()


def driver(timeout: float) -> None:
    rows = []
    for case in CASES:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                   __file__, "--case", case]
        start = time.perf_counter()
        try:
            done = subprocess.run(command, timeout=timeout, capture_output=True, text=True)
            code, tail = done.returncode, (done.stdout + done.stderr)[-1500:]
        except subprocess.TimeoutExpired as e:
            code, tail = "timeout", ((e.stdout or b"").decode() + (e.stderr or b"").decode())[-1500:]
            subprocess.run(["pkill", "-9", "-f", "tp_exit_probe.py --case"], check=False)
        rows.append((case, code, time.perf_counter() - start))
        print(f"--- {case}: exit {code} after {rows[-1][2]:.1f} s\n{tail}", flush=True)
    print("\n| case | exit code | seconds |\n|---|---|---|")
    for case, code, seconds in rows:
        print(f"| {case} | {code} | {seconds:.1f} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=CASES)
    parser.add_argument("--timeout", type=float, default=90)
    args = parser.parse_args()
    if args.case:
        one_case(args.case)
    else:
        driver(args.timeout)
