"""A draft model for speculative decoding that needs no download: the target cut to its first L
decoder layers, with the target's embeddings, final norm, LM head (so its vocabulary and
tokenizer), built in memory. bench_prompt_lookup.py --draft-layers L times it as
assistant_model, pagedkv's against HF's.

The draft's parameters are new Parameter objects over the target's tensors (no weight is copied
when it is built). They must not be the target's Parameter objects themselves: pagedkv, preparing
a model, re-points its q/k/v and gate/up parameters to fused tensors (models/llama.py
_fuse_rows), and the model's fingerprint then sees new data; shared Parameter objects would make
each model's preparation change the other's, re-taking the weights on every call."""

from __future__ import annotations

import copy

import torch


def truncated_draft(model: torch.nn.Module, layers: int) -> torch.nn.Module:
    """A copy of the HF causal LM `model` (a Llama-family *ForCausalLM: model.model.layers) with its
    first `layers` decoder layers only, its config's num_hidden_layers (and layer_types, where the
    config has them) cut to match, in eval mode on the target's device and dtype."""
    inner = getattr(model, "model", None)
    blocks = getattr(inner, "layers", None)
    if not isinstance(blocks, torch.nn.ModuleList):
        raise ValueError(f"truncated_draft: {type(model).__name__} has no model.layers; allowed: a "
                         "Llama-family *ForCausalLM (model.model.layers holds its decoder layers)")
    total = len(blocks)
    if not 1 <= layers < total:
        raise ValueError(f"truncated_draft: layers={layers}; allowed: 1..{total - 1} "
                         f"(the target has {total} decoder layers)")
    # deepcopy consults the memo first: every parameter becomes a new Parameter on the same tensor
    # (tied ones stay tied: one id, one entry); modules, buffers and the config are copied.
    memo = {id(p): torch.nn.Parameter(p.detach(), requires_grad=p.requires_grad) for p in model.parameters()}
    draft = copy.deepcopy(model, memo)
    draft.model.layers = draft.model.layers[:layers]  # a new ModuleList of the first `layers`
    config = draft.config  # the inner model's config too (one object, kept one by the memo)
    config.num_hidden_layers = layers
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:layers]
    return draft.eval()


def parameter_count(model: torch.nn.Module) -> int:
    """Distinct parameters' elements (a tied embedding and LM head count once)."""
    return sum(p.numel() for p in model.parameters())
