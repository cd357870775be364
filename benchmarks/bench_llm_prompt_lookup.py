"""Issue 34's engine row: pagedkv.LLM with prompt lookup (LLM(prompt_lookup_num_tokens=k)) on the
real SmolLM2-135M-Instruct over benchmarks/prompts/input_grounded.jsonl, all prompts submitted at
once, greedy, stopping at EOS, in one run:

- pagedkv.LLM without speculation (decode steps as CUDA graphs),
- pagedkv.LLM with prompt lookup, verification steps as CUDA graphs (each verified token a decode
  row of its own: runner.run_decode_rows),
- the same with verification graphs off (PAGEDKV_VERIFY_GRAPHS=0: the same layout, eager),
- HF's continuous batching (generate_batch's manager, attn_implementation "paged|sdpa", greedy;
  HF has no speculative decoding for batches), unless --no-hf.

    python benchmarks/bench_llm_prompt_lookup.py [--out DIR] [--k 10] [--max-new 256]
                                                 [--max-num-seqs 32] [--no-hf] [--small]

tokens/s = new tokens over the wall time of llm.generate (one warm-up generate per engine first,
the engines built before timing). The speculating engine's greedy tokens must equal the plain
engine's up to near ties in bf16 (bench_prompt_lookup.check_equal: each parting's top-2 gap in HF's
logits), exactly in fp32 (--small runs fp32 on the CPU).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

import torch
from transformers import GenerationConfig

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_prompt_lookup import PROMPTS, check_equal, load_prompts, sync  # noqa: E402
from report import markdown_table, save_bar_plot, save_table  # noqa: E402

import pagedkv  # noqa: E402
from pagedkv.engine.speculation import SPECULATIVE_MAX_BATCH  # noqa: E402
from pagedkv.tools.default_model import load_default_model  # noqa: E402

PLAIN, GRAPHS, EAGER, HF = ("pagedkv.LLM", "pagedkv.LLM prompt lookup", "pagedkv.LLM prompt lookup, eager verification",
                            "HF generate_batch (paged sdpa)")
EVERY_STEP = "pagedkv.LLM prompt lookup, every step"  # speculative_max_batch=None: no batch limit


def engine(model, max_num_seqs: int, k: int | None, verify_graphs: bool, max_batch: int | None = None) -> pagedkv.LLM:
    """An LLM; verify_graphs is read by its runner when built (PAGEDKV_VERIFY_GRAPHS); max_batch:
    its speculative_max_batch (None: every step proposes)."""
    saved = os.environ.get("PAGEDKV_VERIFY_GRAPHS")
    os.environ["PAGEDKV_VERIFY_GRAPHS"] = "1" if verify_graphs else "0"
    try:
        spec = {} if k is None else dict(prompt_lookup_num_tokens=k, speculative_max_batch=max_batch)
        # a fifth of the free memory each: four engines are alive at once
        memory = 0.2 if next(model.parameters()).is_cuda else 256 << 20
        return pagedkv.LLM(model, max_num_seqs=max_num_seqs, kv_cache_memory=memory, **spec)
    finally:
        if saved is None:
            del os.environ["PAGEDKV_VERIFY_GRAPHS"]
        else:
            os.environ["PAGEDKV_VERIFY_GRAPHS"] = saved


def run_llm(llm: pagedkv.LLM, prompts: list[list[int]], max_new: int, device: str) -> tuple[float, list[list[int]]]:
    params = pagedkv.SamplingParams(max_tokens=max_new, temperature=0)
    sync(device)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    sync(device)
    return time.perf_counter() - start, [list(o.token_ids) for o in outputs]


def run_hf(model, prompts: list[list[int]], max_new: int, eos: set[int], pad: int, device: str
           ) -> tuple[float, list[list[int]]]:
    """HF continuous batching, greedy, through each request's EOS."""
    model.set_attn_implementation("paged|sdpa")
    config = GenerationConfig(do_sample=False, eos_token_id=sorted(eos), pad_token_id=pad, max_new_tokens=max_new)
    model.generate_batch(inputs=[prompts[0][:64]] * 2, generation_config=config, max_new_tokens=4)
    sync(device)
    start = time.perf_counter()
    results = model.generate_batch(inputs=prompts, generation_config=config)
    sync(device)
    seconds = time.perf_counter() - start
    model.set_attn_implementation("sdpa")
    if len(results) != len(prompts) or any(r.error for r in results.values()):
        raise RuntimeError(f"HF generate_batch finished {len(results)} of {len(prompts)} requests")
    return seconds, [list(results[r].generated_tokens) for r in sorted(results, key=lambda r: int(r.split("_")[-1]))]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"))
    parser.add_argument("--k", type=int, default=10, help="prompt_lookup_num_tokens")
    parser.add_argument("--max-new", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-batch", type=int, default=SPECULATIVE_MAX_BATCH,
                        help="speculative_max_batch of the prompt-lookup row (the other rows: none)")
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--small", action="store_true", help="3 prompts, 16 new tokens, fp32 (CPU smoke test)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    device = args.device
    dtype = torch.float32 if args.small or device == "cpu" else torch.bfloat16
    max_new = 16 if args.small else args.max_new
    model, tokenizer = load_default_model(device, dtype)
    prompts = load_prompts(PROMPTS, tokenizer, 3 if args.small else None)
    gen = model.generation_config
    eos = {gen.eos_token_id} if isinstance(gen.eos_token_id, int) else set(gen.eos_token_id or ())
    pad = gen.pad_token_id if gen.pad_token_id is not None else next(iter(eos))
    engines = {PLAIN: engine(model, args.max_num_seqs, None, True),
               GRAPHS: engine(model, args.max_num_seqs, args.k, True, args.max_batch),
               EVERY_STEP: engine(model, args.max_num_seqs, args.k, True),
               EAGER: engine(model, args.max_num_seqs, args.k, False)}
    seconds, tokens = {}, {}
    with torch.inference_mode():
        for name, llm in engines.items():
            run_llm(llm, prompts[:2], 8, device)  # warm-up: graphs captured, kernels loaded
            seconds[name], tokens[name] = run_llm(llm, prompts, max_new, device)
    if not args.no_hf:  # HF's continuous batching writes its own tensors in place: not in inference mode
        seconds[HF], tokens[HF] = run_hf(model, prompts, max_new, eos, pad, device)
    with torch.inference_mode():
        equal = all(check_equal(model, prompts, tokens[PLAIN], tokens[name], dtype, name)
                    for name in (GRAPHS, EVERY_STEP, EAGER))
    stats = {name: engines[name].speculation.stats for name in (GRAPHS, EVERY_STEP, EAGER)}
    header = ["system", "new tokens", "seconds", "tokens/s", "speed-up vs pagedkv.LLM", "vs HF", "acceptance"]
    rate = {name: sum(map(len, tokens[name])) / seconds[name] for name in seconds}
    rows = [[name, sum(map(len, tokens[name])), f"{seconds[name]:.3g}", f"{rate[name]:.3g}",
             f"{rate[name] / rate[PLAIN]:.3g}", f"{rate[name] / rate[HF]:.3g}" if HF in rate else "n/a",
             f"{stats[name].accepted / max(stats[name].proposed, 1):.3f}" if name in stats else ""]
            for name in seconds]
    where = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    title = (f"pagedkv.LLM prompt lookup (k {args.k}, speculative_max_batch {args.max_batch}), SmolLM2-135M-Instruct {str(dtype).split('.')[-1]}, "
             f"{len(prompts)} input-grounded prompts at once (max_num_seqs {args.max_num_seqs}), "
             f"max_tokens {max_new}, greedy; {where}")
    table = markdown_table(header, rows)
    save_table(args.out, "bench_llm_prompt_lookup", title, table)
    save_bar_plot(args.out, "bench_llm_prompt_lookup", title.split(";")[0], ["all prompts"],
                  {name: [rate[name]] for name in rate}, "output tokens / s")
    print(f"verification graphs: {rate[EVERY_STEP] / rate[EAGER]:.2f}x eager verification; prompt lookup "
          f"{rate[GRAPHS] / rate[PLAIN]:.2f}x pagedkv.LLM without it (speculative_max_batch {args.max_batch}), "
          f"{rate[EVERY_STEP] / rate[PLAIN]:.2f}x proposing in every step")
    return {"rates": rate, "equal": equal, "stats": stats}


if __name__ == "__main__":
    main()
