"""Issue 32's speed rows: the architectures past the Llama family at real sizes (random bf16
weights), HF eager and the compiled PyTorch decoder (where it can build the model) against pagedkv
in the same run: ms per decode step, its roofline (bytes the step must read over the measured copy
bandwidth) and the ratio to it, speed-up over HF eager.

    python benchmarks/bench_architectures.py [--out DIR] [--models gemma2,moe,fallback]
        [--moe-batches 1,8,32] [--fallback phi|gpt_neox|olmo] [--new N] [--layers N] [--small]

- gemma2: Gemma-2-9B's shape (42 layers, hidden 3584, 16 q / 8 kv heads, head_dim 256, window 4096
  on alternate layers, softcaps, vocab 256000), batch 1, prompt 4096 + --new tokens. Roofline:
  every weight byte + each layer's K/V over its window (4096 on sliding layers) per step.
- moe: Qwen3-30B-A3B's shape (48 layers, hidden 2048, 32 q / 4 kv heads of 128, 128 experts top-8,
  expert width 768, vocab 151936), batch 1 / 8 / 32, prompt 128. The step reads the attention
  weights, the routers, the LM head, one embedding row a token, and only the experts the step's
  tokens chose: their number (distinct experts per layer, averaged over the decode steps) is
  counted by hooks on HF's routers during HF's own run and printed.
- fallback: a model on the paged fallback path (HF's modules over pagedkv's cache): Phi-2's shape
  by default (2.7B, head_dim 80), batch 1, prompt 128; greedy tokens also compared in fp32 on a
  2-layer copy.

--layers N keeps each model's widths with N layers (e.g. to fit the MoE and HF in one GPU's
memory: 48 layers of bf16 experts are 61 GB); --small runs 2-layer models with a 1024-token
vocabulary (smoke test, CPU too).
Per-step time = (time of 1 + N new tokens - time of 1) / N: the prompt's prefill excluded.
"""

from __future__ import annotations

import argparse
import gc
import pathlib
import sys

import torch
from transformers import AutoModelForCausalLM, Gemma2Config, GPTNeoXConfig, OlmoConfig, PhiConfig, Qwen3MoeConfig

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_generate import CompiledGenerate, per_step_ms  # noqa: E402
from report import markdown_table, save_bar_plot, save_table  # noqa: E402
from timing import copy_bandwidth_gbs  # noqa: E402

import pagedkv  # noqa: E402
from pagedkv.tools.baselines import SUPPORTED as COMPILED_SUPPORTED  # noqa: E402

GEMMA2_9B = dict(hidden_size=3584, intermediate_size=14336, num_hidden_layers=42, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=256, sliding_window=4096, vocab_size=256000,
                 attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=256,
                 max_position_embeddings=8192)
QWEN3_30B_A3B = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                     num_local_experts=128, num_experts_per_tok=8, norm_topk_prob=True, vocab_size=151936,
                     tie_word_embeddings=False, max_position_embeddings=40960)
FALLBACKS = {
    "phi": (PhiConfig, dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=32,
                            num_attention_heads=32, vocab_size=51200, partial_rotary_factor=0.4)),
    "gpt_neox": (GPTNeoXConfig, dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=32,
                                     num_attention_heads=32, vocab_size=50432, rotary_pct=0.25)),
    "olmo": (OlmoConfig, dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                              num_attention_heads=32, vocab_size=50304)),
}


def build(config_cls, shape: dict, layers: int | None, device: str, dtype: torch.dtype, vocab: int | None = None):
    config = config_cls(**{**shape, **({"num_hidden_layers": layers} if layers else {}),
                           **({"vocab_size": vocab} if vocab else {})})
    if getattr(config, "layer_types", None) is not None and layers:
        config.layer_types = config.layer_types[:layers]
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.eos_token_id = None  # every request produces its full length
    model.generation_config.pad_token_id = 0
    return model.eval()


def kv_bytes_per_token(config, element_size: int) -> float:
    """K/V bytes one token adds over all layers."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * kv_heads * head_dim * element_size * config.num_hidden_layers


class RouterCounter:
    """Distinct experts the decode steps' tokens chose, per MoE layer call, from HF's routers
    (hooks on each layer's mlp.gate; a call with `batch` tokens is a decode step)."""

    def __init__(self, model, batch: int):
        self.batch, self.counts = batch, []
        self.handles = [layer.mlp.gate.register_forward_hook(self._hook) for layer in model.model.layers]

    def _hook(self, module, inputs, output):
        x = inputs[0].reshape(-1, inputs[0].shape[-1])
        if x.shape[0] != self.batch:
            return  # a prefill
        logits = torch.nn.functional.linear(x, module.weight)
        ids = torch.topk(logits.float(), module.top_k, dim=-1).indices
        self.counts.append(int(torch.unique(ids).numel()))

    def close(self) -> float:
        for handle in self.handles:
            handle.remove()
        return sum(self.counts) / max(1, len(self.counts))


def expert_bytes(model) -> tuple[int, int]:
    """(bytes of the weights outside the experts, bytes of one expert of one layer)."""
    experts = [p for n, p in model.named_parameters() if ".experts." in n]
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    in_experts = sum(p.numel() * p.element_size() for p in experts)
    per_expert = in_experts // (model.config.num_hidden_layers * experts[0].shape[0])
    return total - in_experts, per_expert


def time_systems(model, batch: int, prompt: int, new: int, device: str, hf: bool, counter=None) -> dict:
    generator = torch.Generator(device).manual_seed(batch)  # the same prompts (and experts) every run
    ids = torch.randint(3, model.config.vocab_size, (batch, prompt), device=device, generator=generator)
    systems = {}
    if hf:
        systems["HF eager"] = lambda i, n: model.generate(i, max_new_tokens=n, do_sample=False)
    systems["pagedkv"] = lambda i, n: pagedkv.generate(model, i, max_new_tokens=n, do_sample=False)
    if device == "cuda" and type(model).__name__ in COMPILED_SUPPORTED:
        systems["compiled PyTorch"] = CompiledGenerate(model, prompt + new + 1, "reduce-overhead")
    out = {}
    for name, generate in systems.items():
        if name == "HF eager" and counter is not None:
            c = counter(model, batch)
            out[name] = per_step_ms(generate, ids, device, new)
            out["distinct experts"] = c.close()
        else:
            out[name] = per_step_ms(generate, ids, device, new)
        print(f"  {name}: {out[name]:.2f}", flush=True)
    out["path"] = pagedkv.support_path(model) if hasattr(pagedkv, "support_path") else ""
    return out


def graphs_note(model) -> str:
    """Whether pagedkv's generate() replayed CUDA graphs for `model` (a fallback model's capture
    may fail: it then runs eagerly, and the error says why)."""
    from pagedkv.runtime.model import prepared
    state = prepared(model)
    error = getattr(state.weights, "capture_error", None)
    runner = state.fixed_batch.runner if state.fixed_batch is not None else None
    if error is not None:
        return f"eager ({error})"
    return "as CUDA graphs" if runner is not None and runner.graphs else "eager"


def row(label, batch, times, roofline_ms, extra=""):
    ours = times["pagedkv"]
    hf = times.get("HF eager")
    comp = times.get("compiled PyTorch")
    return [label, batch, f"{ours:.2f}", f"{hf:.2f}" if hf else "", f"{comp:.2f}" if comp else "n/a",
            f"{roofline_ms:.2f}", f"{ours / roofline_ms:.2f}x", f"{hf / ours:.1f}x" if hf else "",
            f"{comp / ours:.2f}x" if comp else "", extra]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"))
    parser.add_argument("--models", default="gemma2,moe,fallback")
    parser.add_argument("--moe-batches", default="1,8,32")
    parser.add_argument("--fallback", default="phi", choices=sorted(FALLBACKS))
    parser.add_argument("--new", type=int, default=64, help="new tokens a timed generate makes")
    parser.add_argument("--layers", type=int, default=None, help="layers of each model (default: the real count)")
    parser.add_argument("--gemma-prompt", type=int, default=4096)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    layers = 2 if args.small else args.layers
    vocab = 1024 if args.small else None
    copy_gbs = copy_bandwidth_gbs(device) if device == "cuda" else float("nan")
    hf = not args.no_hf
    rows, plot = [], {"pagedkv": [], "HF eager": [], "roofline": []}
    labels = []

    def record(label, batch, times, roofline_ms, extra=""):
        rows.append(row(label, batch, times, roofline_ms, extra))
        labels.append(f"{label.replace(' shape', '').replace(' (fallback)', '')}\nbatch {batch}")
        plot["roofline"].append(roofline_ms)
        plot["pagedkv"].append(times["pagedkv"])
        plot["HF eager"].append(times.get("HF eager", 0.0))
        print(rows[-1], flush=True)

    element = torch.tensor([], dtype=dtype).element_size()
    for name in args.models.split(","):
        if name == "gemma2":
            model = build(Gemma2Config, GEMMA2_9B, layers, device, dtype, vocab)
            prompt = 64 if args.small else args.gemma_prompt
            print(f"Gemma-2-9B shape, {model.config.num_hidden_layers} layers, prompt {prompt}", flush=True)
            times = time_systems(model, 1, prompt, args.new, device, hf)
            weights = sum(p.numel() * p.element_size() for p in model.parameters())
            cfg = model.config
            per_layer = kv_bytes_per_token(cfg, element) / cfg.num_hidden_layers
            context = prompt + args.new / 2
            kv = sum(per_layer * (min(context, cfg.sliding_window) if t == "sliding_attention" else context)
                     for t in cfg.layer_types)
            record("Gemma-2-9B shape", 1, times, 1e3 * (weights + kv) / (copy_gbs * 1e9), f"path {times['path']}")
        elif name == "moe":
            model = build(Qwen3MoeConfig, QWEN3_30B_A3B, layers, device, dtype, vocab)
            print(f"Qwen3-30B-A3B shape, {model.config.num_hidden_layers} layers", flush=True)
            dense, per_expert = expert_bytes(model)
            cfg = model.config
            embeddings = model.get_input_embeddings().weight
            dense -= embeddings.numel() * embeddings.element_size()  # a step reads one row a token
            for batch in [int(b) for b in args.moe_batches.split(",")]:
                times = time_systems(model, batch, 128, args.new, device, hf, RouterCounter if hf else None)
                distinct = times.get("distinct experts", min(cfg.num_experts_per_tok * batch, 128))
                step_bytes = (dense + distinct * per_expert * cfg.num_hidden_layers
                              + batch * (128 + args.new / 2) * kv_bytes_per_token(cfg, element))
                record("Qwen3-30B-A3B shape", batch, times, 1e3 * step_bytes / (copy_gbs * 1e9),
                       f"{distinct:.1f} distinct experts a layer ({'HF routers' if hf else 'assumed'})")
        elif name == "fallback":
            config_cls, shape = FALLBACKS[args.fallback]
            model = build(config_cls, shape, layers, device, dtype, vocab)
            print(f"fallback {args.fallback}, {model.config.num_hidden_layers} layers", flush=True)
            times = time_systems(model, 1, 128, args.new, device, hf)
            weights = sum(p.numel() * p.element_size() for p in model.parameters())
            kv = (128 + args.new / 2) * kv_bytes_per_token(model.config, element)
            record(f"{args.fallback} shape (fallback)", 1, times, 1e3 * (weights + kv) / (copy_gbs * 1e9),
                   f"path {times['path']}, decode steps {graphs_note(model)}")
            small = build(config_cls, shape, 2, device, torch.float32, 1024)
            ids = torch.randint(3, small.config.vocab_size, (1, 32), device=device)
            same = torch.equal(small.generate(ids, max_new_tokens=32, do_sample=False),
                               pagedkv.generate(small, ids, max_new_tokens=32, do_sample=False))
            print(f"fallback {args.fallback}, 2 layers, fp32: greedy tokens equal HF's: {same}", flush=True)
            del small
        else:
            parser.error(f"--models: unknown model {name!r}; allowed: gemma2, moe, fallback")
        del model
        gc.collect()  # pagedkv's prepared state and HF's caches hold the model in cycles
        if device == "cuda":
            torch.cuda.empty_cache()
    header = ["model", "batch", "pagedkv ms/step", "HF eager ms/step", "compiled ms/step", "roofline ms",
              "pagedkv / roofline", "speed-up vs HF eager", "speed-up vs compiled", "note"]
    title = (f"Issue 32 architectures, {str(dtype).split('.')[-1]}, {args.new} new tokens, greedy; "
             f"{torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}; copy bandwidth {copy_gbs:.0f} GB/s")
    save_table(args.out, "bench_architectures", title, markdown_table(header, rows))
    save_bar_plot(args.out, "bench_architectures", title.split(";")[0], labels, plot, "ms per decode step")


if __name__ == "__main__":
    main()
