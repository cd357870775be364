"""Forward hooks on a model's modules (activation steering, a scaled residual, a recorded
activation): HF's generate calls them at every step, pagedkv's kernels and CUDA graphs cannot, so
pagedkv.generate, a patched model.generate and pagedkv.LLM refuse the model naming the hook, hold
nothing, and give HF's tokens once it is removed. Hooks that leave the outputs alone (transformers'
output capture, enable_input_require_grads) run as before."""

from __future__ import annotations

import pytest
import torch
from torch.nn.modules.module import register_module_forward_hook

import pagedkv
from pagedkv import LLM
from conftest import DEVICES
from models import tiny_model
from test_engine import assert_nothing_held
from test_fallback import tiny as tiny_fallback
from test_model_state import GREEDY, PAD_WIDTH, assert_matches_hf, batch, hf_tokens, llm_tokens, paged_tokens


def scale_mlp_output(model):
    return model.model.layers[0].mlp.register_forward_hook(lambda module, args, out: out * 3.0)


def shrink_layer_input(model):
    def hook(module, args, kwargs):
        return (args[0] * 0.1,) + args[1:], kwargs
    return model.model.layers[1].register_forward_pre_hook(hook, with_kwargs=True)


def flip_final_norm(model):
    return model.model.norm.register_forward_hook(lambda module, args, out: out.flip(-1))


def shift_logits(model):
    def hook(module, args, out):
        out.logits[..., 7] += 100.0  # HF's generate calls the model itself: token 7 always wins
    return model.register_forward_hook(hook)


def global_mlp_hook(model):
    return register_module_forward_hook(
        lambda module, args, out: out * 3.0 if type(module).__name__ == "LlamaMLP" else None)


HOOKS = {  # how each is registered, and where the error says it is
    "forward hook on an MLP": (scale_mlp_output, "model.layers.0.mlp has a forward hook"),
    "pre-hook on a layer": (shrink_layer_input, "model.layers.1 has a forward pre-hook"),
    "forward hook on the final norm": (flip_final_norm, "model.norm has a forward hook"),
    "forward hook on the model": (shift_logits, "the model has a forward hook"),
    "global forward hook": (global_mlp_hook, "every module has a global forward hook"),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("hook", HOOKS)
def test_a_hook_is_refused_by_name_then_removed_runs(device, hook):
    register, where = HOOKS[hook]
    model = tiny_model("llama", device=device)
    llm = LLM(model, num_kv_blocks=16)
    before = assert_matches_hf(model)  # pagedkv has run the model (and made its cache)
    handle = register(model)
    try:
        assert not torch.equal(hf_tokens(model).cpu(), before.cpu()), "the hook must change HF's tokens"
        with pytest.raises(ValueError, match=rf"pagedkv.generate: {where} .*Remove the hook"):
            paged_tokens(model)
        assert_nothing_held(model)
        pagedkv.patch(model)
        ids, mask = batch(next(model.parameters()).device)
        with pytest.raises(ValueError, match=rf"pagedkv.generate: {where}"):
            model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
        pagedkv.unpatch(model)
        with pytest.raises(ValueError, match=rf"pagedkv.LLM: {where} .*nothing was queued"):
            llm_tokens(llm)
        assert not llm.has_unfinished_requests()
    finally:
        handle.remove()
    assert torch.equal(paged_tokens(model).cpu(), before.cpu())
    assert llm_tokens(llm) == before[:, PAD_WIDTH:].tolist()
    assert_nothing_held(model)



@pytest.mark.parametrize("device", DEVICES)
def test_an_llm_request_added_with_a_hook_is_refused(device):
    model = tiny_model("llama", device=device)
    llm = LLM(model, num_kv_blocks=16)
    handle = scale_mlp_output(model)
    with pytest.raises(ValueError, match=r"pagedkv.LLM: model.layers.0.mlp has a forward hook .*nothing was queued"):
        llm.add_request([5, 17, 9], GREEDY)
    assert not llm.has_unfinished_requests()
    handle.remove()
    llm.add_request([5, 17, 9], GREEDY)
    assert llm.has_unfinished_requests()


@pytest.mark.parametrize("device", DEVICES)
def test_hooks_that_leave_outputs_alone_run(device):
    """transformers installs output-capturing hooks on the layers the first time a forward asks
    for hidden states (they record only inside such a forward), and enable_input_require_grads
    one on the embeddings: neither changes the tokens, and pagedkv runs on."""
    model = tiny_model("llama", device=device)
    before = assert_matches_hf(model)
    ids, _ = batch(device)
    model(ids, output_hidden_states=True, output_attentions=True)
    model.enable_input_require_grads()
    assert any(m._forward_hooks for m in model.modules()), "transformers' hooks were expected here"
    assert torch.equal(assert_matches_hf(model).cpu(), before.cpu())


def test_a_fallback_model_with_a_hook_is_refused():
    """A model run by its own HF modules (the fallback path) calls them on one flattened row of
    tokens, and replays decode steps as CUDA graphs: refused too."""
    model = tiny_fallback("gpt_neox")
    hf = hf_tokens(model)
    handle = model.gpt_neox.layers[0].mlp.register_forward_hook(lambda module, args, out: out * 3.0)
    with pytest.raises(ValueError, match=r"gpt_neox.layers.0.mlp has a forward hook"):
        paged_tokens(model)
    handle.remove()
    assert torch.equal(paged_tokens(model), hf)
