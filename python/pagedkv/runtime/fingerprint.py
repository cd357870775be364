"""What pagedkv's copy of a model's weights depends on (fingerprint), compared call to call so a
changed model is taken again or refused (runtime/model.py), and the first difference in words."""

from __future__ import annotations

import itertools

import torch

from pagedkv.models.module_path import tensor_subclass


def fingerprint(model, versions: bool = False) -> tuple:
    """What pagedkv's copy of the weights depends on: every module (its identity and type) and
    every parameter and buffer (identity, data pointer, dtype, device, shape; with `versions`
    also the count of in-place writes), as (name, entry) pairs, and the vocabulary size.
    O(modules + tensors) Python, about 0.4 ms for 28 layers: per call, not per step."""
    items: list[tuple[str, tuple]] = [("config.vocab_size", ("vocab", model.config.vocab_size))]
    for name, module in model.named_modules():
        items.append((name or type(model).__name__, ("module", type(module), id(module))))
        for attr, t in itertools.chain(module._parameters.items(), module._buffers.items()):
            if t is not None:
                entry = ("tensor", id(t), _data_pointer(t), t.dtype, t.device, t.shape)
                if versions:  # inference tensors keep no version counter (nor can they change)
                    entry += (0 if t.is_inference() else t._version,)
                items.append((f"{name}.{attr}" if name else attr, entry))
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
    if kind in ("vocab", "setting"):  # settings: a fallback model's (models/fallback.py settings_state)
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
