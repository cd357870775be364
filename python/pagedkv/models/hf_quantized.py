"""HF models that transformers loaded quantized, run by pagedkv from the quantized modules' own
packed tensors, never dequantized:

    bitsandbytes       Linear4bit / LinearNF4 with quant_type nf4 (double quantization or not);
                       Linear8bitLt (LLM.int8, load_in_8bit: weight int8, SCB; weights only)
    compressed-tensors nn.Linear with a quantization_scheme: W4A16 pack-quantized (weight_packed,
                       weight_scale, weight_shape) and weight-only FP8 float-quantized (weight,
                       weight_scale); a layer transformers' forward already decompressed: its weight
    transformers       FP8Linear (FineGrainedFP8: weight, weight_scale_inv; dynamic activations)
    torchao            nn.Linear whose weight is an Int4TilePackedTo4dTensor (Int4WeightOnlyConfig,
                       tile_packed_to_4d): its qdata and scale_and_zero, as its checkpoint stores them

A quantized module's state dict holds the names its checkpoint stores, so the model's tensors are
read as a checkpoint (models/quantized_checkpoint.py read_quantized, its converters and kernel
layouts) beside an HF skeleton on meta (the logical shapes): the same LinearWeight objects
from_pretrained_quantized builds. The embedding, norms, biases and LM head are the model's own
tensors (in-place writes to them are seen, as for any model). The format is the config's
quantization_config, checked by quant/formats.py.

The packed tensors are repacked copies, so in-place writes to them are not seen through views:
quantized_state() adds each quantized module's tensors (bitsandbytes' quant_state too) with their
version counters to the model's fingerprint (runtime/model.py), which takes the weights again
after a write. Writes through ``.data`` bypass version counters and are not seen.

Anything else quantized (fp4, Linear8bitLt keeping fp16 weights, other quantizers, a quantized LM
head or embedding, MoE or Phi-3 layers) is refused naming the module and class.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re

import torch
from torch import nn

from pagedkv.models.llama import DecoderWeights
from pagedkv.models.module_path import _quantized, tensor_subclass
from pagedkv.models.quantized_checkpoint import read_quantized
from pagedkv.quant.formats import QuantFormat, quant_format, torchao_int4_config

SUPPORTED = ("bitsandbytes Linear4bit with quant_type 'nf4' or Linear8bitLt (LLM.int8), compressed-tensors "
             "W4A16 (pack-quantized) or weight-only FP8 (float-quantized) linears, transformers' FP8Linear "
             "(FineGrainedFP8, dynamic activations), torchao Int4WeightOnlyConfig (tile_packed_to_4d), in the "
             "decoder layers' q/k/v/o and gate/up/down projections")
TORCHAO_INT4_CLASS = "Int4TilePackedTo4dTensor"
# The decoder linears a quantized module may hold (models/llama.py's layout, one per projection).
_LINEAR_NAME = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)")
_BNB_NF4_CLASSES = ("Linear4bit", "LinearNF4")


@dataclasses.dataclass(frozen=True, slots=True)
class QuantizedLinears:
    """What find_quantized found: the format and the modules holding decoder linears quantized."""

    fmt: QuantFormat
    modules: dict[str, nn.Module]  # dotted name -> module

    def tensor_ids(self) -> set[int]:
        """ids of the modules' own parameters (left out of registry.py's one-dtype check)."""
        return {id(p) for m in self.modules.values() for p in m.parameters(recurse=False)}


def find_quantized(model, quantized_types: tuple[str, ...]) -> QuantizedLinears | str | None:
    """None if `model` was not loaded quantized (no quantization_config, or no module holds
    quantized tensors: e.g. transformers dequantized FP8 on a machine without a GPU); a
    QuantizedLinears pagedkv reads; else a sentence saying which module is refused and why.
    quantized_types: the model types whose decoder reads quantized linears (registry.py)."""
    config = getattr(model.config, "quantization_config", None) or _torchao_int4_config(model)
    if not config:
        return None
    found = {name: m for name, m in model.named_modules() if _is_quantized(m)}
    if not found:
        return None
    first, module = next(iter(found.items()))
    what = f"{first} is a {type(module).__name__} from {type(module).__module__} (the model was loaded quantized)"
    try:
        q = _plain(config if isinstance(config, dict) else config.to_dict())
        if q.get("quantization_status") == "decompressed":  # by HF's forward: layers read one by one
            q["quantization_status"] = "compressed"
        fmt = quant_format(q)
    except ValueError as error:
        return f"{what}: {error}; pagedkv runs models loaded quantized with {SUPPORTED}"
    if model.config.model_type not in quantized_types:
        return (f"{what}: model_type {model.config.model_type!r} is not supported loaded quantized; "
                f"supported: {', '.join(quantized_types)}")
    for name, m in found.items():
        reason = _module_reason(name, m, fmt)
        if reason is not None:
            return (f"{name} is a {type(m).__name__} from {type(m).__module__} ({reason}); pagedkv runs models "
                    f"loaded quantized with {SUPPORTED}")
    return QuantizedLinears(fmt, found)


def read_hf_quantized(model, found: QuantizedLinears) -> DecoderWeights:
    """The weights of `model` (loaded quantized, as find_quantized found it) on its device in its
    embedding's dtype: the quantized linears repacked into pagedkv's kernel layouts, the rest the
    model's own tensors. Raises ValueError naming a tensor that does not fit."""
    embed = model.model.embed_tokens.weight
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # the logical shapes of the packed weights (no storage)
        skeleton = AutoModelForCausalLM.from_config(model.config, dtype=embed.dtype)
    tied = model.lm_head.weight is embed
    if tied != (skeleton.lm_head.weight is skeleton.model.embed_tokens.weight):
        raise ValueError(f"pagedkv: the model's LM head is {'' if tied else 'not '}tied to its embedding, "
                         f"unlike its config (tie_word_embeddings={model.config.tie_word_embeddings})")
    return read_quantized(skeleton, _ModelTensors(model, found), found.fmt, embed.device, embed.dtype)


def quantized_state(model, quantized_types: tuple[str, ...]) -> tuple:
    """Fingerprint entries (runtime/model.py's form) of the quantized modules' tensors with their
    version counters, and bitsandbytes' quant_state objects and tensors (not parameters)."""
    found = find_quantized(model, quantized_types)
    if not isinstance(found, QuantizedLinears):
        return ()
    items: list[tuple[str, tuple]] = []
    for name, m in found.modules.items():
        tensors = dict(m._parameters) | dict(m._buffers)
        if _torchao_weight(m) is not None:  # a wrapper of no storage: its inner tensors
            tensors = {f"weight.{k}": getattr(m.weight, k) for k in m.weight.tensor_data_names} | \
                {k: t for k, t in tensors.items() if k != "weight"}
        row_absmax = int8_row_absmax(m)  # LLM.int8's: not a parameter
        if isinstance(row_absmax, torch.Tensor):
            tensors["weight.SCB"] = row_absmax
        state = getattr(m._parameters.get("weight"), "quant_state", None)
        if state is not None:
            items.append((f"{name}.weight.quant_state (packed)", ("module", type(state), id(state))))
            nested = getattr(state, "state2", None)
            tensors |= {f"weight.quant_state.{k}": v for k, v in vars(state).items()}
            tensors |= {f"weight.quant_state.state2.{k}": v for k, v in (vars(nested) if nested else {}).items()}
        for attr, t in tensors.items():
            if isinstance(t, torch.Tensor):
                items.append((f"{name}.{attr} (packed)", ("tensor", id(t), t.data_ptr(), t.dtype, t.device, t.shape,
                                                          0 if t.is_inference() else t._version)))
    return tuple(items)


def _is_quantized(m: nn.Module) -> bool:
    """A module that holds (or held: compressed-tensors decompressed) a quantized weight, or a
    weight of a tensor subclass (torchao's)."""
    kind = type(m)
    return (kind.__module__.startswith("bitsandbytes") or kind.__name__ == "FP8Linear"
            or getattr(m, "quantization_scheme", None) is not None or _quantized(m)
            or any(tensor_subclass(p) for p in m.parameters(recurse=False)))


def _torchao_int4_config(model) -> dict | None:
    """The quantization_config torchao's quantize_ leaves unwritten (it quantizes without
    transformers), from the first decoder linear holding a tinygemm int4 weight; None if none does.
    Other layers' group sizes are checked against it (_module_reason)."""
    for name, m in model.named_modules():
        weight = _torchao_weight(m)
        if weight is not None and _LINEAR_NAME.fullmatch(name):
            return torchao_int4_config(int(weight.block_size[-1]))
    return None


def _torchao_weight(m: nn.Module) -> torch.Tensor | None:
    """m's weight if it is torchao's tinygemm int4 tensor, else None."""
    weight = m._parameters.get("weight")
    return weight if type(weight).__name__ == TORCHAO_INT4_CLASS else None


def _module_reason(name: str, m: nn.Module, fmt: QuantFormat) -> str | None:
    """Why pagedkv cannot read module `name` as a linear of format `fmt`, or None."""
    if not _LINEAR_NAME.fullmatch(name):
        return "pagedkv reads quantized decoder-layer linears only; this module is not one"
    kind = type(m)
    if fmt.name == "bitsandbytes nf4":
        state = getattr(m._parameters.get("weight"), "quant_state", None)
        if kind.__name__ not in _BNB_NF4_CLASSES:
            return f"a {kind.__name__} in a bitsandbytes NF4 model"
        if state is None or getattr(state, "quant_type", None) != "nf4":
            return f"quant_type {getattr(state, 'quant_type', None)!r} (not quantized yet, or not NF4)"
        return None
    if fmt.name == "bitsandbytes int8":
        weight = m._parameters.get("weight")
        if kind.__name__ != "Linear8bitLt" or weight is None or weight.dtype != torch.int8:
            return "LLM.int8 layers must be bitsandbytes' Linear8bitLt with int8 weights (load_in_8bit)"
        if int8_row_absmax(m) is None:
            return "it holds no SCB (row absmaxes), on its weight or its state: not quantized yet"
        return None
    if fmt.name == "fp8":
        weight = m._parameters.get("weight")
        if kind.__name__ != "FP8Linear" or weight is None or weight.dtype != torch.float8_e4m3fn:
            return "FineGrainedFP8 layers must be transformers' FP8Linear with float8_e4m3fn weights"
        if getattr(m, "activation_scheme", "dynamic") != "dynamic":
            return f"activation_scheme {m.activation_scheme!r}; supported: 'dynamic'"
        return None
    if fmt.name == "torchao int4":
        weight = _torchao_weight(m)
        if kind is not nn.Linear or weight is None:
            kind_of = type(m._parameters.get("weight")).__name__
            return f"torchao int4 layers must be torch.nn.Linear with an {TORCHAO_INT4_CLASS} weight, not {kind_of}"
        if list(weight.block_size) != [1, fmt.group_size]:
            return f"block_size {list(weight.block_size)}; the config's group_size makes it [1, {fmt.group_size}]"
        if getattr(weight, "act_pre_scale", None) is not None:
            return "act_pre_scale is set (activation pre-scaling); supported: torchao int4 layers without it"
        return None
    if fmt.name.startswith("compressed-tensors"):
        if kind is not nn.Linear or getattr(m, "quantization_scheme", None) is None:
            return "compressed-tensors layers must be torch.nn.Linear with a quantization_scheme"
        return None
    return f"quant_method of format {fmt.name!r} is read from checkpoints only (pagedkv.from_pretrained_quantized)"


def _plain(value):
    """A quantization config's to_dict() with enums as their values (QuantizationMethod.FP8 -> 'fp8')."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value.value if isinstance(value, enum.Enum) else value


def int8_row_absmax(m: nn.Module) -> torch.Tensor | None:
    """A Linear8bitLt's SCB: on its weight after quantization (.cuda(), or loading), on its state
    once a forward ran (bitsandbytes' init_8bit_state moves it there and clears the weight's;
    the module's state dict reads either, as here)."""
    row_absmax = getattr(m._parameters.get("weight"), "SCB", None)
    if row_absmax is None:
        row_absmax = getattr(getattr(m, "state", None), "SCB", None)
    return row_absmax if isinstance(row_absmax, torch.Tensor) else None


class _ModelTensors:
    """read_quantized's reader (checkpoint_shards.SafetensorsReader's files/shape/read/where)
    over the model's own tensors: each module's parameters by name; a quantized module's state
    dict instead (its checkpoint names), or only its weight and bias once compressed-tensors
    decompressed it (then dense)."""

    def __init__(self, model, found: QuantizedLinears):
        self.files: dict[str, torch.Tensor] = {}
        for name, m in model.named_modules():
            if name not in found.modules:
                self.files |= {f"{name}.{k}": p.detach() for k, p in m._parameters.items() if p is not None}
                continue
            weight = m._parameters.get("weight")
            if _torchao_weight(m) is not None:  # its checkpoint's names (quant/torchao_int4.py)
                self.files |= {f"{name}._weight_qdata": weight.qdata, f"{name}._weight_scale_and_zero":
                               weight.scale_and_zero}
                if m._parameters.get("bias") is not None:
                    self.files[f"{name}.bias"] = m.bias.detach()
            elif weight is not None and weight.is_floating_point() and weight.element_size() > 1 \
                    and getattr(weight, "quant_state", None) is None:  # decompressed: dense
                self.files |= {f"{name}.{k}": p.detach() for k in ("weight", "bias")
                               if (p := m._parameters.get(k)) is not None}
            elif getattr(weight, "quant_state", None) is not None:  # bitsandbytes
                self.files |= {f"{name}.{k}": t for k, t in _bnb_state(m).items()}
            else:
                self.files |= {f"{name}.{k}": _half_scale(t) if k == "weight_scale" and "weight_packed" in m._parameters
                               else t for k, t in m.state_dict().items()}

    def where(self, name: str) -> str:
        return "the model loaded quantized"

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.files:
            raise ValueError(f"pagedkv: the model loaded quantized has no tensor {name!r}")
        return tuple(self.files[name].shape)

    def read(self, name: str) -> torch.Tensor:
        return self.files[name]


def _half_scale(scale: torch.Tensor) -> torch.Tensor:
    """A W4A16 weight_scale upcast to fp32 by a float32 load, back in the half dtype it fits exactly
    (the int4 kernel's scales are fp16/bf16); else as it is (the converter names it)."""
    for dtype in (torch.float16, torch.bfloat16):
        if scale.dtype == torch.float32 and torch.equal(scale.to(dtype).float(), scale):
            return scale.to(dtype)
    return scale


def _bnb_state(m: nn.Module) -> dict[str, torch.Tensor]:
    """A Linear4bit's state dict as its checkpoint stores it, without its _save_to_state_dict:
    on a CPU with AVX512-BF16, bitsandbytes' forward repacked the layer for its CPU kernel
    (quant_state.packing_format_for_cpu: codes in [32-row, 2-column] tiles, absmax bf16
    [in / blocksize, out]) and its state dict would repack it back in place, lossily: here the
    layout it computes with is read (codes reordered, absmax as the fp32 it multiplies by)."""
    weight, state = m.weight, m.weight.quant_state
    bias = {"bias": m.bias.detach()} if m.bias is not None else {}
    if not getattr(state, "packing_format_for_cpu", False):
        return {"weight": weight.detach()} | {f"weight.{k}": v for k, v in state.as_dict(packed=True).items()} | bias
    out_features, in_features = (int(d) for d in state.shape)
    tiles = weight.detach().view(torch.uint8).reshape(-1, 32)  # 32 low nibbles, then 32 high ones
    codes = torch.cat([tiles & 0xF, tiles >> 4], dim=-1).reshape(out_features // 32, in_features // 2, 32, 2)
    codes = codes.transpose(1, 2).reshape(out_features, in_features)  # [out, in], 0..15
    meta = {"quant_type": "nf4", "blocksize": state.blocksize, "dtype": "float32", "shape": [out_features, in_features]}
    found = {"weight": ((codes[:, 0::2] << 4) | codes[:, 1::2]).reshape(-1, 1),
             "weight.absmax": state.absmax.T.float().reshape(-1), "weight.quant_map": state.code,
             "weight.quant_state.bitsandbytes__nf4": torch.tensor(list(json.dumps(meta).encode()), dtype=torch.uint8)}
    return found | bias
