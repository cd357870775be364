"""pagedkv.patch(model): the model's own ``generate`` runs on pagedkv, with the same arguments."""

from __future__ import annotations

import functools
import types

from pagedkv.hf.generate import generate
from pagedkv.models.registry import check_supported


def patch(model, use_cuda_graphs: bool | None = None):
    """Make ``model.generate`` run on pagedkv (same arguments). Returns the model."""
    check_supported(model)
    if getattr(model, "_pagedkv_original_generate", None) is None:
        model._pagedkv_original_generate = model.generate
    model.generate = types.MethodType(
        functools.partial(_patched_generate, use_cuda_graphs=use_cuda_graphs), model)
    return model


def _patched_generate(model, input_ids=None, *args, use_cuda_graphs=None, **kwargs):
    if args:
        raise ValueError("pagedkv.generate takes input_ids positionally and everything else by "
                         f"keyword; got {len(args)} more positional argument(s)")
    if input_ids is None:
        input_ids = kwargs.pop("inputs", None)
    return generate(model, input_ids, use_cuda_graphs=use_cuda_graphs, **kwargs)


def unpatch(model):
    """Restore HF's ``model.generate``. Returns the model."""
    original = getattr(model, "_pagedkv_original_generate", None)
    if original is not None:
        del model.generate  # the instance attribute; the class method shows through again
        model._pagedkv_original_generate = None
    return model
