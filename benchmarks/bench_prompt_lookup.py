"""Issue 34's prompt-lookup rows: the real SmolLM2-135M-Instruct (pagedkv.tools.default_model, in
the model dtype: bf16 on CUDA, fp32 on the CPU) over the fixed input-grounded prompts of
benchmarks/prompts/input_grounded.jsonl (summarise, rewrite, edit or fix a passage or piece of
code held in the prompt; chat-formatted with the tokenizer's template), greedy, in one run:

- pagedkv without speculation (CUDA graphs where it has them),
- pagedkv with prompt lookup (generate(prompt_lookup_num_tokens=k, max_matching_ngram_size=n)),
- HF generate without it and HF generate with its own prompt lookup (HF refuses batches > 1:
  n/a there).

    python benchmarks/bench_prompt_lookup.py [--out DIR] [--k 10] [--ngram 2] [--max-new 256]
                                             [--batch B] [--no-hf] [--small]

tokens/s = new tokens (through each row's EOS) over the summed wall time of all prompts, one call
per prompt group (B prompts, left-padded), systems interleaved per group so drift hits all alike;
one warm-up call per system first. Acceptance = accepted / proposed tokens over the run;
tokens / round = new tokens after the first (the prefill's) over verification rounds (a round
verifies every unfinished row of the batch). pagedkv's prompt-lookup tokens must equal its
non-speculative tokens: a FAIL line says where not. HF's tokens beside pagedkv's are
informational (bf16 may part at near-ties). Goals (issue 34, batch 1): prompt lookup >= 2.0x
pagedkv without speculation, and faster than HF's prompt lookup. k defaults to 10, HF's default
prompt_lookup_num_tokens; n to 2, HF's max_matching_ngram_size default. --small: the first 3
prompts, 16 new tokens (CPU smoke test).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import torch
from tqdm import tqdm

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from report import markdown_table, save_bar_plot, save_table  # noqa: E402

import pagedkv  # noqa: E402
from pagedkv.runtime.model import prepared  # noqa: E402
from pagedkv.tools.default_model import load_default_model  # noqa: E402

PROMPTS = pathlib.Path(__file__).resolve().parent / "prompts" / "input_grounded.jsonl"
PAGEDKV, PAGEDKV_PLD, HF, HF_PLD = ("pagedkv", "pagedkv prompt lookup", "HF generate", "HF prompt lookup")
GOAL_SPEEDUP = 2.0


def load_prompts(path: pathlib.Path, tokenizer, limit: int | None = None) -> list[list[int]]:
    """Each prompt's user message, chat-formatted with the tokenizer's template, as token ids."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    out = []
    for record in records[:limit]:
        text = tokenizer.apply_chat_template([{"role": "user", "content": record["prompt"]}],
                                             add_generation_prompt=True, tokenize=False)
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


def left_padded(rows: list[list[int]], pad: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask [len(rows), longest], left-padded."""
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad, dtype=torch.int64)
    mask = torch.zeros(len(rows), width, dtype=torch.int64)
    for r, row in enumerate(rows):
        ids[r, width - len(row):] = torch.tensor(row)
        mask[r, width - len(row):] = 1
    return ids.to(device), mask.to(device)


def new_tokens(output: torch.Tensor, prompt_width: int, eos: set[int]) -> list[list[int]]:
    """Each row's new tokens through its first EOS (what follows is padding)."""
    rows = []
    for row in output[:, prompt_width:].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        rows.append(row[:end])
    return rows


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"))
    parser.add_argument("--k", type=int, default=10, help="prompt_lookup_num_tokens")
    parser.add_argument("--ngram", type=int, default=2, help="max_matching_ngram_size")
    parser.add_argument("--max-new", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompts", type=pathlib.Path, default=PROMPTS)
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--small", action="store_true", help="3 prompts, 16 new tokens (CPU smoke test)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    max_new = 16 if args.small else args.max_new
    model, tokenizer = load_default_model(device, dtype)
    prompts = load_prompts(args.prompts, tokenizer, 3 if args.small else None)
    gen = model.generation_config
    eos = {gen.eos_token_id} if isinstance(gen.eos_token_id, int) else set(gen.eos_token_id or ())
    pad = gen.pad_token_id if gen.pad_token_id is not None else next(iter(eos))
    greedy = dict(max_new_tokens=max_new, do_sample=False, pad_token_id=pad)
    lookup = dict(prompt_lookup_num_tokens=args.k, max_matching_ngram_size=args.ngram)
    batch = args.batch
    systems = {
        PAGEDKV: lambda ids, mask: pagedkv.generate(model, ids, attention_mask=mask, **greedy),
        PAGEDKV_PLD: lambda ids, mask: pagedkv.generate(model, ids, attention_mask=mask, **greedy, **lookup),
    }
    if not args.no_hf:
        systems[HF] = lambda ids, mask: model.generate(ids, attention_mask=mask, **greedy)
        if batch == 1:  # HF's assisted generation refuses batches > 1
            systems[HF_PLD] = lambda ids, mask: model.generate(ids, attention_mask=mask, **greedy, **lookup)
    groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    seconds = dict.fromkeys(systems, 0.0)
    tokens = {name: [] for name in systems}  # per prompt, its new tokens
    rounds = proposed = accepted = 0
    with torch.inference_mode():
        warm_ids, warm_mask = left_padded(groups[0], pad, device)
        for generate in systems.values():
            generate(warm_ids, warm_mask)
        for group in tqdm(groups, desc=f"prompt groups of {batch}", file=sys.stdout):
            ids, mask = left_padded(group, pad, device)
            for name, generate in systems.items():
                sync(device)
                start = time.perf_counter()
                out = generate(ids, mask)
                sync(device)
                seconds[name] += time.perf_counter() - start
                tokens[name] += new_tokens(out, ids.shape[1], eos)
                if name == PAGEDKV_PLD:
                    stats = prepared(model).fixed_batch.last_prompt_lookup
                    rounds, proposed, accepted = (rounds + stats.rounds, proposed + stats.proposed,
                                                  accepted + stats.accepted)

    # pagedkv's speculative tokens must be its greedy tokens, prompt for prompt
    differing = [i for i, (a, b) in enumerate(zip(tokens[PAGEDKV], tokens[PAGEDKV_PLD])) if a != b]
    equal = not differing
    if equal:
        print(f"PASS: pagedkv prompt-lookup tokens equal pagedkv's greedy tokens on all {len(prompts)} prompts")
    else:
        print(f"FAIL: pagedkv prompt-lookup tokens differ from pagedkv's greedy tokens on prompts {differing}")
    counts = {name: sum(map(len, rows)) for name, rows in tokens.items()}
    speed = {name: counts[name] / seconds[name] for name in systems}
    first_tokens = len(tokens[PAGEDKV_PLD])  # one per row, from the prefill
    rows = []
    for name in systems:
        same = sum(a == b for a, b in zip(tokens[name], tokens[PAGEDKV]))
        spec = name == PAGEDKV_PLD
        rows.append([name, counts[name], seconds[name], speed[name], speed[name] / speed[PAGEDKV],
                     f"{accepted / proposed:.3f}" if spec and proposed else ("n/a" if name == HF_PLD else ""),
                     f"{(counts[name] - first_tokens) / rounds:.2f}" if spec and rounds else "",
                     f"{same}/{len(prompts)}"])
    header = ["system", "new tokens", "seconds", "tokens/s", "speed-up vs pagedkv",
              "acceptance (accepted / proposed)", "new tokens / round", "prompts equal to pagedkv"]
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    title = (f"Prompt lookup (k {args.k}, n {args.ngram}), SmolLM2-135M-Instruct {str(dtype)[6:]}, "
             f"{len(prompts)} input-grounded prompts, batch {batch}, max_new_tokens {max_new}, greedy; "
             f"{device_name}; rounds {rounds}, proposed {proposed}, accepted {accepted}")
    save_table(args.out, "bench_prompt_lookup", title, markdown_table(header, rows))
    save_bar_plot(args.out, "bench_prompt_lookup", title.split(";")[0], [f"batch {batch}"],
                  {name: [speed[name]] for name in systems}, "tokens/s")
    ratio = speed[PAGEDKV_PLD] / speed[PAGEDKV]
    goals = [f"goal: prompt lookup >= {GOAL_SPEEDUP}x pagedkv without speculation: "
             f"{ratio:.2f}x: {'PASS' if ratio >= GOAL_SPEEDUP else 'FAIL'}"]
    if HF_PLD in speed:
        over = speed[PAGEDKV_PLD] / speed[HF_PLD]
        goals.append(f"goal: faster than HF's prompt lookup: {over:.2f}x: {'PASS' if over > 1 else 'FAIL'}")
    else:
        goals.append("goal: faster than HF's prompt lookup: n/a (" +
                     ("--no-hf" if args.no_hf else "HF's prompt lookup refuses batch > 1") + ")")
    for line in goals:
        print(line + (" (batch 1 is the goal's setting)" if batch != 1 else ""))
    return {"equal": equal, "speed": speed, "rounds": rounds, "proposed": proposed, "accepted": accepted}


if __name__ == "__main__":
    main()
