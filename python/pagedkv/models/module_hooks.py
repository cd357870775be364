"""Forward hooks on a model's modules, which pagedkv cannot honour: its native forward never calls
the HF modules (fused kernels over weights taken once), the fallback path calls them on a batch
flattened to one row of tokens, and a decode step replayed as a CUDA graph runs no Python at all.
A hook HF's generate calls at every step (activation steering, a scaled residual, a recorded
activation) would be skipped or see other shapes, and the tokens differ with no error: refused.
Checked per generate() / LLM call, not per step."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from torch.nn.modules import module as nn_module

from pagedkv.models.module_path import module_name
from pagedkv.models.registry import compiled_original


def _leaves_outputs_alone(hook: Callable) -> bool:
    """Hooks that never change an eval-mode forward's outputs: pagedkv's own (a sharded
    skeleton's guard), transformers' output capture (installed on the modules by a forward that
    asked for hidden states or attentions; it records only inside such a forward) and its
    enable_input_require_grads (marks the embeddings' output as needing grad, for adapters)."""
    module = getattr(hook, "__module__", None) or ""
    return (module.startswith("pagedkv.") or module == "transformers.utils.output_capturing"
            or (module == "transformers.modeling_utils" and getattr(hook, "__name__", "") == "make_inputs_require_grads"))


def _hooks_of(hooks: dict, kind: str) -> Iterator[tuple[str, Callable]]:
    return ((kind, h) for h in hooks.values() if not _leaves_outputs_alone(h))


def forward_hooks(model) -> list[tuple[str, str, Callable]]:
    """(where, kind, hook) of every forward hook and pre-hook that could change `model`'s
    outputs: the global ones (torch.nn.modules.module.register_module_forward_hook) and each
    module's, the model's own included (HF's generate calls the model at every step)."""
    model = compiled_original(model)
    found = [("every module", kind, hook) for kind, hook in [
        *_hooks_of(nn_module._global_forward_pre_hooks, "global forward pre-hook"),
        *_hooks_of(nn_module._global_forward_hooks, "global forward hook")]]
    for module in model.modules():
        if not (module._forward_pre_hooks or module._forward_hooks):  # most modules: two empty dicts
            continue
        hooks = [*_hooks_of(module._forward_pre_hooks, "forward pre-hook"),
                 *_hooks_of(module._forward_hooks, "forward hook")]
        if hooks:  # named only then: transformers' capture hooks sit on every layer once installed
            where = module_name(model, module) or "the model"
            found += [(where, kind, hook) for kind, hook in hooks]
    return found


def check_no_forward_hooks(model, who: str, suffix: str = "") -> None:
    """ValueError (from `who`, `suffix` appended) naming the first hook `forward_hooks` finds."""
    found = forward_hooks(model)
    if found:
        where, kind, hook = found[0]
        what = getattr(hook, "__qualname__", None) or repr(hook)
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise ValueError(
            f"{who}: {where} has a {kind} ({what}){more}; pagedkv does not call module hooks as HF's "
            "generate does at every step (it runs its own kernels, or HF's modules on a flattened batch, and "
            "replays decode steps as CUDA graphs), so the tokens could differ. Remove the hook (its handle's "
            ".remove()) to run pagedkv, or keep it and run HF's generate (type(model).generate(model, ...), "
            f"or pagedkv.unpatch(model) first){suffix}")
