"""python -m pagedkv: what is installed (versions, build, GPUs) and a quick self-check: a tiny
random Llama generates greedily with pagedkv.generate and pagedkv.LLM, on the CPU and on CUDA
when there is one, and must give HF's own generate's tokens. Prints PASS or FAIL; exit code 0/1.

Paste its output into a bug report."""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
import sys
import time
from typing import Callable

import torch
import transformers

from pagedkv._ext import _C
from pagedkv.engine import LLM, SamplingParams
from pagedkv.hf.generate import generate
from pagedkv.tools.tiny_model import tiny_llama

PROMPT_LEN, NEW_TOKENS, VOCAB = 12, 8, 256


def environment() -> list[str]:
    """Versions, the build and the GPUs, one fact a line."""
    cuda = f" (CUDA {torch.version.cuda})" if torch.version.cuda else " (CPU only)"
    lines = [f"pagedkv {importlib.metadata.version('pagedkv')}", f"torch {torch.__version__}{cuda}",
             f"transformers {transformers.__version__}",
             f"python {platform.python_version()} ({sys.executable})",
             f"build: {_C.build_info}", f"CUDA available: {torch.cuda.is_available()}"]
    for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        props = torch.cuda.get_device_properties(i)
        lines.append(f"GPU {i}: {props.name} (sm_{props.major}{props.minor}, "
                     f"{props.total_memory / 1e9:.0f} GB)")
    return lines


def checks(device: str) -> list[tuple[str, Callable[[], str | None]]]:
    """(name, check) pairs; a check returns None when it passes, else what went wrong."""
    model = tiny_llama(vocab=VOCAB).to(device)
    ids = torch.randint(3, VOCAB, (2, PROMPT_LEN), generator=torch.Generator().manual_seed(0)).to(device)
    greedy = dict(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = model.generate(ids, **greedy)[:, PROMPT_LEN:].tolist()  # HF's own, before pagedkv runs

    def with_generate() -> str | None:
        got = generate(model, ids, **greedy)[:, PROMPT_LEN:].tolist()
        return None if got == expected else f"tokens {got} != HF's {expected}"

    def with_llm() -> str | None:
        llm = LLM(model, num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=64)
        outs = llm.generate(ids.tolist(), SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True),
                            use_tqdm=False)
        got = [out.token_ids for out in outs]
        return None if got == expected else f"tokens {got} != HF's {expected}"

    return [("pagedkv.generate", with_generate), ("pagedkv.LLM", with_llm)]


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(prog="python -m pagedkv", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    for line in environment():
        print(line)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() and _C.with_cuda else [])
    print(f"self-check (a tiny random Llama, {NEW_TOKENS} greedy tokens, against HF's generate):")
    passed = True
    for device in devices:
        try:
            named = checks(device)
        except Exception as error:  # noqa: BLE001 - reported, and the check fails
            named = [("set-up", lambda error=error: f"{type(error).__name__}: {error}")]
        for name, check in named:
            start = time.perf_counter()
            try:
                problem = check()
            except Exception as error:  # noqa: BLE001 - reported, and the check fails
                problem = f"{type(error).__name__}: {error}"
            took = time.perf_counter() - start
            passed &= problem is None
            print(f"  {device:<5} {name:<17} {'ok' if problem is None else 'FAILED: ' + problem} ({took:.2f} s)")
    print("PASS" if passed else "FAIL")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
