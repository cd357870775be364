"""The modules a native decoder takes its weights from, checked before it runs.

pagedkv runs its own forward from the weights of the modules on a decoder's path: a module of
another type there (an adapter wrapper such as PEFT's LoRA layers, a quantized or custom Linear)
would be silently left out, so it is refused by name. Reads `_modules` directly: this runs on
every generate() call, and nn.Module.__getattr__ is slow.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

# (dotted name, the module there or None, the exact class it must be or None: a transformers module)
PathEntry = tuple[str, "nn.Module | None", "type | None"]
ATTENTION_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")


def causal_lm_reason(model) -> str | None:
    """None if `model` has a decoder and an LM head where a native decoder reads them."""
    if not hasattr(model, "model") or not hasattr(model, "lm_head"):
        return f"{type(model).__name__} is not a *ForCausalLM model (expected .model and .lm_head)"
    return None


def head_dim_reason(config, head_dims: tuple[int, ...]) -> str | None:
    """None if the config's head_dim is one the attention kernels are instantiated for."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim not in head_dims:
        return f"head_dim {head_dim} is not supported; supported: {', '.join(map(str, head_dims))}"
    return None


def outer_path(model, embedding: type | None = nn.Embedding) -> list[PathEntry]:
    """The embedding (of class `embedding`; None: any transformers module, e.g. Gemma's scaled
    one), the LM head and the final norm of an HF *ForCausalLM."""
    inner = model.model
    return [("model.embed_tokens", inner._modules.get("embed_tokens"), embedding),
            ("lm_head", model._modules.get("lm_head"), nn.Linear), ("model.norm", inner._modules.get("norm"), None)]


def layer_path(model, norms: tuple[str, ...], attention_modules: tuple[str, ...] = (),
               embedding: type | None = nn.Embedding) -> list[PathEntry]:
    """outer_path and each decoder layer's: the layer, its self_attn and mlp, the norms named,
    q/k/v/o and gate/up/down Linears, and self_attn's `attention_modules` (e.g. q_norm, k_norm)."""
    path = outer_path(model, embedding)
    for i, layer in enumerate(model.model._modules["layers"]):
        at, subs = f"model.layers.{i}", layer._modules
        attn, mlp = subs.get("self_attn"), subs.get("mlp")
        path += [(at, layer, None), (f"{at}.self_attn", attn, None), (f"{at}.mlp", mlp, None)]
        path += [(f"{at}.{n}", subs.get(n), None) for n in norms]
        attn_mods = {} if attn is None else attn._modules
        mlp_mods = {} if mlp is None else mlp._modules
        path += [(f"{at}.self_attn.{n}", attn_mods.get(n), nn.Linear) for n in ATTENTION_LINEARS]
        path += [(f"{at}.self_attn.{n}", attn_mods.get(n), None) for n in attention_modules]
        path += [(f"{at}.mlp.{n}", mlp_mods.get(n), nn.Linear) for n in MLP_LINEARS]
    return path


def path_reason(path: list[PathEntry], model_type: str) -> str | None:
    """None if every module on `path` is there and of its class, else a sentence naming the first
    that is not."""
    for name, module, cls in path:
        kind = type(module)
        if module is None:
            return f"{name} is missing: pagedkv runs {model_type} from its modules' weights"
        if cls is not None and kind is not cls and _quantized(module):
            return (f"{name} is a {kind.__name__} from {kind.__module__}, a quantized layer (the model was loaded "
                    "quantized): pagedkv reads quantized weights from the checkpoint itself: "
                    "pagedkv.from_pretrained_quantized(folder), with a folder model.save_pretrained(folder) "
                    "wrote (or the quantized checkpoint it was loaded from)")
        if cls is not None and kind is not cls:
            return (f"{name} is a {kind.__name__}, not a torch.nn.{cls.__name__}: pagedkv runs its "
                    "own forward from the weights and would leave out what the module adds "
                    "(merge adapters into the weights first, e.g. PEFT's merge_and_unload())")
        if cls is None and not kind.__module__.startswith("transformers."):
            return (f"{name} is a {kind.__name__} from {kind.__module__}, not the model's own "
                    "transformers module: pagedkv runs its own forward and would leave it out")
    return _bias_reason({name: module for name, module, cls in path if cls is nn.Linear})


# The Linears whose bias the native decoders add (HF's attention_bias): q, k and v fused, so all
# three or none, and o. The others (the MLP's, a shared expert's and its gate, the LM head) have
# none in any supported config, and a bias put there (a module replaced by a biased nn.Linear)
# would be left out.
_QKV = ("q_proj", "k_proj", "v_proj")
_BIASED = _QKV + ("qkv_proj", "o_proj")


def _bias_reason(linears: dict[str, nn.Linear]) -> str | None:
    for name, module in linears.items():
        parent, _, leaf = name.rpartition(".")
        if leaf not in _BIASED and module.bias is not None:
            return (f"{name} has a bias, which pagedkv's forward does not add (no supported config gives "
                    "that Linear one)")
        q = linears.get(f"{parent}.q_proj") if leaf in _QKV else None
        if q is not None and (q.bias is None) != (module.bias is None):
            return (f"{name} {'lacks' if module.bias is None else 'has'} a bias where {parent}.q_proj "
                    f"{'has one' if q.bias is not None else 'has none'}: pagedkv fuses q, k and v, biases "
                    "all three or none")
    return None


_ACTIVATION_MODULES = ("act_fn", "activation_fn")  # HF's MLPs' and experts' names for it


@functools.cache
def _activation_class(activation: str) -> type:
    from transformers.activations import ACT2FN  # (imports transformers' activations on first use)
    return type(ACT2FN[activation])


def layer_modules_reason(model, activation: str) -> str | None:
    """None if every decoder layer's activation modules (an MLP's, an expert's) are the class the
    config's `activation` makes (HF's ACT2FN) and every attention is causal, as the native
    decoder computes them: HF's forward calls the modules, so a replaced act_fn or an attention's
    is_causal set False changes HF's tokens, and pagedkv's kernels would not follow. Also refused:
    fewer layers in the config than held (HF runs the first num_hidden_layers), and attentions
    sharing a layer_idx or leaving one of 0 .. n-1 out (HF's cache slots; its masks read slot 0's
    length). Per call:
    a walk over `_modules` (names only on a hit), ~0.5 ms for 28 layers on a loaded 2-core host."""
    want = _activation_class(activation)
    layers = model.model._modules["layers"]
    runs = getattr(model.config, "num_hidden_layers", None)
    if runs is not None and runs < len(layers):
        return (f"config.num_hidden_layers is {runs} but model.model.layers holds {len(layers)}: HF's forward "
                f"runs only the first {runs}, pagedkv every layer held; keep those the config names "
                f"(model.model.layers = model.model.layers[:{runs}])")
    cache_slots: dict[int, nn.Module] = {}  # HF's cache keeps a layer's K/V under its attention's layer_idx
    for module in layers.modules():
        subs = module._modules
        for leaf in _ACTIVATION_MODULES:
            act = subs.get(leaf)
            if act is not None and type(act) is not want:
                return (f"{module_name(model, act)} is a {type(act).__name__}, not the {want.__name__} of the "
                        f"config's activation {activation!r}: pagedkv's MLP kernels compute that activation only")
        attn = subs.get("self_attn")
        if attn is None:
            continue
        if vars(attn).get("is_causal", True) is not True:
            return (f"{module_name(model, attn)}.is_causal is {attn.is_causal!r}: pagedkv's attention is causal "
                    "(HF's attention without its causal mask attends to later tokens)")
        slot = vars(attn).get("layer_idx")
        if slot in cache_slots:
            return (f"{module_name(model, attn)}.layer_idx is {slot}, as {module_name(model, cache_slots[slot])}'s: "
                    "HF's cache would keep both layers' K/V in one slot, pagedkv keeps each layer's own")
        if slot is not None:
            cache_slots[slot] = attn
    if cache_slots and sorted(cache_slots) != list(range(len(cache_slots))):
        return (f"the attentions' layer_idx are {sorted(cache_slots)}: HF's cache and masks read slot 0 .. "
                f"{len(cache_slots) - 1} (a pruned model: number them again, layer.self_attn.layer_idx = i)")
    return None


def module_name(model, module: nn.Module) -> str:
    return next(name for name, m in model.named_modules() if m is module)


def tensor_subclass(t: torch.Tensor) -> bool:
    """Whether t is a tensor subclass (e.g. torchao's quantized weights), not a plain tensor or
    parameter: pagedkv's own forward reads plain ones only."""
    return type(t) not in (torch.Tensor, nn.Parameter)


def _quantized(module: nn.Module) -> bool:
    """Whether a module holds its weight quantized: a tensor of one byte an element (int8, uint8,
    FP8: bitsandbytes, FineGrainedFP8, compressed-tensors) or of packed int32 words (AWQ, GPTQ)."""
    tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
    return any(t.element_size() == 1 or t.dtype == torch.int32 for t in tensors)
