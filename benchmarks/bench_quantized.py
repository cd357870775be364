"""Issue 33's speed rows: W1 (Qwen2.5-7B shape) decode steps on quantized checkpoints, in one run:
pagedkv on each format's checkpoint (from_pretrained_quantized, CUDA graphs), HF eager on the same
checkpoint (from_pretrained with its own quantizer: FineGrainedFP8, compressed-tensors,
bitsandbytes), torchao int4 weight-only (group 128, tinygemm) + torch.compile (gpt-fast's recipe:
pagedkv.tools.baselines.StaticCacheDecoder, its linears swapped for torchao's; LM head kept bf16
like the checkpoints'), and pagedkv bf16; ms per step, % of each row's roofline, the issue's goals.

    python benchmarks/bench_quantized.py [--formats fp8,int4,nf4] [--batches 1,8,32]  (also int8, int4-torchao)
        [--torchao-batches 1,8|none] [--layers 28] [--new 128] [--hf-new 16] [--out DIR] [--small] [--no-hf]

Each checkpoint is written from the bf16 model's random weights in the format's exact on-disk
tensors (benchmarks/quantized_w1.py), to a temp folder deleted after its rows. Per-step time as
bench_generate's: (generate 1 + N tokens - generate 1) / N, N = --new (128) for pagedkv and torchao,
--hf-new for HF (its quantized eager steps are slow). Roofline = bytes a step reads (the packed
weights with their scales/zeros/absmax, the LM head, the batch's embedding rows, the K/V over a
mean context of prompt + N/2) over the copy bandwidth measured in the run. --layers L < 28 cuts
the decoder (writing and loading cost less); the roofline counts the same L layers and the goals
are scaled by its bytes over 28 layers' (same fraction of the roofline); the title says so.
A row that cannot run prints "n/a: <reason>" and the run goes on. --small: a tiny model on the
CPU, pagedkv rows only (the smoke test).
"""

from __future__ import annotations

import argparse
import pathlib
import re
import shutil
import sys
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_generate import W1, PROMPT, describe_agreement, first_differences, per_step_ms, seconds  # noqa: E402
from quantized_w1 import FORMATS, write_checkpoint  # noqa: E402
from report import markdown_table, save_bar_plot, save_table  # noqa: E402
from timing import copy_bandwidth_gbs  # noqa: E402

import pagedkv  # noqa: E402
from pagedkv.models.registry import PREPARED_ATTR  # noqa: E402
from pagedkv.runtime.model import weight_bytes  # noqa: E402
from pagedkv.tools.baselines import StaticCacheDecoder  # noqa: E402

NEW = 128
SMALL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False, max_position_embeddings=1024,
             rms_norm_eps=1e-6)
TORCHAO_LINEARS = re.compile(r"^(wqkv|wo|w_gate_up|w_down)_\d+$")  # StaticCacheDecoder's buffers


def build_model(small: bool, layers: int, device: str) -> torch.nn.Module:
    config = Qwen2Config(**(SMALL if small else {**W1, "num_hidden_layers": layers}))
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32 if small else torch.bfloat16)
    if small:  # the tiny model's init is small: widen it so its greedy tokens vary
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.normal_(0, 0.3 * 16 / p.shape[-1] ** 0.5)
    model.generation_config.eos_token_id = None  # every request produces its full length
    model.generation_config.pad_token_id = 0
    return model.eval()


class Roofline:
    """Bytes a decode step reads: the model's weights less the embedding table (a step reads its
    batch's rows) plus K/V over the mean context; and the same at 28 layers for the goals."""

    def __init__(self, total: int, per_layer: int, layers: int, embed_row: int, kv_per_token_layer: int,
                 copy_gbs: float):
        self.head = total - per_layer * layers  # LM head, final norm, (embedding: taken out below)
        self.per_layer, self.layers, self.embed_row = per_layer, layers, embed_row
        self.kv, self.copy_gbs = kv_per_token_layer, copy_gbs

    def bytes(self, batch: int, new: int, layers: int | None = None) -> float:
        layers = self.layers if layers is None else layers
        context = PROMPT + new / 2
        return self.head + layers * (self.per_layer + batch * context * self.kv) + batch * self.embed_row

    def ms(self, batch: int, new: int) -> float:
        return 1e3 * self.bytes(batch, new) / (self.copy_gbs * 1e9)


def pagedkv_roofline(model, copy_gbs: float) -> Roofline:
    """From the weights pagedkv holds for `model` (bf16 or packed): weight_bytes counts them."""
    w = getattr(model, PREPARED_ATTR).weights
    total = weight_bytes(w)
    embed = w.embed.numel() * w.embed.element_size()
    head = embed + sum(t.numel() * t.element_size() for t in (w.final_norm, w.lm_head) if t is not w.embed)
    layers = len(w.layers)
    kv = 2 * w.num_kv_heads * w.head_dim * w.embed.element_size()
    return Roofline(total - embed, (total - head) // layers, layers, embed // w.embed.shape[0], kv, copy_gbs)


def torchao_decoder(model, batch: int, max_seq: int) -> tuple[StaticCacheDecoder, int]:
    """StaticCacheDecoder (compiled, reduce-overhead) with its fused decoder linears quantized by
    torchao's Int4WeightOnlyConfig (group 128, tile_packed_to_4d: the tinygemm kernel gpt-fast's
    int4 runs); -> (decoder, bytes of its quantized linears)."""
    from torchao.quantization import Int4WeightOnlyConfig, quantize_

    decoder = StaticCacheDecoder(model, batch, max_seq, "reduce-overhead")
    config = Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d")
    quantized_bytes = 0
    for name, w in list(decoder.named_buffers()):
        if not TORCHAO_LINEARS.match(name):
            continue
        linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
        linear.weight = torch.nn.Parameter(w, requires_grad=False)
        quantize_(linear, config)
        decoder.register_buffer(name, linear.weight, persistent=False)  # the fused bf16 copy is freed
        quantized_bytes += sum(t.numel() * t.element_size() for t in (linear.weight.qdata, linear.weight.scale_and_zero))
    return decoder, quantized_bytes


def free(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def reason(error: BaseException) -> str:
    return f"n/a: {type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"


def parse_batches(parser: argparse.ArgumentParser, option: str, text: str) -> list[int]:
    try:
        batches = [int(b) for b in text.split(",") if b.strip()]
    except ValueError:
        batches = []
    if not batches or min(batches) < 1:
        parser.error(f"{option} takes positive batch sizes joined by commas (e.g. 1,8), got {text!r}")
    return batches


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"))
    parser.add_argument("--formats", default="fp8,int4,nf4")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--torchao-batches", default="1,8", help="batches of the torchao rows; none: no torchao row")
    parser.add_argument("--layers", type=int, default=28, help="decoder layers of W1 (28: the real shape)")
    parser.add_argument("--new", type=int, default=NEW, help="new tokens a timed pagedkv / torchao generate makes")
    parser.add_argument("--hf-new", type=int, default=16, help="new tokens a timed HF generate makes")
    parser.add_argument("--no-hf", action="store_true", help="leave HF's quantized rows out")
    parser.add_argument("--hf-budget", type=float, default=240.0,
                        help="seconds a format's HF rows may take, estimated from one warm 2-token generate; over it "
                             "they print n/a (bitsandbytes' LLM.int8 forward on random W1 weights ran past 5 "
                             "minutes on an H200)")
    parser.add_argument("--tmp", default=None, help="where the checkpoints are written (default: the temp dir)")
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    device, small = args.device, args.small or args.device == "cpu"
    formats = [f for f in args.formats.split(",") if f]
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        parser.error(f"--formats: {unknown} unknown; choose from {', '.join(FORMATS)}")
    batches = parse_batches(parser, "--batches", args.batches)
    no_torchao = args.torchao_batches.strip().lower() == "none"
    torchao_batches = [] if no_torchao else parse_batches(parser, "--torchao-batches", args.torchao_batches)
    torchao_batches = [] if small else torchao_batches
    started, phases = time.perf_counter(), {}
    copy_gbs = copy_bandwidth_gbs(device) if device == "cuda" else 10.0  # CPU: a nominal figure
    dtype = torch.float32 if small else torch.bfloat16
    model = build_model(small, args.layers, device)
    layers = model.config.num_hidden_layers
    prompts = {b: torch.randint(3, model.config.vocab_size, (b, PROMPT), device=device,
                                generator=torch.Generator(device).manual_seed(b)) for b in batches}
    ms, roof, notes, tokens = {}, {}, [], {}  # (system, batch) -> ms; system -> Roofline

    def timed(system: str, generate, new: int = args.new) -> None:
        for b in batches:
            ms[system, b] = per_step_ms(generate, prompts[b], device, new)
            print(f"{system}, batch {b}: {ms[system, b]:.3f} ms/step", flush=True)

    def pagedkv_generate(m):
        return lambda ids, n: pagedkv.generate(m, ids, max_new_tokens=n, do_sample=False)

    t = time.perf_counter()
    timed("pagedkv bf16", pagedkv_generate(model))
    roof["pagedkv bf16"] = pagedkv_roofline(model, copy_gbs)
    delattr(model, PREPARED_ATTR)  # its fused copies and cache: room for the next rows
    free(device)
    phases["bf16"] = time.perf_counter() - t

    t, ao = time.perf_counter(), "torchao int4 g128 + torch.compile"
    for b in torchao_batches:
        decoder = None
        try:
            decoder, qbytes = torchao_decoder(model, b, PROMPT + args.new + 1)
            ms[ao, b] = per_step_ms(lambda ids, n: decoder.generate(ids, n), prompts[b], device, args.new)
            if ao not in roof:  # its int4 linears (K padded to 1024s by tinygemm) + the same head and norms
                bf16 = roof["pagedkv bf16"]
                norms = 2 * model.config.hidden_size * 2
                roof[ao] = Roofline(bf16.head + qbytes + layers * norms, qbytes // layers + norms, layers,
                                    bf16.embed_row, bf16.kv, copy_gbs)
            print(f"{ao}, batch {b}: {ms[ao, b]:.3f} ms/step", flush=True)
        except Exception as error:  # a missing wheel, a compile failure: the rest still runs
            notes.append(f"{ao}, batch {b}: {reason(error)}")
            print(notes[-1], flush=True)
        del decoder
        torch.compiler.reset()
        free(device)
    phases["torchao"] = time.perf_counter() - t

    for key in formats:
        fmt, system = FORMATS[key], f"pagedkv {key}"
        folder = pathlib.Path(tempfile.mkdtemp(prefix=f"bench_quantized_{key}_", dir=args.tmp))
        try:
            t = time.perf_counter()
            size = write_checkpoint(model, folder, fmt)
            phases[f"{key} write"] = time.perf_counter() - t
            t = time.perf_counter()
            quantized = pagedkv.from_pretrained_quantized(folder, dtype=dtype, device=device)
            phases[f"{key} pagedkv load"] = time.perf_counter() - t
            print(f"{fmt.label}: wrote {size / 1e9:.2f} GB, pagedkv read it in {phases[f'{key} pagedkv load']:.0f} s",
                  flush=True)
            t = time.perf_counter()
            timed(system, pagedkv_generate(quantized))
            roof[system] = pagedkv_roofline(quantized, copy_gbs)
            b0 = batches[0]
            tokens[key] = pagedkv.generate(quantized, prompts[b0], max_new_tokens=args.hf_new,
                                           do_sample=False)[:, PROMPT:].cpu()
            del quantized
            free(device)
            phases[f"{key} pagedkv"] = time.perf_counter() - t
            if small or args.no_hf:
                notes.append(f"HF {key}: n/a: {'--small: HF quantizers need a GPU' if small else '--no-hf'}")
                continue
            t, hf = time.perf_counter(), None
            try:
                hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map=device).eval()
                hf.generation_config.eos_token_id, hf.generation_config.pad_token_id = None, 0
                hf_gen = lambda ids, n: hf.generate(ids, max_new_tokens=n, do_sample=False)  # noqa: E731
                hf_gen(prompts[b0], 1)  # warm-up: the first call's one-time costs are no estimate
                probe = seconds(lambda: hf_gen(prompts[b0], 2), device, repeats=1)
                # per batch, per_step_ms runs 4 generates of 1 + N tokens and 3 of 1; then one of N
                estimate = probe / 2 * (len(batches) * (4 * (1 + args.hf_new) + 3) + args.hf_new)
                if estimate > args.hf_budget:
                    raise TimeoutError(f"a 2-token generate took {probe:.1f} s, so its rows would take "
                                       f"~{estimate:.0f} s, over --hf-budget {args.hf_budget:.0f} s")
                timed(f"HF {key}", hf_gen, args.hf_new)
                theirs = hf_gen(prompts[b0], args.hf_new)[:, PROMPT:].cpu()
                notes.append(f"{key}, batch {b0}: " + describe_agreement(
                    f"HF {key}", first_differences(theirs, tokens[key]), args.hf_new))
                print(notes[-1], flush=True)
            except Exception as error:  # HF's quantizer cannot load or run it here
                notes.append(f"HF {key}: {reason(error)}")
                print(notes[-1], flush=True)
            del hf
            free(device)
            phases[f"{key} HF"] = time.perf_counter() - t
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    rows = table_rows(ms, roof, batches, formats, ao, args.new, args.hf_new, small)
    header = ["batch", "system", "ms / step", "tokens/s", "roofline ms", "% of roofline", "vs HF (same format)",
              "vs torchao int4", "vs pagedkv bf16", "goal ms", "goal met"]
    shape = "tiny Qwen2 (smoke, CPU)" if small else "W1 (Qwen2.5-7B shape)" if layers == 28 else \
        f"W1 widths, {layers} of 28 layers (roofline over these {layers}; goals scaled by its bytes over 28 layers')"
    title = (f"{shape}, quantized weights, prompt {PROMPT}, {args.new} new tokens (HF: {args.hf_new}), greedy; "
             f"{torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}; copy bandwidth {copy_gbs:.0f} GB/s"
             f"{' (nominal)' if device != 'cuda' else ''}")
    phases["total"] = time.perf_counter() - started
    extra = "\n".join(["", *notes, "", "phases (s): " + ", ".join(f"{k} {v:.0f}" for k, v in phases.items())])
    save_table(args.out, "bench_quantized", title, markdown_table(header, rows) + "\n" + extra)
    systems = ["pagedkv bf16", ao] + [f"{p} {k}" for k in formats for p in ("pagedkv", "HF")]
    plot = {s: [ms.get((s, b), 0.0) for b in batches] for s in systems if any((s, b) in ms for b in batches)}
    save_bar_plot(args.out, "bench_quantized", title.split(";")[0], [f"batch {b}" for b in batches], plot,
                  "ms per decode step")


def table_rows(ms, roof, batches, formats, ao, new, hf_new, small) -> list[list[object]]:
    """One row per system and batch: ratios are the other system's ms over this row's (> 1: faster)."""
    rows = []
    for b in batches:
        for system in ["pagedkv bf16", ao] + [f"{p} {k}" for k in formats for p in ("pagedkv", "HF")]:
            if (system, b) not in ms:
                continue
            t = ms[system, b]
            key = system.split()[-1]
            r = roof.get(system) or roof.get(f"pagedkv {key}")
            roof_ms = r.ms(b, hf_new if system.startswith("HF") else new) if r else float("nan")

            def vs(other: str) -> object:
                return ms[other, b] / t if (other, b) in ms and other != system else ""

            goal, met = "", ""
            if system.startswith("pagedkv ") and key in FORMATS and b in FORMATS[key].goals and not small:
                goal = FORMATS[key].goals[b] * r.bytes(b, new) / r.bytes(b, new, 28)
                met = "pass" if t <= goal else "FAIL"
            rows.append([b, system, t, b * 1e3 / t, roof_ms, f"{100 * roof_ms / t:.0f}%",
                         vs(f"HF {key}") if system.startswith("pagedkv ") and key in FORMATS else "",
                         vs(ao) if system != ao else "", vs("pagedkv bf16"), goal, met])
    return rows


if __name__ == "__main__":
    main()
