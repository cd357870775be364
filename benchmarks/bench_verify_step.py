"""Issue 34's verification-step cost: one runner step of k+1 query tokens per row (the step prompt
lookup runs each round: a row's last token and its k proposed tokens, paged prefill attention,
logits for every token) against a one-token decode step, on the W1 shape (bench_generate.py's
Qwen2.5-7B-shaped model, random bf16 weights), for k = 1..8 at batch 1 / 8 / 32, each row over
a 128-token context.

    python benchmarks/bench_verify_step.py [--out DIR] [--batches 1,8,32] [--ks 1,...,8] [--small]

Runner-level timing: ModelRunner.run on a StepInput, wall time from the call to the device's end
(torch.cuda.synchronize), median of repeats; the step's host work (metadata, copies) counts for
both. The decode step is timed as a CUDA graph replay (ModelRunner's captured decode step: the
graph the engine replays; generate()'s own decode graphs also sample inside, the same forward) and
eagerly for reference; the verification step eagerly and, on CUDA, as a CUDA graph through
ModelRunner.run_rows_of (the padded verification step prompt lookup and assistant_model run with
on CUDA by default). The cache holds the same rows before every timed step (tokens appended,
timed, truncated again). Ratios: graph verification / graph decode, eager / eager. Goal (issue 34):
k+1 = 5 at batch 1 <= 1.10x the graph decode step (on the CPU, where there are no graphs, eager
against eager). --small: a tiny 2-layer shape on the CPU (smoke test).
"""

from __future__ import annotations

import argparse
import math
import pathlib
import statistics
import sys
import time

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_generate import W1, build_model  # noqa: E402
from report import markdown_table, save_bar_plot, save_table  # noqa: E402

from pagedkv.cache.kv_cache import KVCache  # noqa: E402
from pagedkv.runtime.model import prepared  # noqa: E402
from pagedkv.runtime.runner import ModelRunner, StepInput  # noqa: E402

TINY = dict(W1, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=1024)
CONTEXT, BLOCK = 128, 16
GOAL_K, GOAL_RATIO = 4, 1.10


def build(small: bool, device: str):
    if not small:
        return build_model(False, device)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(Qwen2Config(**TINY), dtype=torch.float32)
    return model.eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class Rows:
    """`batch` sequences of CONTEXT random tokens, prefilled in a cache of their own, and runners
    (eager; CUDA graphs on CUDA) over it."""

    def __init__(self, model, batch: int, max_k: int):
        self.state = state = prepared(model)
        w = state.weights
        per_row = math.ceil((CONTEXT + max_k + 1) / BLOCK)
        self.cache = KVCache(len(w.layers), w.num_kv_heads, w.head_dim, dtype=state.dtype,
                             device=state.device, block_size=BLOCK, num_blocks=batch * per_row,
                             max_seq_len=state.max_positions, enable_prefix_caching=False,
                             max_batch_size=max(batch, 256), max_step_tokens=max(batch * CONTEXT, 256))
        self.eager = ModelRunner(state, self.cache, use_cuda_graphs=False)
        cuda = state.device.type == "cuda"
        self.graphs = ModelRunner(state, self.cache, use_cuda_graphs=True, max_batch=batch) if cuda else None
        if self.graphs is not None:  # its verification steps as graphs (prompt lookup's path on CUDA)
            self.graphs.verify_graphs = True
        self.seq_ids = list(range(batch))
        vocab = model.config.vocab_size
        generator = torch.Generator().manual_seed(batch)
        prompts = torch.randint(3, vocab, (batch, CONTEXT), generator=generator).tolist()
        for sid, prompt in zip(self.seq_ids, prompts):
            self.cache.add_sequence(sid, prompt)
        with torch.inference_mode():
            last = [(r + 1) * CONTEXT - 1 for r in range(batch)]  # logits of the last tokens only
            self.eager.run(StepInput(self.seq_ids, sum(prompts, []), [CONTEXT] * batch, last))
        self.tokens = torch.randint(3, vocab, (batch * (max_k + 1),), generator=generator).tolist()

    def step_ms(self, runner: ModelRunner, query: int, decode: bool, repeats: int, rows_of: bool = False) -> float:
        """Median ms of one step of `query` new tokens a row (decode: query 1, decode metadata;
        rows_of: through ModelRunner.run_rows_of, the verification step prompt lookup runs, a CUDA
        graph per width when the runner's verify_graphs is on)."""
        batch = len(self.seq_ids)
        samples = []
        with torch.inference_mode():
            for i in range(repeats + 3):  # 3 warm-ups (a graph's capture, the allocator)
                for r, sid in enumerate(self.seq_ids):
                    self.cache.append_tokens(sid, self.tokens[r * query:(r + 1) * query])
                step = StepInput(self.seq_ids, self.tokens[:batch * query], None if decode else [query] * batch)
                sync(self.state.device)
                start = time.perf_counter()
                logits = runner.run_rows_of(step, query) if rows_of else runner.run(step)  # [B * query, V]
                sync(self.state.device)
                if i >= 3:
                    samples.append(1e3 * (time.perf_counter() - start))
                del logits
                for sid in self.seq_ids:
                    self.cache.truncate(sid, query)
        return statistics.median(samples)


def main(argv: list[str] | None = None) -> list[list]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"))
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--ks", default="1,2,3,4,5,6,7,8")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps per row (default 30 CUDA, 5 CPU)")
    parser.add_argument("--small", action="store_true", help="a tiny 2-layer shape (CPU smoke test)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    device = args.device
    repeats = args.repeats or (30 if device == "cuda" else 5)
    batches = [int(b) for b in args.batches.split(",")]
    ks = [int(k) for k in args.ks.split(",")]
    model = build(args.small, device)
    cuda = device == "cuda"
    rows, plot = [], {f"k = {k}": [] for k in ks}
    goal_ratio = None
    for batch in batches:
        bench = Rows(model, batch, max(ks))
        decode_eager = bench.step_ms(bench.eager, 1, True, repeats)
        decode_graph = bench.step_ms(bench.graphs, 1, True, repeats) if cuda else float("nan")
        base = decode_graph if cuda else decode_eager
        print(f"batch {batch}: decode step {decode_graph:.3f} ms (graph), {decode_eager:.3f} ms (eager)", flush=True)
        for k in ks:
            verify = bench.step_ms(bench.eager, k + 1, False, repeats)
            verify_graph = bench.step_ms(bench.graphs, k + 1, False, repeats, rows_of=True) if cuda else float("nan")
            ratio = (verify_graph if cuda else verify) / base
            rows.append([batch, k, k + 1, verify, verify_graph if cuda else "n/a", decode_graph if cuda else "n/a",
                         decode_eager, ratio if cuda else "n/a", verify / decode_eager])
            plot[f"k = {k}"].append(ratio)
            print(rows[-1], flush=True)
            if batch == 1 and k == GOAL_K:
                goal_ratio = ratio
        del bench
    header = ["batch", "k", "query tokens / row", "ms verification step (eager)", "ms verification step (graph)",
              "ms decode step (graph)", "ms decode step (eager)", "ratio graph / graph", "ratio eager / eager"]
    shape = "tiny 2-layer Qwen2 shape (smoke), fp32" if args.small else "W1 (Qwen2.5-7B shape), bf16"
    title = (f"Verification step (k+1 query tokens a row) vs decode step, {shape}, context {CONTEXT}, "
             f"runner-level (ModelRunner.run + sync, median of {repeats}); "
             f"{torch.cuda.get_device_name() if cuda else 'cpu (no graphs: ratio vs the eager decode step)'}")
    save_table(args.out, "bench_verify_step", title, markdown_table(header, rows))
    save_bar_plot(args.out, "bench_verify_step", title.split(";")[0], [f"batch {b}" for b in batches],
                  plot, "verification step / decode step")
    against = "graph" if cuda else "eager (CPU: no graphs)"
    if goal_ratio is None:
        print(f"goal: k+1 = {GOAL_K + 1} at batch 1 <= {GOAL_RATIO}x the decode step: n/a (not run)")
    else:
        verdict = "PASS" if goal_ratio <= GOAL_RATIO else "FAIL"
        print(f"goal: k+1 = {GOAL_K + 1} at batch 1 <= {GOAL_RATIO}x the {against} decode step: "
              f"{goal_ratio:.2f}x: {verdict}")
    return rows


if __name__ == "__main__":
    main()
