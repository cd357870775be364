"""Issue 33's FP8 KV cache accuracy row: how often the real SmolLM2-135M-Instruct's greedy token
with kv_cache_dtype="fp8" is the one it takes with the bf16 cache, over >= 1,000 generated tokens
of the input-grounded prompts (benchmarks/prompts/input_grounded.jsonl), in one run.

1. The reference: pagedkv.generate with the model's own (bf16) cache, greedy, --new tokens a
   prompt (EOS suppressed by min_new_tokens so every prompt gives them all).
2. Teacher-forced top-1 agreement: the same prompts through generate(kv_cache_dtype="fp8") with a
   logits processor that records each step's argmax of the fp8-cache logits, then forces the
   reference token. So at every position the fp8 cache holds the reference prefix, and the
   recorded argmax is the fp8 model's own next token there. The same run with the model-dtype cache is
   the control (its agreement is 100% up to near ties of the per-step path's kernels).
3. Free-running: greedy fp8 generation, tokens equal to the reference up to its first parting.

kv_cache_scales: "calibrate" (amax of the prompt's K/V, pagedkv's generate()) and 1.0 (no
scales). The long-context retrieval case (a key planted early in an 8k context) is
tests/test_fp8_kv_kernels.py::test_long_context_retrieval_like_bf16.

    python benchmarks/bench_fp8_kv_agreement.py [--out DIR] [--prompts 4] [--new 256] [--small]
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch
from transformers import LogitsProcessor, LogitsProcessorList

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_prompt_lookup import PROMPTS, load_prompts  # noqa: E402
from report import markdown_table, save_bar_plot, save_table  # noqa: E402

import pagedkv  # noqa: E402
from pagedkv.tools.default_model import load_default_model  # noqa: E402


class ForceAndRecord(LogitsProcessor):
    """Records each step's argmax of the raw scores [1, V], then leaves only the reference's
    token at that step (teacher forcing through generate's own loop)."""

    def __init__(self, reference: list[int], prompt_len: int):
        self.reference, self.prompt_len, self.argmax = reference, prompt_len, []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        step = input_ids.shape[1] - self.prompt_len
        self.argmax.append(int(scores[0].argmax()))
        forced = torch.full_like(scores, -float("inf"))
        forced[0, self.reference[step]] = 0.0
        return forced


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"))
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new", type=int, default=256, help="new tokens a prompt")
    parser.add_argument("--small", action="store_true", help="1 prompt, 8 tokens, fp32 on the CPU (smoke test)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    device = args.device
    dtype = torch.float32 if args.small or device == "cpu" else torch.bfloat16
    count, new = (1, 8) if args.small else (args.prompts, args.new)
    model, tokenizer = load_default_model(device, dtype)
    prompts = load_prompts(PROMPTS, tokenizer, count)
    greedy = dict(do_sample=False, max_new_tokens=new, min_new_tokens=new)
    caches = {"model-dtype cache (control)": dict(), "fp8, calibrated scales": dict(kv_cache_dtype="fp8", kv_cache_scales="calibrate"),
              "fp8, scales 1.0": dict(kv_cache_dtype="fp8")}
    agree = {name: [0, 0] for name in caches}  # matching positions, positions
    free = {name: [] for name in caches}  # per prompt: tokens equal to the reference before the first parting
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            reference = pagedkv.generate(model, ids, **greedy)[0, len(prompt):].tolist()
            for name, kv in caches.items():
                record = ForceAndRecord(reference, len(prompt))
                forced = pagedkv.generate(model, ids, **greedy, **kv, logits_processor=LogitsProcessorList([record]))
                assert forced[0, len(prompt):].tolist() == reference, "forcing failed"
                agree[name][0] += sum(a == r for a, r in zip(record.argmax, reference))
                agree[name][1] += len(reference)
                running = pagedkv.generate(model, ids, **greedy, **kv)[0, len(prompt):].tolist()
                free[name].append(next((j for j, (a, b) in enumerate(zip(running, reference)) if a != b), len(reference)))
    total = agree[next(iter(caches))][1]
    rows = [[name, f"{100 * hit / n:.2f}%", f"{hit} / {n}", " ".join(map(str, free[name]))]
            for name, (hit, n) in agree.items()]
    where = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    title = (f"FP8 KV cache top-1 agreement, SmolLM2-135M-Instruct {str(dtype).split('.')[-1]}, {len(prompts)} "
             f"input-grounded prompts x {new} new tokens ({total} positions), greedy; {where}")
    header = ["cache", "teacher-forced top-1 agreement", "positions", "free-running: tokens equal before the first parting, per prompt"]
    save_table(args.out, "bench_fp8_kv_agreement", title, markdown_table(header, rows))
    save_bar_plot(args.out, "bench_fp8_kv_agreement", title.split(";")[0], ["teacher-forced top-1"],
                  {name: [100 * hit / n] for name, (hit, n) in agree.items()}, "agreement with the bf16 cache, %")
    return {name: hit / n for name, (hit, n) in agree.items()}


if __name__ == "__main__":
    main()
