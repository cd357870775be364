"""Soak test of pagedkv.LLM on the CPU: many requests of random lengths through a small KV cache
(so that preemption is forced all the time), with shared prompt openings (prefix hits), n = 2
samples (forks), stop tokens and aborts mixed in. Every finished output is compared with HF's
greedy generate of the same request (one request at a time: independent of the engine's
scheduling), and the cache is checked for leaked blocks every few steps and at the end. An output
that parts from HF's where HF's own fp32 logits tie (top two within 1e-4 relative, the engine's
token among them) is a near-tie, not a mismatch: batched and single-row matmuls round
differently, and over 10^5 tokens of a random model a few such ties come up.

    .venv/bin/python scripts/soak.py                   # 10,000 requests (a few minutes)
    .venv/bin/python scripts/soak.py --requests 300    # what tests/test_soak.py runs in CI

Prints `requests=... tokens=... preemptions=... leaks=0 mismatches=0` and exits non-zero on any
leak or mismatch.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import time
from collections import Counter

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pagedkv import LLM, SamplingParams

VOCAB = 512


@dataclasses.dataclass(slots=True)
class SoakResult:
    requests: int = 0  # submitted
    finished: int = 0  # finished and compared with HF
    aborted: int = 0
    tokens: int = 0  # output tokens compared
    preemptions: int = 0
    cached_prompt_tokens: int = 0
    steps: int = 0
    leaks: int = 0  # failed leak checks
    mismatches: int = 0
    near_ties: int = 0  # outputs that part from HF's at a tie of HF's logits
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.leaks == 0 and self.mismatches == 0

    def summary(self) -> str:
        return (f"requests={self.requests} tokens={self.tokens} preemptions={self.preemptions} "
                f"leaks={self.leaks} mismatches={self.mismatches} near_ties={self.near_ties} "
                f"finished={self.finished} aborted={self.aborted} "
                f"cached_prompt_tokens={self.cached_prompt_tokens} steps={self.steps} "
                f"time={self.seconds:.0f}s")


def tiny_model(seed: int) -> LlamaForCausalLM:
    """2 layers, head_dim 64, random weights widened (as tests/models.py) so that greedy logits
    are far from ties and the tokens vary."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3 * 16 / p.shape[-1] ** 0.5)
    return model.eval()


class Reference:
    """HF's greedy tokens per prompt, computed once at the longest length asked; a shorter
    request's tokens are a prefix of them, a stop token ends them."""

    def __init__(self, model, max_new: int):
        self.model, self.max_new = model, max_new
        self.tokens: dict[tuple[int, ...], list[int]] = {}

    def expected(self, prompt: list[int], params: SamplingParams) -> list[int]:
        key = tuple(prompt)
        if key not in self.tokens:
            out = self.model.generate(torch.tensor([prompt]), max_new_tokens=self.max_new, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)
            self.tokens[key] = out[0, len(prompt):].tolist()
        full = self.tokens[key][:params.max_tokens]
        stops = [i for i, t in enumerate(full) if t in params.stop_token_ids]
        return full[:stops[0] + 1] if stops else full

    def near_tie(self, prompt: list[int], got: list[int], want: list[int], rel: float = 1e-4) -> bool:
        """Whether `got` first parts from `want` where HF's logits rank its token level with HF's."""
        k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if k is None:
            return False  # same tokens, different lengths: a real mismatch
        out = self.model.generate(torch.tensor([prompt]), max_new_tokens=k + 1, do_sample=False,
                                  eos_token_id=None, pad_token_id=0, output_logits=True,
                                  return_dict_in_generate=True)
        logits = out.logits[k][0].float()
        best = logits.max()
        return bool(best - logits[got[k]] <= rel * max(1.0, best.abs().item()))


def leak_problems(llm: LLM) -> list[str]:
    """What is wrong with the cache's books: sequences it holds that the scheduler does not run,
    blocks whose reference count is not their number of owners, or free + used != total."""
    cache, problems = llm.cache, []
    manager = cache.manager
    running = {s.seq_id for s in llm.scheduler.running}
    held = set(manager.sequence_ids())
    if held != running:
        problems.append(f"cache holds sequences {sorted(held - running)[:5]} not running, misses "
                        f"{sorted(running - held)[:5]}")
    owners = Counter(b for sid in held for b in manager.block_table(sid))
    wrong = [b for b in range(cache.num_blocks) if manager.ref_count(b) != owners[b]]
    if wrong:
        problems.append(f"blocks {wrong[:5]} have ref counts != owners")
    if len(owners) + cache.num_free_blocks != cache.num_blocks:
        problems.append(f"{len(owners)} used + {cache.num_free_blocks} free != {cache.num_blocks} blocks")
    return problems


def random_request(rng: random.Random, openings: list[list[int]], args) -> tuple[list[int], SamplingParams]:
    n = rng.randint(1, args.max_prompt)
    prompt = (rng.choice(openings) if rng.random() < 0.5 else []) + [rng.randrange(3, VOCAB) for _ in range(n)]
    prompt = prompt[:args.max_prompt]
    stop = (rng.randrange(3, VOCAB),) if rng.random() < 0.2 else ()
    params = SamplingParams(max_tokens=rng.randint(1, args.max_output), temperature=0, ignore_eos=True,
                            n=2 if rng.random() < 0.1 else 1, stop_token_ids=stop)
    return prompt, params


def run(args) -> SoakResult:
    torch.set_num_threads(args.threads)  # a tiny model: more threads only add overhead
    model = tiny_model(args.seed)
    llm = LLM(model, num_kv_blocks=args.blocks, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_batched_tokens)
    reference = Reference(model, args.max_output)
    rng = random.Random(args.seed)
    # Shared openings (one or two blocks) make prefix-cache hits common.
    openings = [[rng.randrange(3, VOCAB) for _ in range(rng.choice([16, 32]))] for _ in range(6)]
    result = SoakResult()
    pending: dict[str, tuple[list[int], SamplingParams]] = {}
    bar = None
    if not args.no_tqdm:
        from tqdm.auto import tqdm

        bar = tqdm(total=args.requests, desc="soak", unit="req", dynamic_ncols=True)
    start = time.perf_counter()
    while result.requests < args.requests or llm.has_unfinished_requests():
        while result.requests < args.requests and len(pending) < args.inflight:
            prompt, params = random_request(rng, openings, args)
            pending[llm.add_request(prompt, params)] = (prompt, params)
            result.requests += 1
        outputs = llm.step(partial=False)
        result.steps += 1
        for out in outputs:
            prompt, params = pending.pop(out.request_id)
            want = reference.expected(prompt, params)
            result.finished += 1
            for completion in out.outputs:
                result.tokens += len(completion.token_ids)
                if completion.token_ids == want:
                    continue
                tie = reference.near_tie(prompt, completion.token_ids, want)
                result.near_ties += tie
                result.mismatches += not tie
                print(f"\n{'near-tie' if tie else 'mismatch'}: request {out.request_id} prompt {prompt} "
                      f"{params}: got {completion.token_ids}, HF {want}", file=sys.stderr)
        if pending and rng.random() < args.abort_rate:
            victim = rng.choice(list(pending))
            llm.abort_request(victim)
            del pending[victim]
            result.aborted += 1
        if result.steps % args.check_every == 0:
            problems = leak_problems(llm)
            result.leaks += bool(problems)
            for p in problems:
                print(f"\nleak check at step {result.steps}: {p}", file=sys.stderr)
        done = result.finished + result.aborted
        if bar is not None and done > bar.n:
            bar.set_postfix_str(f"preemptions {llm.stats.num_preemptions}", refresh=False)
            bar.update(done - bar.n)  # tqdm redraws at most every mininterval
    if bar is not None:
        bar.close()
    result.seconds = time.perf_counter() - start
    problems = leak_problems(llm)
    if len(llm.cache.manager) or llm.cache.num_free_blocks != llm.cache.num_blocks or llm._requests:
        problems.append(f"after the run: {len(llm.cache.manager)} sequences, {llm.cache.num_free_blocks} "
                        f"of {llm.cache.num_blocks} blocks free, {len(llm._requests)} requests left")
    result.leaks += bool(problems)
    for p in problems:
        print(f"leak check at the end: {p}", file=sys.stderr)
    result.preemptions = llm.stats.num_preemptions
    result.cached_prompt_tokens = llm.stats.num_cached_prompt_tokens
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--blocks", type=int, default=12, help="KV-cache blocks (small: forces preemption)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-batched-tokens", type=int, default=64)
    p.add_argument("--max-prompt", type=int, default=64)
    p.add_argument("--max-output", type=int, default=24)
    p.add_argument("--inflight", type=int, default=32, help="requests queued or running at once")
    p.add_argument("--abort-rate", type=float, default=0.01, help="chance per step to abort a request")
    p.add_argument("--check-every", type=int, default=25, help="steps between leak checks")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-tqdm", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    result = run(parse_args(argv))
    print(result.summary())
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
