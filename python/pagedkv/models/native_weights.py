"""The fields every native family's weights share (models/llama.py's DecoderWeights and the Gemma,
OLMo-2 and Cohere families'): the embedding, the layers, the final norm and LM head, and the
attention's shape. The runtime reads these of any native model; each family adds what its
forward needs beyond them."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Generic, TypeVar

import torch

from pagedkv.models.unsupported import UnsupportedModel

LayerT = TypeVar("LayerT")


@dataclasses.dataclass(slots=True)
class NativeWeights(Generic[LayerT]):
    embed: torch.Tensor  # [V, D]
    layers: list[LayerT]
    final_norm: torch.Tensor  # [D]
    lm_head: torch.Tensor  # [V, D] (the embedding itself when tied); [ceil(V / n), D] on n ranks
    vocab_size: int  # V
    num_heads: int  # on this rank (Hq / n under tensor parallelism)
    num_kv_heads: int
    head_dim: int
    eps: float  # the norms' epsilon
    scale: float  # the attention's score scale


def module_setting(modules: Iterable[tuple[str, torch.nn.Module]], attrs: tuple[str, ...], default: float,
                   what: str) -> float:
    """The value HF's forward reads off these modules (the first of `attrs` each one holds, e.g. a
    norm's variance_epsilon): HF sets it from the config at init, and a user may change it after,
    on the module, which the config no longer says. One value for all the modules, else
    UnsupportedModel naming two that differ (pagedkv runs one value for every layer); `default`
    (the config's) where no module holds one. None (a feature off, e.g. no softcap) reads as 0."""
    found: dict[str, float] = {}
    for name, module in modules:
        held = next((a for a in attrs if a in vars(module)), None)
        if held is not None:
            found[f"{name}.{held}"] = float(vars(module)[held] or 0.0)
    if len(set(found.values())) > 1:
        first = next(iter(found))
        other = next(n for n, v in found.items() if v != found[first])
        raise UnsupportedModel(f"pagedkv runs one {what} for every layer; this model's differ: {first} = "
                               f"{found[first]}, {other} = {found[other]}")
    return next(iter(found.values())) if found else float(default)


def norm_eps(model, default: float) -> float:
    """The epsilon of every norm of the model (Gemma's `eps`, the others' `variance_epsilon`)."""
    norms = [(n, m) for n, m in model.named_modules() if "variance_epsilon" in vars(m) or "eps" in vars(m)]
    return module_setting(norms, ("variance_epsilon", "eps"), default, "norm epsilon")


def attention_setting(layers, attr: str, default: float, what: str) -> float:
    """module_setting over every layer's attention module (`self_attn`)."""
    named = [(f"model.layers.{i}.self_attn", layer.self_attn) for i, layer in enumerate(layers)]
    return module_setting(named, (attr,), default, what)


def attention_scale(layers) -> float:
    """The score scale every layer's attention module holds (HF's forward reads `scaling`)."""
    return attention_setting(layers, "scaling", layers[0].self_attn.scaling, "attention scale")
