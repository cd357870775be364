"""The HF model stays trainable after pagedkv ran it: its parameters (the fused QKV and gate/up
ones, views of pagedkv's fused tensors, included) are ordinary tensors that keep requires_grad,
so forward + backward + an optimizer step work (also after pagedkv.unpatch), and the next
generate() gives HF's greedy tokens of the updated model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import pagedkv
from conftest import DEVICES
from models import tiny_model
from test_model_state import assert_matches_hf, batch, paged_tokens


def train_step(model, optimizer) -> None:
    """One step toward random next tokens: every weight gets a gradient and moves."""
    model.train()
    ids, mask = batch(next(model.parameters()).device)
    targets = torch.randint(3, 256, ids.shape, generator=torch.Generator().manual_seed(1)).to(ids.device)
    logits = model(ids, attention_mask=mask).logits  # [B, S, V]
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    model.eval()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimizer", ["SGD", "AdamW"])
@pytest.mark.parametrize("how", ["pagedkv.generate", "patch, generate, unpatch"])
def test_trains_after_generate(device, optimizer, how):
    model = tiny_model("llama", device=device)
    if how == "pagedkv.generate":
        before = assert_matches_hf(model)
    else:
        pagedkv.patch(model)
        ids, mask = batch(device)
        before = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                eos_token_id=None)
        pagedkv.unpatch(model)
    for name, p in model.named_parameters():
        assert not p.is_inference() and p.requires_grad, name
    opt = torch.optim.SGD(model.parameters(), lr=0.5) if optimizer == "SGD" else \
        torch.optim.AdamW(model.parameters(), lr=0.02)
    train_step(model, opt)
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    after = assert_matches_hf(model)
    assert not torch.equal(before, after), "the step must change HF's tokens"
    train_step(model, opt)  # and again, after pagedkv ran the updated weights
    assert not torch.equal(after, assert_matches_hf(model))


def test_frozen_parameters_stay_frozen():
    model = tiny_model("llama")
    model.model.layers[0].self_attn.q_proj.weight.requires_grad_(False)
    paged_tokens(model)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {"model.layers.0.self_attn.q_proj.weight"}
