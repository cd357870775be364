"""Quantized mixture-of-experts decode (issue 33's "MoE experts use the same formats", on issue 32's
Qwen3-30B-A3B shape: hidden 2048, 32 q / 4 kv heads of 128, 128 experts top-8 of width 768), in one
run: pagedkv on each format's checkpoint with the quantized expert kernels (each chosen expert's
stored bytes read once, dequantized in registers), the same checkpoint with them off (each step's
chosen experts dequantized into temporaries: the path before the kernels), pagedkv bf16 and HF
eager bf16; ms per decode step and each row's roofline.

    python benchmarks/bench_moe_quantized.py [--formats fp8,int4] [--batches 1,8] [--layers 16]
        [--new 32] [--out DIR] [--no-hf] [--kernels-only] [--small]

Checkpoints are written from the bf16 model's random weights in each format's exact on-disk
tensors (benchmarks/quantized_w1.py: attention and experts quantized; routers, norms, embedding
and LM head bf16), to a temp folder deleted after its rows. Roofline = bytes a step reads over the
copy bandwidth measured in the run: every weight outside the experts, the batch's embedding rows,
the K/V over the mean context, and the distinct experts the batch's tokens choose at their stored
bytes, expected under uniform routing, E (1 - (1 - k / E)^B) (8 at batch 1, ~52 at batch 8; the
random router is near uniform). --layers L of the 48 keeps memory for the bf16 model and a
checkpoint side by side (48 layers of bf16 experts are 61 GB). Per-step time: bench_generate's
difference of a (1 + new)-token and a 1-token generate, taken PAIRS times back to back, the median
shown with the pairs' range: a batch-8 prefill (1,024 tokens, every expert chosen) runs the
dequantizing grouped path, whose allocations make its time heavy-tailed (session 38's H100 run: a
single min-of-3 difference came out at -0.38 and -3.64 ms). A row whose median is not positive
prints "unstable" and its pairs, never a negative time.
--kernels-only: leave out the rows with the kernels off (A/B runs of the kernels).
--small: a 2-layer model with 16 experts on the CPU (the smoke test; its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import statistics
import sys
import tempfile
from unittest import mock

import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_architectures import QWEN3_30B_A3B  # noqa: E402
from bench_generate import step_ms_pairs  # noqa: E402
from quantized_w1 import FORMATS, write_checkpoint  # noqa: E402
from report import markdown_table, save_bar_plot, save_table  # noqa: E402
from timing import copy_bandwidth_gbs  # noqa: E402

import pagedkv  # noqa: E402
from pagedkv.layers import moe  # noqa: E402
from pagedkv.models.registry import PREPARED_ATTR  # noqa: E402
from pagedkv.runtime.model import weight_bytes  # noqa: E402

PROMPT = 128
PAIRS = 5
SMALL = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=16, num_experts_per_tok=4,
             norm_topk_prob=True, vocab_size=512, tie_word_embeddings=False, max_position_embeddings=1024)


def build_model(small: bool, layers: int, device: str) -> torch.nn.Module:
    config = Qwen3MoeConfig(**(SMALL if small else {**QWEN3_30B_A3B, "num_hidden_layers": layers}))
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32 if small else torch.bfloat16)
    model.generation_config.eos_token_id = None  # every request produces its full length
    model.generation_config.pad_token_id = 0
    return model.eval()


def expected_distinct(num_experts: int, top_k: int, batch: int) -> float:
    """Distinct experts `batch` tokens choose, each k of E uniformly at random."""
    return num_experts * (1 - (1 - top_k / num_experts) ** batch)


def step_bytes(model, batch: int, new: int) -> float:
    """Bytes a decode step of `batch` rows reads from the weights pagedkv holds for `model` (bf16 or
    as the checkpoint stores them), with the expected distinct experts."""
    w = getattr(model, PREPARED_ATTR).weights
    total = weight_bytes(w) - w.embed.numel() * w.embed.element_size()  # a step reads its rows only
    embed_row = w.embed.shape[1] * w.embed.element_size()
    kv = 0.0
    for layer in w.layers:
        m = layer.moe
        parts = [m.gate_up, m.down] if isinstance(m.down, torch.Tensor) else [t for e in (*m.gate_up, m.down)
                                                                              for t in e.tensors()]
        experts_bytes = sum(t.numel() * t.element_size() for t in parts)
        distinct = expected_distinct(m.router.shape[0], m.top_k, batch)
        total += experts_bytes * (distinct / m.router.shape[0] - 1)
        kv += 2 * w.num_kv_heads * w.head_dim * w.embed.element_size() * (PROMPT + new / 2)
    return total + batch * (embed_row + kv)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"))
    parser.add_argument("--formats", default="fp8,int4")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--layers", type=int, default=16, help="decoder layers of the 48 (memory: see above)")
    parser.add_argument("--new", type=int, default=32, help="new tokens a timed generate makes")
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--kernels-only", action="store_true", help="no rows with the expert kernels off")
    parser.add_argument("--tmp", default=None, help="where the checkpoints are written (default: the temp dir)")
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    device, small = args.device, args.small or args.device == "cpu"
    formats = [f for f in args.formats.split(",") if f]
    unknown = [f for f in formats if f not in ("fp8", "int4")]
    if unknown:
        parser.error(f"--formats: {unknown} unknown; the expert kernels take fp8 and int4")
    batches = [int(b) for b in args.batches.split(",")]
    copy_gbs = copy_bandwidth_gbs(device) if device == "cuda" else 10.0  # CPU: a nominal figure
    dtype = torch.float32 if small else torch.bfloat16
    model = build_model(small, args.layers, device)
    prompts = {b: torch.randint(3, model.config.vocab_size, (b, PROMPT), device=device,
                                generator=torch.Generator(device).manual_seed(b)) for b in batches}
    ms, roof, spread, notes = {}, {}, {}, []  # (system, batch) -> ms / roofline ms / (min, max) ms

    def timed(system: str, m, generate=None) -> None:
        generate = generate or (lambda ids, n: pagedkv.generate(m, ids, max_new_tokens=n, do_sample=False))
        for b in batches:
            each = step_ms_pairs(generate, prompts[b], device, args.new, PAIRS)
            spread[system, b] = (min(each), max(each))
            median = statistics.median(each)
            if median > 0:
                ms[system, b] = median
            else:
                notes.append(f"{system}, batch {b}: unstable, ms / step of each pair "
                             f"{', '.join(f'{v:.2f}' for v in each)}")
            if m is not None:
                roof[system, b] = 1e3 * step_bytes(m, b, args.new) / (copy_gbs * 1e9)
            print(f"{system}, batch {b}: median {median:.3f} ms/step of {len(each)} pairs "
                  f"({min(each):.3f}-{max(each):.3f})", flush=True)

    if not (small or args.no_hf):
        timed("HF eager bf16", None, lambda ids, n: model.generate(ids, max_new_tokens=n, do_sample=False))
    timed("pagedkv bf16", model)
    delattr(model, PREPARED_ATTR)  # its cache: room for the checkpoints' rows
    for key in formats:
        folder = pathlib.Path(tempfile.mkdtemp(prefix=f"bench_moe_quantized_{key}_", dir=args.tmp))
        try:
            size = write_checkpoint(model, folder, FORMATS[key])
            print(f"{FORMATS[key].label}: wrote {size / 1e9:.2f} GB", flush=True)
            for kernels in (True,) if args.kernels_only else (True, False):
                system = f"pagedkv {key}" + ("" if kernels else ", experts dequantized each step")
                # Loaded again with the kernels off: graphs captured before would keep their path.
                with mock.patch.object(moe, "quantized_kernels_take", moe.quantized_kernels_take if kernels
                                       else (lambda *a: False)):
                    quantized = pagedkv.from_pretrained_quantized(folder, dtype=dtype, device=device)
                    timed(system, quantized)
                del quantized
                if device == "cuda":
                    torch.cuda.empty_cache()
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    header = ["batch", "system", "ms / step", f"range of {PAIRS} pairs", "roofline ms", "ms / roofline",
              "vs pagedkv bf16", "vs HF eager bf16"]
    systems = ["HF eager bf16", "pagedkv bf16"] + [f"pagedkv {k}{s}" for k in formats
                                                    for s in ("", ", experts dequantized each step")]
    rows = []
    for b in batches:
        for s in systems:
            if (s, b) not in spread:
                continue
            low, high = spread[s, b]
            t, r = ms.get((s, b)), roof.get((s, b))
            bf16, hf = ms.get(("pagedkv bf16", b)), ms.get(("HF eager bf16", b))
            rows.append([b, s, f"{t:.2f}" if t else "unstable", f"{low:.2f} to {high:.2f}", f"{r:.2f}" if r else "",
                         f"{t / r:.2f}x" if r and t else "", f"{bf16 / t:.2f}x" if bf16 and t else "",
                         f"{hf / t:.1f}x" if hf and t else ""])
    layers = model.config.num_hidden_layers
    shape = "tiny Qwen3-MoE (smoke, CPU)" if small else f"Qwen3-30B-A3B shape, {layers} of 48 layers"
    title = (f"{shape}, quantized checkpoints (attention and experts), prompt {PROMPT}, {args.new} new tokens, "
             f"greedy; {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}; copy bandwidth "
             f"{copy_gbs:.0f} GB/s{' (nominal)' if device != 'cuda' else ''}; distinct experts a step: expected "
             f"under uniform routing ({', '.join(f'batch {b}: {expected_distinct(128 if not small else 16, 8 if not small else 4, b):.1f}' for b in batches)})")
    save_table(args.out, "bench_moe_quantized", title, markdown_table(header, rows) + "\n" + "\n".join(notes))
    plot = {s: [ms.get((s, b), 0.0) for b in batches] for s in systems if any((s, b) in ms for b in batches)}
    save_bar_plot(args.out, "bench_moe_quantized", title.split(";")[0], [f"batch {b}" for b in batches], plot,
                  "ms per decode step")


if __name__ == "__main__":
    main()
