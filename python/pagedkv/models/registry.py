"""Which HF models pagedkv can run, and why not when it cannot."""

from __future__ import annotations

import sys
from typing import Literal

import torch
from torch import nn

from pagedkv.layers.rotary import LENGTH_DEPENDENT_ROPE_TYPES, rope_type
from pagedkv.models.fallback import fallback_reason
from pagedkv.models.hf_quantized import SUPPORTED as SUPPORTED_QUANTIZED, QuantizedLinears, find_quantized
from pagedkv.models.cohere import COHERE_MODEL_TYPES, cohere_reason
from pagedkv.models.gemma import GEMMA_MODEL_TYPES, gemma_reason
from pagedkv.models.interleaved_rope import INTERLEAVED_ROPE_MODEL_TYPES
from pagedkv.models.module_path import (ATTENTION_LINEARS, MLP_LINEARS, PathEntry, causal_lm_reason,
                                        head_dim_reason, layer_modules_reason, module_name, outer_path,
                                        path_reason, tensor_subclass)
from pagedkv.models.olmo2 import OLMO2_MODEL_TYPES, olmo2_reason
from pagedkv.models.unsupported import UnsupportedModel  # noqa: F401  (re-exported: pagedkv.UnsupportedModel)
from pagedkv.models.windows import layer_windows

# Llama's decoder under other names: the same layers, norms, activation and rotary layout (read
# from each type's HF modeling file). internlm3 and iquestcoder are LlamaForCausalLM with their own
# config; phi3 stores QKV and gate/up fused (FUSED_QKV_GATE_UP); olmoe's q/k norms span all heads
# (the decoder norms the whole q/k rows). Types transformers lacks never occur.
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "ministral", "cwm", "seed_oss",
                         "internlm3", "iquestcoder", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
# Llama's decoder with scalar multipliers (DecoderWeights' embedding/residual/logits fields, the
# attention scale): taken from the HF model on one device (the checkpoint readers, sharded or int4,
# do not read them).
SCALED_MODEL_TYPES = ("granite",)
# Every type with a native decoder (models/llama.py, gemma.py, olmo2.py, cohere.py); Llama's
# decoder also runs INTERLEAVED_ROPE_MODEL_TYPES (q/k rows permuted at load, one device).
NATIVE_MODEL_TYPES = (SUPPORTED_MODEL_TYPES + SCALED_MODEL_TYPES + INTERLEAVED_ROPE_MODEL_TYPES + GEMMA_MODEL_TYPES
                      + OLMO2_MODEL_TYPES + COHERE_MODEL_TYPES)
FUSED_QKV_GATE_UP = ("phi3",)  # self_attn.qkv_proj [q; k; v] and mlp.gate_up_proj [gate; up] as stored
# Types whose MLP may be a mixture of experts (layers/moe.py): one device only (not sharded yet).
MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
# Types whose linears may be quantized (q/k/v/o, gate/up/down: models/quantized_checkpoint.py), one device.
QUANTIZED_MODEL_TYPES = tuple(t for t in SUPPORTED_MODEL_TYPES if t not in MOE_MODEL_TYPES + FUSED_QKV_GATE_UP)
# Llama-like types whose decoder computes something else, by what differs (a new kernel or formula).
OTHER_DECODERS = {
    "hunyuan_v1_dense": "its query/key RMSNorm comes after the rotary embedding (Qwen3's: before)",
    "smollm3": "some layers have no rotary embedding (NoPE layers)",
    "ministral3": "queries are scaled by position (llama_4_scaling_beta)",
    "hyperclovax": "embedding, residual, attention and logits multipliers, and post-norms",
    "exaone4": "its norms come after the attention and MLP outputs",
    "arcee": "its MLP has no gate (up -> ReLU^2 -> down)",
    "jais2": "LayerNorm instead of RMSNorm, ReLU^2 MLP without a gate",
    "apertus": "xIELU activation, MLP without a gate",
    "olmo": "LayerNorm without weights, clip_qkv",
    "youtu": "multi-head latent attention (DeepSeek-V3's)",
}
# Types pagedkv runs by their own HF modules over its cache (models/fallback.py: CUDA graphs where
# the modules allow, no tensor parallelism), each one's greedy tokens checked against HF's by
# tests/test_fallback.py; a type that fails there stays off (GPT-2 passes, but stays the tests'
# example of a refused type for now).
FALLBACK_MODEL_TYPES = ("apertus", "arcee", "codegen", "exaone4",
                        "glm", "gpt_bigcode", "gpt_neox", "gptj", "granitemoe",
                        "hunyuan_v1_dense", "jais2", "nemotron", "olmo",
                        "opt", "persimmon", "phi", "smollm3", "stablelm", "starcoder2",
                        # MoE and window types of transformers 5.x (some absent from older ones)
                        "afmoe", "biogpt", "bitnet", "cohere2", "cohere2_moe", "ernie4_5_moe",
                        "exaone", "exaone_moe", "flex_olmo", "glm4", "glm4_moe", "granitemoeshared",
                        "hunyuan_v1_moe", "mellum", "minimax_m2", "nanochat", "phimoe",
                        "solar_open", "vaultgemma",
                        # attention sinks (s_aux) through the ops' sinks
                        "gpt_oss")
SupportPath = Literal["native", "fallback"]
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Rotary variants whose cos/sin depend only on the position (built once, up front); "dynamic"
# and "longrope" change with the running sequence length, which a precomputed table cannot follow:
# the Llama family's decoder computes them per step (layers/rotary.py RopeByLength), the others refuse.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
SUPPORTED_HEAD_DIMS = (64, 80, 96, 128, 256)  # what the attention kernels are instantiated for
PREPARED_ATTR = "_pagedkv_model"  # the attribute of the HF model that holds its PreparedModel (runtime/model.py)


def compiled_original(model):
    """The module torch.compile wrapped, for a wrapper (torch.compile(model), an OptimizedModule,
    forwards HF's attributes and generate to it), else `model`. pagedkv runs the weights with its
    own kernels and CUDA graphs, never the compiled forward, so a compiled model is its original
    to every entry point (generate, patch, LLM, tensor_parallel, supports)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # imported wherever a wrapper exists
    while eval_frame is not None and isinstance(model, eval_frame.OptimizedModule):
        model = model._orig_mod
    return model


def check_no_dropout(model, who: str, suffix: str = "") -> None:
    """ValueError (from `who`, `suffix` appended) where `model` would drop activations at random: a
    module in training mode with a dropout probability above 0 (an nn.Dropout, or the float
    `attention_dropout` / `dropout` HF's attention modules pass to their kernels while training).
    HF's generate does not call eval(), so there its greedy tokens are random; pagedkv, an
    inference engine, never drops, and says so rather than give other tokens."""
    model = compiled_original(model)
    for module in model.modules():  # a walk like weights_version's (per call, not per step); names on a hit
        if module.training and (p := _dropout_p(module)) > 0:
            name = module_name(model, module)
            raise ValueError(f"{who}: the model is in training mode with dropout at {name or 'the model'} "
                             f"({type(module).__name__}, p={p:g}): HF's generate would drop activations at random "
                             f"(it does not call eval()), pagedkv never does; call model.eval() first{suffix}")


def _dropout_p(module: nn.Module) -> float:
    if isinstance(module, nn.modules.dropout._DropoutNd):
        return module.p
    return next((v for a in ("attention_dropout", "dropout") if isinstance(v := getattr(module, a, None), float)
                 and v > 0), 0.0)


def unsupported_reason(model, placement: bool = True) -> str | None:
    """None if pagedkv can run `model`, else a sentence saying what is not supported.
    placement=False leaves out where the parameters are (a skeleton on the meta device whose
    shards are read from a checkpoint, models/checkpoint_shards.py)."""
    model = compiled_original(model)
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type in FALLBACK_MODEL_TYPES:
        return _fallback_path_reason(model, placement)
    if model_type in GEMMA_MODEL_TYPES:  # models/gemma.py
        return gemma_reason(model, SUPPORTED_HEAD_DIMS) or _placement_reason(model, placement)
    if model_type in OLMO2_MODEL_TYPES:  # models/olmo2.py
        return olmo2_reason(model, SUPPORTED_HEAD_DIMS, SUPPORTED_ROPE_TYPES) or _placement_reason(model, placement)
    if model_type in COHERE_MODEL_TYPES:  # models/cohere.py
        return cohere_reason(model, SUPPORTED_HEAD_DIMS, SUPPORTED_ROPE_TYPES) or _placement_reason(model, placement)
    if model_type not in SUPPORTED_MODEL_TYPES + SCALED_MODEL_TYPES + INTERLEAVED_ROPE_MODEL_TYPES:
        differs = f" ({OTHER_DECODERS[model_type]})" if model_type in OTHER_DECODERS else ""
        return (f"model_type {model_type!r} is not supported{differs}; supported: "
                f"{', '.join(NATIVE_MODEL_TYPES)}; by their own HF modules (slower): "
                f"{', '.join(FALLBACK_MODEL_TYPES)}")
    reason = causal_lm_reason(model)
    if reason is not None:
        return reason
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act={config.hidden_act!r} is not supported; supported: 'silu'"
    if getattr(config, "mlp_bias", False):
        return "mlp_bias=True is not supported"
    if getattr(config, "use_bias", False):  # ERNIE-4.5's: biases on every Linear, the MLP's too
        return "use_bias=True (biases on the MLP's Linears) is not supported; supported: use_bias=False"
    if getattr(config, "clip_qkv", None) is not None:  # OLMoE's: q, k, v clamped
        return f"clip_qkv={config.clip_qkv} is not supported; supported: None"
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        return f"pretraining_tp={config.pretraining_tp} is not supported; supported: 1"
    rope = rope_type(config)
    if rope not in SUPPORTED_ROPE_TYPES + LENGTH_DEPENDENT_ROPE_TYPES:  # the latter: models/llama.py's rope
        return (f"rope type {rope!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_ROPE_TYPES + LENGTH_DEPENDENT_ROPE_TYPES)}")
    reason = head_dim_reason(config, SUPPORTED_HEAD_DIMS)
    if reason is not None:
        return reason
    quantized = find_quantized(model, QUANTIZED_MODEL_TYPES)  # loaded quantized (models/hf_quantized.py)
    if isinstance(quantized, str):
        return quantized
    reason = _module_reason(model, quantized) or layer_modules_reason(model, "silu")
    if reason is not None:
        return reason
    # Sliding layers run with their window (models/windows.py says whose), CPU and CUDA alike.
    layer_types = set(getattr(config, "layer_types", None) or [])
    allowed = {"full_attention", "sliding_attention"} if any(layer_windows(config)) else {"full_attention"}
    if layer_types - allowed:
        return f"layer_types {sorted(layer_types)} are not supported; supported: {', '.join(sorted(allowed))}"
    return _placement_reason(model, placement, set() if quantized is None else quantized.tensor_ids())


def _fallback_path_reason(model, placement: bool) -> str | None:
    """unsupported_reason of a FALLBACK_MODEL_TYPES model: what its attention asks for, the
    kernels' head sizes, its dtype and placement."""
    reason = fallback_reason(model)
    if reason is not None:
        return (f"model_type {model.config.model_type!r} runs by its own modules only with causal "
                f"self-attention that pagedkv's kernels compute exactly; this one has {reason}")
    config = model.config
    reason = head_dim_reason(config, SUPPORTED_HEAD_DIMS)
    if reason is not None:
        return reason
    return _placement_reason(model, placement, subclasses=True)  # HF's modules compute with them


def _placement_reason(model, placement: bool, quantized: set[int] = frozenset(),
                      subclasses: bool = False) -> str | None:
    """Its parameters' dtype (one, floating; `quantized`: ids of packed ones, read as such), their
    kind (plain tensors, unless `subclasses`) and, with placement, their one device."""
    params = list(model.parameters())
    for name, p in ([] if subclasses else model.named_parameters()):
        if id(p) not in quantized and tensor_subclass(p):
            kind = type(p)
            return (f"parameter {name} is a {kind.__name__} from {kind.__module__} (a tensor subclass, e.g. "
                    "torchao's quantize_): pagedkv's own forward reads plain tensors; supported quantized: "
                    f"a model transformers loaded with {SUPPORTED_QUANTIZED}, or a checkpoint through "
                    "pagedkv.from_pretrained_quantized")
    dtypes = {p.dtype for p in params if id(p) not in quantized}
    if len(dtypes) != 1 or next(iter(dtypes)) not in SUPPORTED_DTYPES:
        return (f"parameter dtypes {sorted(map(str, dtypes))} are not supported; supported: one of "
                f"{', '.join(map(str, SUPPORTED_DTYPES))} for all parameters (a model loaded quantized runs with "
                f"the linears of models/hf_quantized.py, types {', '.join(QUANTIZED_MODEL_TYPES)}; quantized "
                "checkpoints (AWQ, GPTQ, compressed-tensors, FP8, bitsandbytes NF4 and LLM.int8) load with "
                "pagedkv.from_pretrained_quantized)")
    if not placement:
        return None
    devices = {p.device for p in params}
    if len(devices) != 1:
        return f"the model is spread over {sorted(map(str, devices))}; pagedkv needs it on one device"
    device = next(iter(devices))
    if device.type == "meta":
        # Runs only as the skeleton of a tensor-parallel shard or a quantized checkpoint pagedkv read.
        state = getattr(model, PREPARED_ATTR, None)
        if getattr(state, "quant", None) is None and getattr(state, "tp", None) is None:
            return ("the model is on the meta device: it holds no weights (load them, or read a "
                    "checkpoint's shards with pagedkv.tensor_parallel_from_pretrained)")
    elif device.type not in ("cpu", "cuda"):
        return f"device {device} is not supported; supported: cpu, cuda"
    return None


# The modules of each decoder layer that pagedkv takes weights from, by parent; nn.Linear exactly.
_LAYER_LINEARS = {"self_attn": ATTENTION_LINEARS, "mlp": MLP_LINEARS}
_FUSED_LINEARS = {"self_attn": ("qkv_proj", "o_proj"), "mlp": ("gate_up_proj", "down_proj")}


def _module_reason(model, quantized: QuantizedLinears | None = None) -> str | None:
    """A module of another type on the decoder's path is refused (models/module_path.py), but
    for the quantized linears pagedkv reads (models/hf_quantized.py)."""
    readable = set() if quantized is None else {id(m) for m in quantized.modules.values()}
    linears_of = _FUSED_LINEARS if model.config.model_type in FUSED_QKV_GATE_UP else _LAYER_LINEARS
    path = outer_path(model)
    for i, layer in enumerate(model.model._modules["layers"]):
        at, subs = f"model.layers.{i}", layer._modules
        path.append((at, layer, None))
        path += [(f"{at}.{n}", subs.get(n), None) for n in ("input_layernorm", "post_attention_layernorm")]
        for parent, names in linears_of.items():
            block = subs.get(parent)
            path.append((f"{at}.{parent}", block, None))
            linears = {} if block is None else block._modules
            if "experts" in linears:  # a mixture-of-experts MLP (layers/moe.py)
                path += _moe_path(f"{at}.{parent}", linears)
                continue
            path += [(f"{at}.{parent}.{n}", m, type(m) if id(m) in readable else nn.Linear)
                     for n in names for m in [linears.get(n)]]
    return path_reason(path, model.config.model_type)


def _moe_path(at: str, subs: dict) -> list[PathEntry]:
    """_module_reason's path through a MoE MLP: its router and experts (transformers modules whose
    parameters pagedkv reads), and a shared expert's Linears and gate (Qwen2-MoE)."""
    path = [(f"{at}.{n}", subs.get(n), None) for n in ("gate", "experts")]
    if "shared_expert" in subs or "shared_expert_gate" in subs:
        shared = subs.get("shared_expert")
        path += [(f"{at}.shared_expert", shared, None), (f"{at}.shared_expert_gate", subs.get("shared_expert_gate"), nn.Linear)]
        linears = {} if shared is None else shared._modules
        path += [(f"{at}.shared_expert.{n}", linears.get(n), nn.Linear) for n in _LAYER_LINEARS["mlp"]]
    return path


def supports(model) -> bool:
    """True if pagedkv can run this model (natively or by its own modules: `support_path`);
    `unsupported_reason(model)` says why not."""
    return unsupported_reason(model) is None


def support_path(model) -> SupportPath | None:
    """How pagedkv runs `model`: "native" (its own fused forward, models/llama.py, CUDA graphs
    and tensor parallelism), "fallback" (the HF model's own modules over the paged cache,
    models/fallback.py: one device), or None (it cannot: `unsupported_reason`)."""
    if unsupported_reason(model) is not None:
        return None
    return "fallback" if model.config.model_type in FALLBACK_MODEL_TYPES else "native"


def check_supported(model, placement: bool = True) -> None:
    reason = unsupported_reason(model, placement)
    if reason is not None:
        raise UnsupportedModel(f"pagedkv cannot run {type(model).__name__}: {reason}")

