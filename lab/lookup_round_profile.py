"""Where a prompt-lookup round's time goes (issue 34): generate(prompt_lookup_num_tokens=k) on the
real SmolLM2-135M-Instruct over the first --prompts input-grounded prompts, each part of
runtime/prompt_lookup.py's round timed on the host: the proposal, the verification step's launch
(ModelRunner.run_rows_of until it returns) and its device tail (a synchronize after it: the
device's remaining time), the verifier (sampler + the one read-back), and the rest of the round
(cache appends and truncates, bookkeeping). The synchronize adds no work but ends any overlap, so
the sum is an upper bound of an unprofiled round; the plain greedy decode's ms per token, from
the same run, is what a round must beat per accepted token.

    python lab/lookup_round_profile.py [--prompts 6] [--k 10] [--ngram 2] [--max-new 256] [--torch-profile]

--torch-profile: then one more call under torch.profiler (no synchronize added), its ops by host
(self CPU) time: which calls make up the host's share of a round.
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_prompt_lookup import PROMPTS, load_prompts  # noqa: E402

import pagedkv  # noqa: E402
from pagedkv.runtime import prompt_lookup  # noqa: E402
from pagedkv.runtime.model import prepared  # noqa: E402
from pagedkv.runtime.runner import ModelRunner  # noqa: E402
from pagedkv.tools.default_model import load_default_model  # noqa: E402

SECONDS: collections.Counter = collections.Counter()


def timed(name: str, function, sync_after: bool = False):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = function(*args, **kwargs)
        launched = time.perf_counter()
        SECONDS[name] += launched - start
        if sync_after:
            torch.cuda.synchronize()
            SECONDS[name + " (device tail)"] += time.perf_counter() - launched
        return out
    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--ngram", type=int, default=2)
    parser.add_argument("--max-new", type=int, default=256)
    parser.add_argument("--torch-profile", action="store_true")
    args = parser.parse_args()
    model, tokenizer = load_default_model("cuda", torch.bfloat16)
    prompts = load_prompts(PROMPTS, tokenizer, args.prompts)
    greedy = dict(max_new_tokens=args.max_new, do_sample=False)
    lookup = dict(prompt_lookup_num_tokens=args.k, max_matching_ngram_size=args.ngram)
    with torch.inference_mode():
        for ids in (torch.tensor([p], device="cuda") for p in prompts[:1]):  # warm-up: graphs
            pagedkv.generate(model, ids, **greedy)
            pagedkv.generate(model, ids, **greedy, **lookup)
        plain_s = plain_tokens = 0.0
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = pagedkv.generate(model, ids, **greedy)
            torch.cuda.synchronize()
            plain_s += time.perf_counter() - start
            plain_tokens += out.shape[1] - len(p)
        prompt_lookup._round = timed("round", prompt_lookup._round)
        prompt_lookup.NgramProposer.propose = timed("proposal", prompt_lookup.NgramProposer.propose)
        unwrapped = ModelRunner.run_rows_of
        ModelRunner.run_rows_of = timed("verification step launch", unwrapped, sync_after=True)
        prompt_lookup._GreedyVerifier.__call__ = timed("verifier (sample + read-back)",
                                                      prompt_lookup._GreedyVerifier.__call__)
        rounds = tokens = 0
        for p in prompts:
            out = pagedkv.generate(model, torch.tensor([p], device="cuda"), **greedy, **lookup)
            stats = prepared(model).fixed_batch.last_prompt_lookup
            rounds += stats.rounds
            tokens += out.shape[1] - len(p)
    per_round = {name: 1e3 * s / rounds for name, s in SECONDS.items()}
    parts = sum(v for n, v in per_round.items() if n != "round")
    print(f"plain greedy decode: {1e3 * plain_s / plain_tokens:.3f} ms per token ({plain_tokens:.0f} tokens)")
    print(f"prompt lookup: {rounds} rounds, {tokens / rounds:.2f} new tokens a round (k {args.k}, n {args.ngram})")
    for name, ms in sorted(per_round.items(), key=lambda kv: -kv[1]):
        print(f"  {name:40s} {ms:7.3f} ms / round")
    print(f"  {'rest of the round':40s} {per_round['round'] - parts:7.3f} ms / round")
    print(f"a round would need <= {tokens / rounds * 1e3 * plain_s / plain_tokens / 2:.3f} ms for 2x")
    if args.torch_profile:
        ModelRunner.run_rows_of = unwrapped
        from torch.profiler import ProfilerActivity, profile
        with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            pagedkv.generate(model, torch.tensor([prompts[0]], device="cuda"), **greedy, **lookup)
        rounds = prepared(model).fixed_batch.last_prompt_lookup.rounds
        print(f"torch.profiler over one call ({rounds} rounds; totals, divide by the rounds):")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
