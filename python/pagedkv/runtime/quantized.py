"""pagedkv.from_pretrained_quantized: an AWQ, GPTQ or compressed-tensors W4A16 (int4), FP8
(FineGrainedFP8, compressed-tensors) or bitsandbytes NF4 or LLM.int8 checkpoint run by pagedkv, its linears
held in pagedkv's kernel layouts (models/quantized_checkpoint.py), never dequantized; FP8 and
int4 also for mixture-of-experts models (models/quantized_moe.py).

    model = pagedkv.from_pretrained_quantized("Llama-3-8B-AWQ", dtype=torch.float16)
    out = pagedkv.generate(model, input_ids, max_new_tokens=64)   # or pagedkv.patch / pagedkv.LLM

Why a function that returns the HF model rather than HF's from_pretrained + a patch: HF loads
most of these checkpoints only through CUDA packages (autoawq, gptqmodel, bitsandbytes) or
dequantizes them on the CPU (FP8), and would hold its own copy of the weights; here the
checkpoint is read once, by pagedkv, beside an HF skeleton on the meta device (the config,
generation config and names that generate(), patch() and LLM read), the way
tensor_parallel_from_pretrained reads a rank's shard.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
from typing import TYPE_CHECKING

import torch

from pagedkv.layers.rotary import LENGTH_DEPENDENT_ROPE_TYPES, build_cos_sin_cache, rope_type
from pagedkv.models import registry
from pagedkv.models.checkpoint_shards import open_checkpoint
from pagedkv.models.quantized_checkpoint import quant_format, read_quantized
from pagedkv.models.registry import PREPARED_ATTR, UnsupportedModel
from pagedkv.runtime.model import PreparedModel, fingerprint, weight_bytes

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

# Llama-family types whose linears are q/k/v/o, gate/up/down (models/llama.py), one device; and
# the MoE types, whose experts are read as FP8 or int4, or dense where the checkpoint left them
# unquantized (models/quantized_moe.py).
CHECKPOINT_MODEL_TYPES = registry.QUANTIZED_MODEL_TYPES + registry.MOE_MODEL_TYPES


def from_pretrained_quantized(path: str | os.PathLike, dtype: torch.dtype | None = None,
                              device: torch.device | str | None = None) -> PreTrainedModel:
    """The quantized checkpoint in `path` (a local folder: config.json with its
    quantization_config, and model.safetensors or model.safetensors.index.json with its files)
    as an HF model skeleton pagedkv runs: pagedkv.generate(model, ...), pagedkv.patch(model),
    pagedkv.LLM(model). dtype: the activations', embedding's, norms' and LM head's (default:
    the config's dtype, else float16); device: where it runs (default cuda if available, else
    the CPU). HF's own forward and generate cannot run on the skeleton and say so.

    Raises UnsupportedModel naming the quantization_config field (quant/formats.py: quant_method,
    bits, group_size, activation_scheme, config_groups..., bnb_4bit_quant_type, ...) or model type
    pagedkv does not run; ValueError naming a missing or misshapen tensor."""
    device = torch.device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype if dtype is not None else _config_dtype(path)
    if dtype not in registry.SUPPORTED_DTYPES:
        raise ValueError(f"pagedkv.from_pretrained_quantized: dtype {dtype} is not supported; supported: "
                         f"{', '.join(map(str, registry.SUPPORTED_DTYPES))}")
    model, reader = open_checkpoint(path, dtype)
    who = f"pagedkv cannot run {type(model).__name__} from {path}"
    try:
        fmt = quant_format(getattr(model.config, "quantization_config", None))
    except ValueError as error:
        raise UnsupportedModel(f"{who}: {error}") from None
    if model.config.model_type not in CHECKPOINT_MODEL_TYPES:
        raise UnsupportedModel(f"{who}: model_type {model.config.model_type!r} is not supported with a "
                               f"quantized checkpoint; supported: {', '.join(CHECKPOINT_MODEL_TYPES)}")
    if rope_type(model.config) in LENGTH_DEPENDENT_ROPE_TYPES:  # layers/rotary.py RopeByLength: not wired here
        raise UnsupportedModel(f"{who}: rope type {rope_type(model.config)!r} is not supported with a "
                               "quantized checkpoint yet")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    weights = read_quantized(model, reader, fmt, device, dtype)
    max_positions = int(model.config.max_position_embeddings)
    rotary = type(model.model.rotary_emb)(model.config)  # the skeleton's is on meta: a fresh one
    cos_sin = build_cos_sin_cache(model.config, max_positions, device, rotary_emb=rotary)
    logger.info("read the %s checkpoint of %s: %s weights, %s activations on %s, %.1f MB", fmt.name,
                type(model).__name__, fmt.weights, str(dtype).removeprefix("torch."), device,
                weight_bytes(weights) / 1e6)
    setattr(model, PREPARED_ATTR, PreparedModel(weights, cos_sin, device, dtype, max_positions, None,
                                                fingerprint=fingerprint(model, buffer_versions=True), quant=fmt.name))
    model.register_forward_pre_hook(_skeleton_forward)
    return model


def _config_dtype(path: str | os.PathLike) -> torch.dtype:
    """The dtype config.json names (dtype, or torch_dtype before transformers 5), else float16."""
    config = pathlib.Path(path) / "config.json"
    values = json.loads(config.read_text()) if config.is_file() else {}
    name = values.get("dtype") or values.get("torch_dtype") or "float16"
    return getattr(torch, str(name).removeprefix("torch."), torch.float16)


def _skeleton_forward(module, args):
    raise RuntimeError(f"{type(module).__name__}'s HF modules are empty (meta): its quantized weights are "
                       "held by pagedkv (from_pretrained_quantized), so HF's forward and generate cannot run; "
                       "use pagedkv.generate(model, ...), pagedkv.patch(model) (model.generate then runs "
                       "pagedkv) or pagedkv.LLM(model)")
