"""Edits to a model's modules that HF's forward follows and pagedkv's kernels cannot: a bias put on
a Linear whose bias the native decoder does not add, an activation module replaced, an attention
made non-causal. Each is refused by name (HF's tokens change, so running on would be a silent
wrong answer); what the decoder does compute (an o_proj bias, q/k/v biases together, a new
instance of the same activation, the rotary's inv_freq written in place) gives HF's tokens."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pagedkv
from pagedkv import LLM, ModelChanged
from conftest import DEVICES
from models import tiny_model
from test_model_state import assert_matches_hf, hf_tokens, llm_tokens, paged_tokens


def with_bias(model, path: str, std: float = 30.0) -> None:
    """Replace the Linear at `path` by a biased copy (a large random bias: it must move HF's tokens)."""
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    old = getattr(parent, name)
    new = nn.Linear(old.in_features, old.out_features, bias=True, device=old.weight.device)
    with torch.no_grad():
        new.weight.copy_(old.weight)
        new.bias.normal_(0, std)
    setattr(parent, name, new)


REFUSED_BIASES = {  # where a bias goes, and the error's words
    "model.layers.0.mlp.down_proj": "model.layers.0.mlp.down_proj has a bias, which pagedkv's forward does not add",
    "model.layers.1.mlp.gate_proj": "model.layers.1.mlp.gate_proj has a bias",
    "model.layers.0.mlp.up_proj": "model.layers.0.mlp.up_proj has a bias",
    "lm_head": "lm_head has a bias",
    "model.layers.1.self_attn.k_proj": "k_proj has a bias where model.layers.1.self_attn.q_proj has none",
    "model.layers.0.self_attn.q_proj": "k_proj lacks a bias where model.layers.0.self_attn.q_proj has one",
}


@pytest.mark.parametrize("path", REFUSED_BIASES)
def test_a_bias_the_decoder_does_not_add_is_refused(path):
    model = tiny_model("llama")
    before = assert_matches_hf(model)
    with_bias(model, path)
    assert not torch.equal(hf_tokens(model), before), "the bias must change HF's tokens"
    with pytest.raises(pagedkv.UnsupportedModel, match=REFUSED_BIASES[path]):
        paged_tokens(model)
    assert pagedkv.unsupported_reason(model) is not None


@pytest.mark.parametrize("device", DEVICES)
def test_biases_the_decoder_adds_run(device):
    """o_proj's bias, and q, k and v's all three, are HF's attention_bias: computed."""
    model = tiny_model("llama", device=device)
    before = assert_matches_hf(model)
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        with_bias(model, f"model.layers.0.self_attn.{name}", std=1.0)
    assert not torch.equal(assert_matches_hf(model), before)


def test_a_replaced_activation_is_refused():
    model = tiny_model("llama")
    before = assert_matches_hf(model)
    model.model.layers[0].mlp.act_fn = nn.ReLU()
    assert not torch.equal(hf_tokens(model), before)
    with pytest.raises(pagedkv.UnsupportedModel, match=r"model.layers.0.mlp.act_fn is a ReLU, not the "
                                                       r"SiLUActivation of the config's activation 'silu'"):
        paged_tokens(model)
    model.model.layers[0].mlp.act_fn = type(model.model.layers[1].mlp.act_fn)()  # a new SiLU: as before
    assert torch.equal(assert_matches_hf(model), before)


def test_a_non_causal_attention_is_refused():
    model = tiny_model("llama")
    ids = torch.tensor([[5, 17, 9, 100, 3, 44]])  # one row: HF's SDPA then gets no mask, only is_causal
    before = hf_tokens(model, ids, None)
    assert torch.equal(paged_tokens(model, ids, None), before)
    model.model.layers[0].self_attn.is_causal = False
    assert not torch.equal(hf_tokens(model, ids, None), before)
    with pytest.raises(pagedkv.UnsupportedModel, match=r"model.layers.0.self_attn.is_causal is False"):
        paged_tokens(model, ids, None)


@pytest.mark.parametrize("device", DEVICES)
def test_rotary_frequencies_written_in_place_are_followed(device):
    """pagedkv copies the rotary's inv_freq into its cos/sin table: an in-place write makes
    generate() take the model again, and an existing LLM refuse it by name."""
    model = tiny_model("llama", device=device)
    llm = LLM(model, num_kv_blocks=16)
    before = assert_matches_hf(model)
    model.model.rotary_emb.inv_freq.mul_(3.0)
    with pytest.raises(ModelChanged, match=r"model.rotary_emb.inv_freq was written in place"):
        llm_tokens(llm)
    assert not torch.equal(assert_matches_hf(model), before)


def test_pruned_and_reordered_layers_run():
    """Layers reordered or removed (model.model.layers cut), the attentions' layer_idx still
    0 .. n-1 (HF's cache slots): HF's forward runs the layers held, and so does pagedkv; a pruned
    model not numbered again is refused."""
    model = tiny_model("llama")
    before = assert_matches_hf(model)
    model.model.layers = nn.ModuleList([model.model.layers[1], model.model.layers[0]])
    reordered = assert_matches_hf(model)
    assert not torch.equal(reordered, before)
    model.model.layers = model.model.layers[:1]  # the attention numbered 1: HF's masks read slot 0
    with pytest.raises(pagedkv.UnsupportedModel, match=r"the attentions' layer_idx are \[1\].*layer_idx = i"):
        paged_tokens(model)
    model.model.layers[0].self_attn.layer_idx = 0
    assert not torch.equal(assert_matches_hf(model), reordered)


def test_fewer_layers_in_the_config_than_held_is_refused():
    model = tiny_model("llama")
    before = assert_matches_hf(model)
    model.config.num_hidden_layers = 1  # HF's forward: self.layers[:num_hidden_layers]
    assert not torch.equal(hf_tokens(model), before)
    with pytest.raises(pagedkv.UnsupportedModel, match=r"config.num_hidden_layers is 1 but model.model.layers "
                                                       r"holds 2.*model.model.layers\[:1\]"):
        paged_tokens(model)


def test_two_attentions_sharing_a_cache_slot_are_refused():
    model = tiny_model("llama")
    ids = torch.tensor([[5, 17, 9, 100]])  # one row: HF's SDPA fails on a padded batch here
    before = hf_tokens(model, ids, None)
    model.model.layers[0].self_attn.layer_idx = 1  # HF's cache: layer 0's K/V appended to layer 1's
    assert not torch.equal(hf_tokens(model, ids, None), before)
    with pytest.raises(pagedkv.UnsupportedModel, match=r"model.layers.1.self_attn.layer_idx is 1, as "
                                                       r"model.layers.0.self_attn's"):
        paged_tokens(model, ids, None)
