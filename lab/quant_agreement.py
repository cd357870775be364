"""Whose greedy tokens part from whose on a quantized W1-shaped checkpoint, and whether each parting
comes at a near tie: pagedkv, HF's own quantized forward (bitsandbytes / compressed-tensors), and
HF eager on the weights the format's own package dequantizes (the reference both should follow).

    python lab/quant_agreement.py [--format nf4|int4|int8] [--layers 4] [--new 16] [--batch 4]

int8 (LLM.int8): HF's forward quantizes the activations too (outlier columns above the threshold
6.0 kept in fp16), pagedkv's does not, so their partings need not be near ties; the dequantized
reference says which one follows the weights.

Why: bench_quantized.py found HF's NF4 rows parting from pagedkv's at step 0 of 16 (int4: 15 of 16
equal, then 6 of 16 once the int4 kernel's split-k order changed in session 31). This says whether pagedkv follows the dequantized weights (then HF's bitsandbytes forward is
the one off, as tests/test_quantized_loaders.py saw on the CPU with double quantization) or not.
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import sys
import tempfile

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_generate import PROMPT  # noqa: E402
from bench_quantized import build_model  # noqa: E402
from quantized_w1 import FORMATS, LINEARS, write_checkpoint  # noqa: E402

import pagedkv  # noqa: E402
from pagedkv.models.hf_quantized import int8_row_absmax  # noqa: E402
from pagedkv.quant import Int8Weight, dequantize, dequantize_int8, from_compressed_tensors_int4  # noqa: E402


def dequantized_weight(module, stored: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """The bf16 weight of a quantized HF linear: bitsandbytes' own dequantization for NF4; for
    LLM.int8, int8 * SCB / 127 (bitsandbytes' int8_vectorwise_dequant, pagedkv.quant's form); for
    compressed-tensors int4, (stored - 8) * scale rounded once to bf16, as the format defines it,
    from the checkpoint's tensors (`stored`, keys `name` + ".weight_packed" ...)."""
    if type(module).__name__ == "Linear4bit":
        import bitsandbytes.functional as bnb
        return bnb.dequantize_4bit(module.weight.data, module.weight.quant_state).to(torch.bfloat16)
    if type(module).__name__ == "Linear8bitLt":
        # SCB where bitsandbytes keeps it: HF's forward ran above, which moved it to the state
        layer = Int8Weight(q=module.weight.data, scb=int8_row_absmax(module).float())
        return dequantize_int8(layer).to(torch.bfloat16)
    if name + ".weight_packed" in stored:
        w = from_compressed_tensors_int4(stored[name + ".weight_packed"], stored[name + ".weight_scale"],
                                         stored[name + ".weight_shape"], 128)
        return dequantize(w, torch.bfloat16).cuda()
    raise SystemExit(f"no dequantizer here for {type(module).__name__}")


def first_parting(a: torch.Tensor, b: torch.Tensor, logits: list[torch.Tensor] | None) -> list[str]:
    """Per row: the first step where a and b differ, with the top-2 gap of `logits` there."""
    out = []
    for row in range(a.shape[0]):
        diff = (a[row] != b[row]).nonzero()
        if len(diff) == 0:
            out.append(f"row {row}: equal for {a.shape[1]} steps")
            continue
        step = int(diff[0])
        gap = ""
        if logits is not None:
            top = logits[step][row].float().topk(2).values
            gap = f", top-2 gap there {float(top[0] - top[1]):.4f} of {float(top[0]):.2f}"
        out.append(f"row {row}: first differs at step {step}{gap}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--format", choices=("nf4", "int4", "int8"), default="nf4")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()

    model = build_model(False, args.layers, "cuda")
    ids = torch.randint(0, model.config.vocab_size, (args.batch, PROMPT), generator=torch.Generator().manual_seed(1)).cuda()
    folder = pathlib.Path(tempfile.mkdtemp(prefix="quant_agreement_"))
    try:
        write_checkpoint(model, folder, FORMATS[args.format])
        ours = pagedkv.generate(pagedkv.from_pretrained_quantized(folder, dtype=torch.bfloat16, device="cuda"),
                                ids, max_new_tokens=args.new, do_sample=False)[:, PROMPT:].cpu()
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map="cuda").eval()
        hf.generation_config.eos_token_id, hf.generation_config.pad_token_id = None, 0
        out = hf.generate(ids, max_new_tokens=args.new, do_sample=False, output_logits=True, return_dict_in_generate=True)
        theirs, their_logits = out.sequences[:, PROMPT:].cpu(), [t.cpu() for t in out.logits]
        stored = {k: v for f in folder.glob("*.safetensors") for k, v in load_file(f).items()}
        with torch.no_grad():  # the bf16 model with the format's dequantized weights
            for i, (theirs_layer, our_layer) in enumerate(zip(hf.model.layers, model.model.layers)):
                for part in ("self_attn", "mlp"):
                    for linear in LINEARS:
                        if hasattr(getattr(theirs_layer, part), linear):
                            getattr(getattr(our_layer, part), linear).weight.copy_(dequantized_weight(
                                getattr(getattr(theirs_layer, part), linear), stored,
                                f"model.layers.{i}.{part}.{linear}"))
        del hf
        model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
        out = model.generate(ids, max_new_tokens=args.new, do_sample=False, output_logits=True, return_dict_in_generate=True)
        ref, ref_logits = out.sequences[:, PROMPT:].cpu(), [t.cpu() for t in out.logits]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"{args.format}, W1 shape cut to {args.layers} layers, batch {args.batch}, {args.new} new tokens")
    for title, a, b, logits in (("pagedkv vs the dequantized reference", ours, ref, ref_logits),
                                (f"HF's {args.format} forward vs the dequantized reference", theirs, ref, ref_logits),
                                (f"pagedkv vs HF's {args.format} forward", ours, theirs, their_logits)):
        print(f"- {title}:")
        for line in first_parting(a, b, logits):
            print(f"  - {line}")


if __name__ == "__main__":
    main()
