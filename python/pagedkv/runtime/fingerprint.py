"""What pagedkv's copy of a model's weights depends on (fingerprint), compared call to call so a
changed model is taken again or refused (runtime/model.py), and the first difference in words."""

from __future__ import annotations

import itertools

import torch

from pagedkv.models.module_path import tensor_subclass


_SCALAR_TYPES = frozenset((bool, int, float, str, type(None)))
_MODULE_STATE = frozenset(vars(torch.nn.Module())) - {"training"}  # what every module holds
# Settings that leave an eval-mode forward's logits as they are: left out of a native model's
# fingerprint, so toggling them (a training setup: gradient checkpointing, use_cache=False, a
# dropout rate) does not make an LLM refuse the model. Dropout acts in training mode only, which
# registry.check_no_dropout refuses at each call from the values then.
_EVAL_NEUTRAL = frozenset(("training", "gradient_checkpointing", "use_cache", "output_attentions",
                           "output_hidden_states", "return_dict"))


def _eval_neutral(name: str) -> bool:
    return name in _EVAL_NEUTRAL or "dropout" in name or "pdrop" in name


def fingerprint(model, versions: bool = False, training: bool = False, buffer_versions: bool = False) -> tuple:
    """What pagedkv's copy of the weights depends on: every module (its identity and type) and
    every parameter and buffer (identity, data pointer, dtype, device, shape; with `versions`
    also the count of in-place writes), as (name, entry) pairs, and the vocabulary size; and the
    settings HF's modules read off Python objects, not tensors: the config's public fields and
    every module's plain attributes (scalars and tuples/lists of them: a norm's
    variance_epsilon, an attention's scaling, ...). A native model's extraction read those
    values once and a CUDA graph bakes them in, so a user's later edit of one must count as a
    change. `training`: every setting, the modules' training flags and dropout rates too (a
    fallback model's modules run as they are); else the eval-neutral ones are left out.
    `buffer_versions`: the buffers' in-place writes count (a native model's rotary inv_freq is
    copied into pagedkv's cos/sin table; HF's parameters are views of pagedkv's weights instead).
    O(modules + attributes) Python, ~1 ms for 28 layers on a loaded 2-core host: per call, not per step."""
    items: list[tuple[str, tuple]] = [("config.vocab_size", ("vocab", model.config.vocab_size))]
    items += [(f"config.{k}", ("setting", repr(v))) for k, v in sorted(vars(model.config).items())
              if not k.startswith("_") and (training or not _eval_neutral(k))]
    for name, module in model.named_modules():
        items.append((name or type(model).__name__, ("module", type(module), id(module))))
        buffers = module._buffers.keys()
        for attr, t in itertools.chain(module._parameters.items(), module._buffers.items()):
            if t is not None:
                entry = ("tensor", id(t), _data_pointer(t), t.dtype, t.device, t.shape)
                if versions or (buffer_versions and attr in buffers):  # inference tensors: no counter, no writes
                    entry += (0 if t.is_inference() else t._version,)
                items.append((f"{name}.{attr}" if name else attr, entry))
        state = vars(module)
        # ~400 modules: a set difference in C drops nn.Module's own entries, and type() (not
        # isinstance, which runs an HF config's __getattribute__) picks the scalars.
        for attr in sorted(state.keys() - _MODULE_STATE):
            if attr[0] == "_" or (not training and _eval_neutral(attr)):
                continue
            value = state[attr]
            if type(value) in (tuple, list) and all(type(v) in _SCALAR_TYPES for v in value):
                value = tuple(value)
            elif type(value) not in _SCALAR_TYPES:
                continue
            items.append((f"{name}.{attr}" if name else attr, ("setting", value)))
    return tuple(items)


def _data_pointer(t: torch.Tensor) -> int | tuple:
    """t's data pointer; a wrapper tensor subclass (torchao's quantized weights) has no storage of
    its own: its inner tensors' pointers."""
    if not tensor_subclass(t) or not hasattr(t, "__tensor_flatten__"):
        return t.data_ptr()
    names, _ = t.__tensor_flatten__()
    return tuple(_data_pointer(getattr(t, n)) for n in names)


def describe_change(old: tuple, new: tuple) -> str:
    """The first difference of two fingerprints, in words."""
    before, after = dict(old), dict(new)
    for name, was in before.items():
        now = after.get(name)
        if now is None:
            return f"{name} was removed"
        if now != was:
            return f"{name} {_difference(was, now)}"
    return f"{next(n for n in after if n not in before)} was added"


def _difference(was: tuple, now: tuple) -> str:
    kind = was[0]
    if kind in ("vocab", "setting"):
        return f"changed from {was[1]} to {now[1]}"
    if kind == "module":
        return f"was replaced by a new {now[1].__name__}"
    for i, what in ((3, "dtype"), (4, "device"), (5, "shape")):
        if was[i] != now[i]:
            return f"changed {what} from {was[i]} to {now[i]}"
    if was[1] != now[1]:
        return "is a new tensor"
    if was[2] != now[2]:
        return "points to new data (.data was assigned)"
    return "was written in place"
