"""pagedkv.patch(model): the model's own ``generate`` runs on pagedkv, with the same arguments."""

from __future__ import annotations

from pagedkv.hf.generate import generate
from pagedkv.models.registry import check_supported


def patch(model, use_cuda_graphs: bool | None = None):
    """Make ``model.generate`` run on pagedkv (same arguments). Returns the model."""
    check_supported(model)
    if getattr(model, "_pagedkv_original_generate", None) is None:
        model._pagedkv_original_generate = model.generate
    model.generate = PatchedGenerate(model, use_cuda_graphs)
    return model


class PatchedGenerate:
    """A patched model's ``generate``. A plain object rather than a bound partial, so a patched
    model can be deep-copied, pickled and torch.save'd (the copy's generate runs the copy)."""

    def __init__(self, model, use_cuda_graphs: bool | None):
        self.model = model
        self.use_cuda_graphs = use_cuda_graphs

    def __call__(self, input_ids=None, *args, **kwargs):
        if args:
            raise ValueError("pagedkv.generate takes input_ids positionally and everything else by "
                             f"keyword; got {len(args)} more positional argument(s)")
        if input_ids is None:
            input_ids = kwargs.pop("inputs", None)
        return generate(self.model, input_ids, use_cuda_graphs=self.use_cuda_graphs, **kwargs)


def unpatch(model):
    """Restore HF's ``model.generate``. Returns the model."""
    original = getattr(model, "_pagedkv_original_generate", None)
    if original is not None:
        del model.generate  # the instance attribute; the class method shows through again
        model._pagedkv_original_generate = None
    return model
