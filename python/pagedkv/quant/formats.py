"""A checkpoint's quantization_config checked into the one format pagedkv reads it as, or refused
naming the field, its value and what is allowed.

    {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": true, "version": "gemm"}
    {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": true, "checkpoint_format": "gptq"}
    {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    {"quant_method": "compressed-tensors", "format": "pack-quantized" | "float-quantized",
     "config_groups": {"group_0": {"targets": ["Linear"], "weights": {...}, "input_activations": ...}}}
    {"quant_method": "bitsandbytes", "load_in_4bit": true, "bnb_4bit_quant_type": "nf4",
     "bnb_4bit_use_double_quant": true}
    {"quant_method": "torchao", "quant_type": {"default": {"_type": "Int4WeightOnlyConfig", "_version": 2,
     "_data": {"group_size": 128, "int4_packing_format": "tile_packed_to_4d", ...}}}}

pagedkv computes with the weights only: activations stay in the model's dtype. A
FineGrainedFP8 checkpoint (activation_scheme "dynamic": per-group activation scales at run
time, nothing stored) runs as its dequantized weights, as transformers runs it where it has no
FP8 GPU (it dequantizes); a "static" one is refused. compressed-tensors schemes with
input_activations (W8A8: FP8-dynamic, static) are refused: transformers quantizes their
activations even on the CPU, so pagedkv's tokens would not be its tokens.
"""

from __future__ import annotations

import dataclasses

GPTQ_ZERO_OFFSET = {"gptq": True, "gptq_v2": False}  # checkpoint_format -> zeros stored as zero - 1
CT_INT4_ACTORDER = (None, "weight", "static")  # these keep groups of consecutive columns (no g_idx)
CT_FP8_STRATEGIES = ("channel", "tensor", "block")


@dataclasses.dataclass(frozen=True, slots=True)
class QuantFormat:
    # "awq", "gptq", "fp8", "compressed-tensors w4a16", "compressed-tensors fp8", "bitsandbytes nf4",
    # "bitsandbytes int8", "torchao int4"
    name: str
    weights: str  # the kernel it runs: "int4", "fp8", "nf4" or "int8"
    group_size: int = 0  # int4: input columns a group (-1: all of them)
    zero_offset: bool = False  # GPTQ's historical format: zeros stored as zero - 1
    block: tuple[int, int] | None = None  # fp8 with block scales: (rows, columns) under one scale


def quant_format(quant_config) -> QuantFormat:
    """A config's quantization_config (a dict, or HF's config object) checked: ValueError naming
    the field, its value and what is allowed."""
    if not quant_config:
        raise ValueError("the checkpoint's config.json has no quantization_config; an unquantized "
                         "checkpoint loads with transformers' from_pretrained (then pagedkv.generate)")
    q = quant_config if isinstance(quant_config, dict) else quant_config.to_dict()
    method = str(q.get("quant_method", "")).lower()
    readers = {"awq": _int4, "gptq": _int4, "fp8": _finegrained_fp8, "compressed-tensors": _compressed_tensors,
               "bitsandbytes": _bitsandbytes, "torchao": _torchao}
    if method not in readers:
        raise _refuse(q, "quant_method", "'awq', 'gptq' (int4), 'fp8' (FineGrainedFP8), 'compressed-tensors' "
                      "(W4A16 pack-quantized, FP8 float-quantized), 'bitsandbytes' (NF4, LLM.int8), 'torchao' (int4 "
                      "weight-only, tile_packed_to_4d)")
    return readers[method](q, method)


def _refuse(q: dict, field: str, allowed: str, value: object = None) -> ValueError:
    shown = q.get(field) if value is None else value
    return ValueError(f"quantization_config.{field}={shown!r} is not supported; supported: {allowed}")


def _int4_group(q: dict, field: str, group_size: object) -> int:
    if not isinstance(group_size, int) or not (group_size == -1 or (group_size > 0 and group_size % 32 == 0)):
        raise _refuse(q, field, "-1 or a multiple of 32 (pagedkv's int4 kernel reads groups of 32 columns)",
                      group_size)
    return group_size


def _int4(q: dict, method: str) -> QuantFormat:
    if q.get("bits") != 4:
        raise _refuse(q, "bits", "4")
    group_size = _int4_group(q, "group_size", q.get("group_size"))
    if method == "awq":
        if str(q.get("version", "gemm")).lower() != "gemm":  # GEMV and Marlin pack otherwise
            raise _refuse(q, "version", "'gemm'")
        if q.get("backend") not in (None, "autoawq"):  # llm-awq's checkpoints pack another way
            raise _refuse(q, "backend", "'autoawq'")
        if not q.get("zero_point", True):
            raise _refuse(q, "zero_point", "true")
        return QuantFormat("awq", "int4", group_size)
    checkpoint_format = str(q.get("checkpoint_format", "gptq")).lower()
    if checkpoint_format not in GPTQ_ZERO_OFFSET:
        raise _refuse(q, "checkpoint_format", "'gptq', 'gptq_v2'")
    if q.get("lm_head", False):
        raise _refuse(q, "lm_head", "false (pagedkv runs the LM head in the activations' dtype)")
    return QuantFormat("gptq", "int4", group_size, GPTQ_ZERO_OFFSET[checkpoint_format])


def _block(q: dict, field: str, block: object) -> tuple[int, int]:
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and b > 0 for b in block)):
        raise _refuse(q, field, "two positive sizes [rows, columns], e.g. [128, 128]", block)
    return (block[0], block[1])


def _finegrained_fp8(q: dict, method: str) -> QuantFormat:
    if str(q.get("activation_scheme", "dynamic")).lower() != "dynamic":
        raise _refuse(q, "activation_scheme", "'dynamic' (pagedkv keeps activations unquantized; static "
                      "activation scales would be ignored)")
    if str(q.get("scale_fmt", "float")) not in ("float", "ue8m0"):
        raise _refuse(q, "scale_fmt", "'float', 'ue8m0'")
    if q.get("modules_to_convert"):
        raise _refuse(q, "modules_to_convert", "none (the decoder layers' linears in FP8, the rest dense)")
    block = q.get("weight_block_size")
    return QuantFormat("fp8", "fp8", block=None if block is None else _block(q, "weight_block_size", block))


def _compressed_tensors(q: dict, method: str) -> QuantFormat:
    fmt = q.get("format")
    if fmt not in ("pack-quantized", "float-quantized"):
        raise _refuse(q, "format", "'pack-quantized' (int4 W4A16), 'float-quantized' (FP8)")
    for field in ("sparsity_config", "kv_cache_scheme", "transform_config"):
        if q.get(field):
            raise _refuse(q, field, "none (pagedkv reads quantized weights only)")
    if q.get("quantization_status", "compressed") != "compressed":
        raise _refuse(q, "quantization_status", "'compressed'")
    groups = q.get("config_groups") or {}
    if len(groups) != 1:
        raise _refuse(q, "config_groups", "one group (one scheme for every linear)", sorted(groups))
    (key, group), = groups.items()
    where = f"config_groups.{key}"
    if "Linear" not in (group.get("targets") or []):
        raise _refuse(q, f"{where}.targets", "a list holding 'Linear'", group.get("targets"))
    if group.get("format") not in (None, fmt):
        raise _refuse(q, f"{where}.format", f"{fmt!r} (the checkpoint's format)", group.get("format"))
    if group.get("output_activations"):
        raise _refuse(q, f"{where}.output_activations", "null", group.get("output_activations"))
    w = group.get("weights") or {}

    def need(field: str, allowed: tuple, shown: str) -> None:
        if w.get(field) not in allowed:
            raise _refuse(q, f"{where}.weights.{field}", shown, w.get(field))

    need("symmetric", (True,), "true")
    need("dynamic", (False, None), "false")
    if fmt == "pack-quantized":
        need("num_bits", (4,), "4")
        need("type", ("int",), "'int'")
        need("strategy", ("group", "channel"), "'group', 'channel'")
        need("actorder", CT_INT4_ACTORDER, "null, 'weight', 'static' (no g_idx)")
        if group.get("input_activations"):
            raise _refuse(q, f"{where}.input_activations", "null (W4A16: pagedkv does not quantize activations)",
                          group.get("input_activations"))
        group_size = -1 if w["strategy"] == "channel" else _int4_group(q, f"{where}.weights.group_size",
                                                                       w.get("group_size"))
        return QuantFormat("compressed-tensors w4a16", "int4", group_size)
    need("num_bits", (8,), "8")
    need("type", ("float",), "'float' (e4m3)")
    need("strategy", CT_FP8_STRATEGIES, "'channel', 'tensor', 'block'")
    if group.get("input_activations"):
        raise _refuse(q, f"{where}.input_activations", "null (weight-only FP8, W8A16: pagedkv does not quantize "
                      "activations)", group.get("input_activations"))
    block = _block(q, f"{where}.weights.block_structure", w.get("block_structure")) \
        if w["strategy"] == "block" else None
    return QuantFormat("compressed-tensors fp8", "fp8", block=block)


def _bitsandbytes(q: dict, method: str) -> QuantFormat:
    if q.get("load_in_8bit"):
        if q.get("load_in_4bit"):
            raise _refuse(q, "load_in_4bit", "false with load_in_8bit (one of the two)")
        if q.get("llm_int8_has_fp16_weight"):
            raise _refuse(q, "llm_int8_has_fp16_weight", "false (the weights stored as int8)")
        # llm_int8_threshold sets how bitsandbytes' forward splits the activations (outlier
        # columns in 16 bits, the rest quantized to int8); pagedkv does not quantize activations,
        # so it computes with the weights alone (quant/int8.py), whatever the threshold.
        return QuantFormat("bitsandbytes int8", "int8")
    if not q.get("load_in_4bit"):
        raise _refuse(q, "load_in_4bit", "true (NF4), or load_in_8bit true (LLM.int8)")
    if str(q.get("bnb_4bit_quant_type", "fp4")).lower() != "nf4":
        raise _refuse(q, "bnb_4bit_quant_type", "'nf4'")
    return QuantFormat("bitsandbytes nf4", "nf4")


TORCHAO_INT4_PACKING = "tile_packed_to_4d"  # tinygemm's layout (quant/torchao_int4.py)
TORCHAO_GROUP_SIZES = (32, 64, 128, 256)  # the group sizes tinygemm's kernel takes


def _torchao(q: dict, method: str) -> QuantFormat:
    """transformers' TorchAoConfig: one torchao config for every linear, as torchao serializes it
    (config_to_dict: {"_type", "_version", "_data"}; an enum value as {"_type", "_data": NAME})."""
    quant_type = q.get("quant_type")
    if not isinstance(quant_type, dict) or set(quant_type) != {"default"} or not isinstance(quant_type["default"], dict):
        raise _refuse(q, "quant_type", "{'default': <a serialized torchao config>} (torchao's version-1 "
                      "string configs store pickled tensors pagedkv does not read)")
    config = quant_type["default"]
    data = config.get("_data") or {}
    if config.get("_type") != "Int4WeightOnlyConfig" or config.get("_version") != 2:
        raise _refuse(q, "quant_type", "Int4WeightOnlyConfig version 2",
                      f"{config.get('_type')} version {config.get('_version')}")
    packing = data.get("int4_packing_format")
    if isinstance(packing, dict):  # an enum: {"_type": "Int4PackingFormat", "_data": "TILE_PACKED_TO_4D"}
        packing = packing.get("_data")
    if str(packing).lower() != TORCHAO_INT4_PACKING:
        raise _refuse(q, "quant_type.int4_packing_format", f"'{TORCHAO_INT4_PACKING}' (tinygemm's layout; "
                      "'plain' and 'preshuffled' need mslk/fbgemm kernels to be written)", packing)
    group_size = data.get("group_size")
    if group_size not in TORCHAO_GROUP_SIZES:
        raise _refuse(q, "quant_type.group_size", ", ".join(map(str, TORCHAO_GROUP_SIZES)), group_size)
    if q.get("include_input_output_embeddings"):
        raise _refuse(q, "include_input_output_embeddings", "false (pagedkv runs the embedding and LM head in "
                      "the activations' dtype)")
    return QuantFormat("torchao int4", "int4", group_size)


def torchao_int4_config(group_size: int = 128, packing: str = "tile_packed_to_4d") -> dict:
    """transformers' TorchAoConfig(quant_type=Int4WeightOnlyConfig(group_size, packing, hqq)).to_dict():
    what it writes into config.json (and what a model torchao's quantize_ quantized is read as)."""
    data = {"group_size": group_size, "set_inductor_config": True, "int4_packing_format": packing,
            "int4_choose_qparams_algorithm": "hqq", "int4_tile_packed_ntile": 8}
    return {"quant_method": "torchao", "quant_type": {"default": {"_type": "Int4WeightOnlyConfig", "_version": 2,
                                                                  "_data": data}},
            "modules_to_not_convert": None, "include_input_output_embeddings": False, "untie_embedding_weights": False}
