"""What a branched prompt-lookup round costs when no row proposes (runtime/graph_branches.py):
on a SmolLM2-shaped model whose text never repeats (bf16) and a prompt of distinct random
tokens, n-gram lookup finds nothing in most rounds, so each round should cost about a decode step if the decode
branch works, and a k + 1-row verification if not. Prints ms per new token of: plain decode
steps, branched rounds, unbranched rounds (PAGEDKV_LOOKUP_BRANCHES=0), and the rounds' counts.

    python3 lab/lookup_branch_cost.py [--k 15] [--new 256] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import pagedkv
from pagedkv.runtime.lookup_rounds import BRANCHES_SWITCH
from pagedkv.runtime.model import prepared


def smollm2_shaped() -> LlamaForCausalLM:
    """SmolLM2-135M's shape whose greedy next token is a fixed permutation (one long cycle) of the
    current one: its layers add nothing (o_proj and down_proj zero), and the LM head's row pi(x)
    is token x's embedding. Its text never repeats, so n-gram lookup finds nothing."""
    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192,
                         tie_word_embeddings=False, rms_norm_eps=1e-5, rope_theta=100000.0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        order = torch.randperm(config.vocab_size)
        following = torch.empty_like(order)
        following[order] = order.roll(-1)  # pi: each token's successor along one cycle
        model.lm_head.weight[following] = model.model.embed_tokens.weight
    return model.to("cuda", torch.bfloat16).eval()


def timed(call, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=15)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model = smollm2_shaped()
    ids = torch.randperm(40000, generator=torch.Generator().manual_seed(1))[:300].add(100).view(1, -1).cuda()
    greedy = dict(max_new_tokens=args.new, do_sample=False, eos_token_id=None, pad_token_id=0)  # no EOS: full length
    lookup = dict(prompt_lookup_num_tokens=args.k, max_matching_ngram_size=4)
    rows = {}
    with torch.inference_mode():
        rows["decode steps"] = (timed(lambda: pagedkv.generate(model, ids, **greedy), args.repeats), None)
        for switch, name in (("1", "branched rounds"), ("0", "unbranched rounds")):
            os.environ[BRANCHES_SWITCH] = switch
            seconds = timed(lambda: pagedkv.generate(model, ids, **greedy, **lookup), args.repeats)
            rows[name] = (seconds, prepared(model).fixed_batch.last_prompt_lookup)
    print(f"SmolLM2-shaped model of non-repeating text, bf16, prompt 300 distinct tokens, {args.new} new, k {args.k}, n 4; "
          f"{torch.cuda.get_device_name()}")
    for name, (seconds, stats) in rows.items():
        extra = (f"; rounds {stats.rounds}, proposed {stats.proposed}, accepted {stats.accepted}, "
                 f"ms / round {1e3 * seconds / stats.rounds:.3f}") if stats else ""
        print(f"{name}: {1e3 * seconds:.1f} ms, {1e3 * seconds / args.new:.3f} ms / new token{extra}")


if __name__ == "__main__":
    main()
