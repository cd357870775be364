"""The values generate() takes for its integer, real and flag settings, in the forms HF takes.

HF accepts a NumPy integer or a 0-d tensor for max_new_tokens, a whole float (5.0) for
max_length, eos_token_id as an int, list, tensor or array; it turns 5.5 new tokens into 6 and
True into 1. pagedkv takes every form whose meaning is plain (ints, NumPy scalars, 0-d tensors,
whole floats) for every such setting alike, and refuses bools, fractions and other types with
an error naming the setting, instead of a pybind or NumPy message from deep inside.
"""

from __future__ import annotations

import numbers
import operator
from typing import Any

import torch

INTEGER_FIELDS = ("max_new_tokens", "max_length", "min_new_tokens", "min_length", "top_k",
                  "pad_token_id", "bos_token_id", "prompt_lookup_num_tokens", "max_matching_ngram_size")
REAL_FIELDS = ("temperature", "top_p", "repetition_penalty")
FLAG_FIELDS = ("do_sample", "return_dict_in_generate", "use_cache")
_INT_FORMS = "an integer (an int, a NumPy integer or a 0-d tensor)"


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool) or str(getattr(value, "dtype", "")) in ("bool", "torch.bool")


def _scalar(name: str, value: Any, forms: str) -> Any:
    """A 0-d tensor's or NumPy scalar's Python value; others as they are."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 0:
            raise TypeError(f"pagedkv.generate: {name} must be {forms}, got a Tensor of shape "
                            f"{tuple(value.shape)}")
        return value.item()
    item = getattr(value, "item", None)  # NumPy scalars
    return item() if callable(item) and getattr(value, "shape", None) == () else value


def integer(name: str, value: Any) -> int | None:
    """An integer setting (None stays None): ints, NumPy integers, 0-d tensors, whole floats."""
    if value is None:
        return None
    if _is_bool(value):
        raise TypeError(f"pagedkv.generate: {name}={bool(value)} is a bool; it must be an integer")
    value = _scalar(name, value, _INT_FORMS)
    if isinstance(value, numbers.Integral):
        return operator.index(value)
    if isinstance(value, float):
        if value.is_integer():
            return int(value)
        raise ValueError(f"pagedkv.generate: {name}={value} is not a whole number; it must be an integer")
    raise TypeError(f"pagedkv.generate: {name} must be {_INT_FORMS}, got {type(value).__name__}")


def real(name: str, value: Any) -> float | None:
    """A real setting (None stays None): ints, floats, NumPy numbers, 0-d tensors."""
    if value is None:
        return None
    if _is_bool(value):
        raise TypeError(f"pagedkv.generate: {name}={bool(value)} is a bool; it must be a number")
    value = _scalar(name, value, "a number")
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(f"pagedkv.generate: {name} must be a number (an int or float, NumPy or 0-d "
                    f"tensor too), got {type(value).__name__}")


def flag(name: str, value: Any) -> bool | None:
    """A flag (None stays None): bools, NumPy bools, 0 or 1, 0-d tensors of them."""
    if value is None or isinstance(value, bool):
        return value
    value = _scalar(name, value, "a bool")
    if isinstance(value, numbers.Integral) and value in (0, 1):
        return bool(value)
    raise TypeError(f"pagedkv.generate: {name} must be a bool (True/False, or 0/1), got "
                    f"{type(value).__name__} {value!r}")


def token_ids(name: str, value: Any) -> tuple[int, ...]:
    """eos_token_id: an integer, or a list, tuple, 1-D tensor or array of them; () for None."""
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(integer(name, v) for v in value)
    if getattr(value, "ndim", 0) > 0:  # tensors and arrays
        if value.ndim != 1:
            raise TypeError(f"pagedkv.generate: {name} must be an integer or a 1-D list/tensor/array of "
                            f"them, got a {type(value).__name__} of shape {tuple(value.shape)}")
        return tuple(integer(name, v) for v in value.tolist())
    return (integer(name, value),)


def normalized(settings: dict[str, Any]) -> dict[str, Any]:
    """The settings among these fields in their plain Python types (others unchanged)."""
    out = dict(settings)
    for name, value in settings.items():
        if name in INTEGER_FIELDS:
            out[name] = integer(name, value)
        elif name in REAL_FIELDS:
            out[name] = real(name, value)
        elif name in FLAG_FIELDS:
            out[name] = flag(name, value)
        elif name == "eos_token_id" and value is not None:
            ids = token_ids(name, value)
            out[name] = list(ids) if len(ids) != 1 or isinstance(value, (list, tuple)) else ids[0]
    return out
