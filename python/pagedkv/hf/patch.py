"""pagedkv.patch(model): the model's own ``generate`` runs on pagedkv, with the same arguments."""

from __future__ import annotations

import inspect
from typing import Any, Callable, TypeVar

import torch

from pagedkv.hf.generate import generate
from pagedkv.models.registry import check_supported, compiled_original

M = TypeVar("M", bound=torch.nn.Module)

# What functools.update_wrapper copies, less __annotations__ (the signature carries them) and
# __wrapped__ (a property: see PatchedGenerate).
_COPIED = ("__module__", "__name__", "__qualname__", "__doc__")


def patch(model: M, use_cuda_graphs: bool | None = None) -> M:
    """Make ``model.generate`` run on pagedkv (same arguments). Returns the model. A torch.compile
    wrapper is patched as it is and runs its original's weights."""
    check_supported(compiled_original(model))
    if getattr(model, "_pagedkv_original_generate", None) is None:
        model._pagedkv_original_generate = model.generate
    model.generate = PatchedGenerate(model, use_cuda_graphs)
    return model


class PatchedGenerate:
    """A patched model's ``generate``. A plain object rather than a bound partial, so a patched
    model can be deep-copied, pickled and torch.save'd (the copy's generate runs the copy).

    It looks like HF's generate (functools.wraps-style): its name, docstring and signature, so
    that ``help(model.generate)`` and ``inspect.signature`` read HF's. ``__wrapped__`` and
    ``__signature__`` are read from the model's class when asked rather than stored: a stored
    bound method or signature would be pickled with the model."""

    def __init__(self, model: torch.nn.Module, use_cuda_graphs: bool | None) -> None:
        self.model = model
        self.use_cuda_graphs = use_cuda_graphs
        for attr in _COPIED:
            setattr(self, attr, getattr(self.__wrapped__, attr, None))

    @property
    def __wrapped__(self) -> Callable[..., Any]:
        """The model's generate before patch (HF's; what unpatch restores)."""
        original = getattr(self.model, "_pagedkv_original_generate", None)
        return original if original is not None else type(self.model).generate.__get__(self.model)

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self.__wrapped__)

    def __get__(self, obj: object, objtype: type | None = None) -> PatchedGenerate:
        # Never called (the object is an instance attribute); having it makes inspect.isroutine
        # true, so help() documents it as a function with HF's signature.
        return self

    def __call__(self, input_ids: torch.Tensor | None = None, *args: Any, **kwargs: Any) -> Any:
        if args:
            raise ValueError("pagedkv.generate takes input_ids positionally and everything else by "
                             f"keyword; got {len(args)} more positional argument(s)")
        if input_ids is None:
            input_ids = kwargs.pop("inputs", None)
        return generate(self.model, input_ids, use_cuda_graphs=self.use_cuda_graphs, **kwargs)

    def __repr__(self) -> str:
        return f"<pagedkv-patched {type(self.model).__name__}.generate (pagedkv.unpatch restores HF's)>"


def unpatch(model: M) -> M:
    """Restore HF's ``model.generate``. Returns the model."""
    original = getattr(model, "_pagedkv_original_generate", None)
    if original is not None:
        del model.generate  # the instance attribute; the class method shows through again
        model._pagedkv_original_generate = None
    return model
