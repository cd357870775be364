"""A Llama-3-70B-shaped model (bf16, 141 GB = 131 GiB: more than an H100's 80 GB, a tight fit in
one H200's 150 GB with little room for a KV cache) over several GPUs of one host:
pagedkv.tensor_parallel against HF eager with device_map="auto" over the same GPUs, in the same
run. ms per decode step, tokens/s, speed-up, and % of the roofline.

    python benchmarks/bench_tensor_parallel_70b.py [--gpus N] [--layers L] [--batches 1,8]
                                                   [--new-tokens 32] [--hf-new-tokens 16]
                                                   [--all-reduce auto] [--no-hf] [--out DIR]

Started plainly, it starts itself again under torchrun with N ranks (default: every visible GPU;
without CUDA, 2 ranks over gloo on the CPU: with --layers 2 a smoke test of the script). There
is no checkpoint: each rank reads its shard through a reader of random values drawn on its own
GPU (N(0, 0.02), norms 1), the path a checkpoint's shards take (pagedkv.tensor_parallel with a
reader, as tensor_parallel_from_pretrained), so no process ever holds the whole model. Then
every rank frees its shard and rank 0 alone builds HF's model on the meta device, places it as
from_pretrained(device_map="auto") does (balanced over the same GPUs), draws each parameter on
its GPU and times model.generate; the other ranks wait at a barrier (the process group's timeout is 30 minutes).

Per-step time as bench_generate's: (time of 1 + N new tokens - time of 1) / N, prefill excluded.
Roofline: the bytes a decode step must read on one GPU (the rank's weights but the embedding, of
which a step reads B rows, and its KV heads' cache at the mean context) over that GPU's measured
copy bandwidth (bytes read + written). HF's pipeline runs one GPU at a time: its bound is all the
weights and KV over one GPU's bandwidth.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import pathlib
import sys

import torch
import torch.distributed as dist
from transformers import LlamaConfig

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_generate import PROMPT, per_step_ms  # noqa: E402
from bench_tensor_parallel import relaunch_under_torchrun  # noqa: E402
from report import markdown_table, save_bar_plot, save_table  # noqa: E402
from timing import copy_bandwidth_gbs  # noqa: E402

import pagedkv  # noqa: E402
from pagedkv.models.checkpoint_shards import empty_model  # noqa: E402
from pagedkv.runtime.model import PREPARED_ATTR  # noqa: E402

LLAMA3_70B = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                  num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5,
                  max_position_embeddings=8192, tie_word_embeddings=False, bos_token_id=128000,
                  eos_token_id=128001)
DTYPE = torch.bfloat16
STD = 0.02


class RandomReader:
    """checkpoint_shards.TensorReader of random values: each slice drawn where and as it is used
    (N(0, STD); norms 1), so no rank holds more than its shard at any time."""

    def __init__(self, model, device: torch.device, seed: int):
        self.shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
        self.device = device
        self.generator = torch.Generator(device).manual_seed(seed)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[name]

    def read(self, name: str, rows: slice = slice(None), cols: slice | None = None) -> torch.Tensor:
        whole = torch.empty(self.shapes[name], device="meta")
        shape = (whole[rows] if cols is None else whole[rows, cols]).shape
        if name.endswith("norm.weight"):
            return torch.ones(shape, dtype=DTYPE, device=self.device)
        return torch.empty(shape, dtype=DTYPE, device=self.device).normal_(0, STD, generator=self.generator)


def prompt_ids(batch: int, vocab: int, device) -> torch.Tensor:
    """The same prompts on every rank and for HF."""
    generator = torch.Generator().manual_seed(batch)
    return torch.randint(3, vocab, (batch, PROMPT), generator=generator).to(device)


def kv_bytes_per_token(config, world: int) -> int:
    head_dim = config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * (config.num_key_value_heads // world) * head_dim * DTYPE.itemsize


def shard_bytes(model) -> int:
    """Bytes of this rank's weights that a decode step reads: all but the embedding."""
    w = getattr(model, PREPARED_ATTR).weights
    tensors = [w.final_norm, w.lm_head] + [t for layer in w.layers for t in
                                           (getattr(layer, f) for f in layer.__slots__) if t is not None]
    return sum(t.numel() * t.element_size() for t in tensors)


def hf_dispatched(config, gpus: int):
    """HF's model over the first `gpus` GPUs (the CPU without CUDA) by accelerate's
    infer_auto_device_map, each parameter drawn at random on its device."""
    from accelerate import dispatch_model, infer_auto_device_map, init_empty_weights
    from accelerate.utils import get_balanced_memory, set_module_tensor_to_device
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPE)
    if torch.cuda.is_available():  # what each GPU has free, less room for activations and the KV cache
        max_memory = {i: torch.cuda.mem_get_info(i)[0] - (6 << 30) for i in range(gpus)}
    else:
        max_memory = {"cpu": 1 << 50}
    # As from_pretrained(device_map="auto") places it: balanced over the GPUs (accelerate's plain
    # infer_auto_device_map fills the first GPU first, and 141 GB fit one H200's 150).
    if torch.cuda.is_available():
        max_memory = get_balanced_memory(model, max_memory=max_memory, dtype=DTYPE,
                                         no_split_module_classes=model._no_split_modules)
    device_map = infer_auto_device_map(model, max_memory=max_memory, dtype=DTYPE,
                                       no_split_module_classes=model._no_split_modules)
    elsewhere = sorted({str(d) for d in device_map.values()} - {str(d) for d in max_memory})
    if elsewhere:
        raise SystemExit(f"bench_tensor_parallel_70b: HF's model does not fit {gpus} GPUs (device_map "
                         f"puts parts on {elsewhere})")
    generator = {}
    for name, param in model.named_parameters():
        owner = max((m for m in device_map if m == "" or name.startswith(m + ".")), key=len)
        device = torch.device("cuda", device_map[owner]) if isinstance(device_map[owner], int) else device_map[owner]
        gen = generator.setdefault(str(device), torch.Generator(device).manual_seed(0))
        value = (torch.ones(param.shape, dtype=DTYPE, device=device) if name.endswith("norm.weight") else
                 torch.empty(param.shape, dtype=DTYPE, device=device).normal_(0, STD, generator=gen))
        set_module_tensor_to_device(model, name, device, value=value)
    model = dispatch_model(model, device_map=device_map)
    model.generation_config.eos_token_id = None  # every request produces its full length
    model.generation_config.pad_token_id = 0
    return model.eval(), device_map


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=None, help="ranks (default: every visible GPU)")
    parser.add_argument("--layers", type=int, default=LLAMA3_70B["num_hidden_layers"],
                        help="decoder layers (default 80; fewer for a smoke test)")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--new-tokens", type=int, default=32, help="decode steps timed for pagedkv")
    parser.add_argument("--hf-new-tokens", type=int, default=16, help="decode steps timed for HF eager")
    parser.add_argument("--all-reduce", default="auto", help="pagedkv.tensor_parallel's all_reduce")
    parser.add_argument("--no-hf", action="store_true", help="leave HF eager out")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"))
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if "RANK" not in os.environ:
        relaunch_under_torchrun(args.gpus or (torch.cuda.device_count() if cuda else 2), __file__)
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    # HF's run on rank 0 takes minutes while the others wait at a barrier: a long timeout.
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(minutes=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    sync = "cuda" if cuda else "cpu"
    batches = [int(b) for b in args.batches.split(",")]
    config = LlamaConfig(**{**LLAMA3_70B, "num_hidden_layers": args.layers})

    copy_gbs = copy_bandwidth_gbs("cuda") if cuda else float("nan")  # before the shard fills the GPU
    model = empty_model(config, DTYPE)
    pagedkv.tensor_parallel(model, device=device, reader=RandomReader(model, device, seed=rank),
                            all_reduce=args.all_reduce)
    model.generation_config.eos_token_id = None  # every request produces its full length
    model.generation_config.pad_token_id = 0
    per_gpu_bytes = shard_bytes(model)
    if rank == 0:
        print(f"{args.layers} layers, {world} ranks: {per_gpu_bytes / 1e9:.1f} GB of weights read per step "
              f"per GPU; copy bandwidth {copy_gbs:.0f} GB/s", flush=True)

    def run_pagedkv(ids, n):
        return pagedkv.generate(model, ids, max_new_tokens=n, do_sample=False)

    tp_ms = {}
    for batch in batches:
        tp_ms[batch] = per_step_ms(run_pagedkv, prompt_ids(batch, config.vocab_size, device), sync, args.new_tokens)
        if rank == 0:
            print(f"batch {batch}: pagedkv on {world} ranks {tp_ms[batch]:.2f} ms/step", flush=True)
    # Every rank's shard, cache and CUDA graphs go before HF's model takes the GPUs.
    delattr(model, PREPARED_ATTR)
    del model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    dist.barrier()

    if rank == 0:
        hf_ms = {b: float("nan") for b in batches}
        if not args.no_hf:
            hf, device_map = hf_dispatched(config, world if cuda else 0)
            first = next(p.device for p in hf.parameters())
            print(f"HF eager over {sorted({str(d) for d in device_map.values()})}", flush=True)
            for batch in batches:
                hf_ms[batch] = per_step_ms(lambda i, n: hf.generate(i, max_new_tokens=n, do_sample=False),
                                           prompt_ids(batch, config.vocab_size, first), sync, args.hf_new_tokens)
                print(f"batch {batch}: HF eager {hf_ms[batch]:.2f} ms/step", flush=True)
            del hf
            gc.collect()
        report(args, config, world, batches, tp_ms, hf_ms, per_gpu_bytes, copy_gbs)
    dist.barrier()
    dist.destroy_process_group()


def report(args, config, world, batches, tp_ms, hf_ms, per_gpu_bytes, copy_gbs) -> None:
    cuda = torch.cuda.is_available()
    gpu = torch.cuda.get_device_name() if cuda else "CPU"
    hf = f"HF eager device_map=auto, {world} GPUs" if cuda else "HF eager, CPU"
    rows = []
    for batch in batches:
        context = PROMPT + args.new_tokens / 2  # the mean over the timed steps
        roofline_ms = 1e3 * (per_gpu_bytes + batch * context * kv_bytes_per_token(config, world)) / (copy_gbs * 1e9)
        # HF's pipeline reads every GPU's part in turn: all the weights (the LM head once) and KV.
        hf_bound_ms = 1e3 * (world * per_gpu_bytes + batch * context * kv_bytes_per_token(config, 1)) / (copy_gbs * 1e9)
        rows.append([batch, hf_ms[batch], f"{100 * hf_bound_ms / hf_ms[batch]:.0f}%", tp_ms[batch],
                     batch * 1e3 / tp_ms[batch], f"{100 * roofline_ms / tp_ms[batch]:.0f}%", roofline_ms,
                     hf_ms[batch] / tp_ms[batch]])
    header = ["batch", f"{hf}, ms/step", "HF % of roofline",
              f"pagedkv TP={world}, ms/step", "pagedkv tok/s", "pagedkv % of roofline", "roofline ms/step",
              "speed-up over HF"]
    shape = "Llama-3-70B shape" if args.layers == LLAMA3_70B["num_hidden_layers"] else f"70B widths, {args.layers} layers"
    title = (f"{shape}, bf16, on {world} x {gpu}: ms per decode step, prompt {PROMPT}, {args.new_tokens} new "
             f"tokens (HF {args.hf_new_tokens}), greedy; {per_gpu_bytes / 1e9:.1f} GB read per GPU a step, "
             f"copy bandwidth {copy_gbs:.0f} GB/s (bench_tensor_parallel_70b)")
    name = f"bench_tensor_parallel_70b_tp{world}"
    save_table(args.out, name, title, markdown_table(header, rows))
    save_bar_plot(args.out, name, title.split(";")[0], [f"batch {b}" for b in batches],
                  {hf: [r[1] for r in rows],
                   f"pagedkv TP={world}": [r[3] for r in rows]}, "ms per decode step")


if __name__ == "__main__":
    main()
