"""Settings HF's forward reads off its modules rather than off tensors (a norm's epsilon, an
attention's scale, Gemma-2's attention softcap, Granite's multipliers), changed after pagedkv ran the model: generate()
takes the model again and follows the modules, as HF does (not the config, which HF reads only at
init); one layer's value unlike the others' is refused by name; an LLM refuses the changed model.
Tokens are compared with HF's generate on the same model."""

from __future__ import annotations

import pytest
import torch

import pagedkv
from pagedkv import LLM
from conftest import DEVICES
from models import tiny_model
from test_gemma import tiny as tiny_gemma
from test_granite_olmo2 import tiny as tiny_granite
from test_model_state import GREEDY, PROMPTS, assert_matches_hf, llm_tokens


def norms(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if "variance_epsilon" in vars(m)]


def set_everywhere(modules, attr: str, value: float) -> None:
    for module in modules:
        setattr(module, attr, value)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["llama", "qwen3"])  # qwen3: q/k norms hold one too
def test_a_changed_norm_epsilon_is_followed(device, name):
    model = tiny_model(name, device=device)
    before = assert_matches_hf(model)
    set_everywhere(norms(model), "variance_epsilon", 4.0)
    assert not torch.equal(before, assert_matches_hf(model)), "the change must matter to HF's tokens"


@pytest.mark.parametrize("device", DEVICES)
def test_a_changed_attention_scale_is_followed(device):
    model = tiny_model("llama", device=device)
    before = assert_matches_hf(model)
    set_everywhere([layer.self_attn for layer in model.model.layers], "scaling", 0.9)
    assert not torch.equal(before, assert_matches_hf(model))


def test_the_config_alone_changed_keeps_hf_tokens():
    """HF's modules keep the epsilon they were built with: a config edit changes nothing in HF,
    and pagedkv, taking the model again, reads the modules too."""
    model = tiny_model("llama")
    before = assert_matches_hf(model)
    model.config.rms_norm_eps = 4.0
    assert torch.equal(before, assert_matches_hf(model))


def test_granite_multipliers_changed_on_the_modules_are_followed():
    model = tiny_granite("granite")
    before = assert_matches_hf(model)
    set_everywhere(model.model.layers, "residual_multiplier", 5.0)  # the config's: 0.5
    after = assert_matches_hf(model)
    assert not torch.equal(before, after)
    model.model.embedding_multiplier = 100.0  # the config's: 3.0
    assert not torch.equal(after, assert_matches_hf(model))


def test_a_changed_gemma2_attention_softcap_is_followed():
    model = tiny_gemma("gemma2")  # attn_logit_softcapping 5.0, eager attention (HF's sdpa drops it)
    before = assert_matches_hf(model)
    set_everywhere([layer.self_attn for layer in model.model.layers], "attn_logit_softcapping", 0.5)
    assert not torch.equal(before, assert_matches_hf(model))


def test_one_layer_unlike_the_others_is_refused_by_name():
    model = tiny_model("llama")
    assert_matches_hf(model)
    model.model.layers[1].post_attention_layernorm.variance_epsilon = 0.25
    with pytest.raises(pagedkv.UnsupportedModel, match=r"one norm epsilon for every layer; this model's differ: "
                                                        r".*variance_epsilon = 1e-06, "
                                                        r"model.layers.1.post_attention_layernorm.variance_epsilon = 0.25"):
        assert_matches_hf(model)
    model.model.layers[1].post_attention_layernorm.variance_epsilon = 1e-6  # as it was: runs again
    assert_matches_hf(model)


@pytest.mark.parametrize("device", DEVICES)
def test_llm_refuses_a_changed_setting(device):
    model = tiny_model("llama", device=device)
    llm = LLM(model, num_kv_blocks=32, max_num_seqs=4)
    before = llm_tokens(llm)
    model.model.layers[0].input_layernorm.variance_epsilon = 4.0
    with pytest.raises(pagedkv.ModelChanged, match=r"model.layers.0.input_layernorm.variance_epsilon changed "
                                                    r"from 1e-06 to 4.0"):
        llm.add_request(PROMPTS[0], GREEDY)
    model.model.layers[0].input_layernorm.variance_epsilon = 1e-6
    assert llm_tokens(llm) == before


def test_train_and_eval_do_not_take_the_weights_again():
    """A native model's extraction reads no training flag (dropout is refused on its own)."""
    model = tiny_model("llama")
    assert_matches_hf(model)
    state = getattr(model, pagedkv.runtime.model.PREPARED_ATTR)
    model.train()
    model.eval()
    assert_matches_hf(model)
    assert getattr(model, pagedkv.runtime.model.PREPARED_ATTR) is state
