"""layers/rotary.py's LengthDependentRope and rope_lens against HF's own rotary embedding as
generate() runs it: for rope "dynamic" (Llama) and "longrope" (Phi-3), every token's cos/sin in
every forward of HF's greedy generate equal, bit for bit, what LengthDependentRope gives that
token's position at the S rope_lens assigns it, for prompts and decode steps on both sides of
the switch point (and left-padded batches, whose S is the longest row's)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from pagedkv.layers.rotary import LengthDependentRope, build_cos_sin_cache, rope_lens
from models import widen

SWITCH = 32  # dynamic: max_position_embeddings; longrope: original_max_position_embeddings
HALF = 32  # head_dim 64: 32 frequencies
CONFIGS = {
    "dynamic": ("llama", dict(max_position_embeddings=SWITCH,
                              rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=10000.0))),
    # Phi3Config's own original_max_position_embeddings overrides the rope parameters' one
    "longrope": ("phi3", dict(max_position_embeddings=4 * SWITCH, original_max_position_embeddings=SWITCH,
                              rope_parameters=dict(
        rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=SWITCH,
        short_factor=[1.0 + 0.05 * i for i in range(HALF)], long_factor=[1.5 + 0.4 * i for i in range(HALF)]))),
}
NEW_TOKENS = 16


def tiny(kind: str):
    model_type, fields = CONFIGS[kind]
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, vocab_size=256, hidden_size=128, intermediate_size=256,
                                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                  pad_token_id=0, **fields)
    return widen(AutoModelForCausalLM.from_config(config)).eval()


def batch(lengths: list[int], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded input_ids and attention_mask [B, max(lengths)] of random prompts (row r's
    tokens seeded by r)."""
    longest = max(lengths)
    ids = torch.zeros(len(lengths), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, n in enumerate(lengths):
        ids[r, longest - n:] = torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(r))
        mask[r, longest - n:] = 1
    return ids.to(device), mask.to(device)


def hf_rotary_calls(model, lengths: list[int]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(position_ids [B, T], real [B, T] bool, cos|sin halves [B, T, Dh]) of each forward of HF's
    greedy generate over left-padded prompts of `lengths`."""
    ids, mask = batch(lengths, "cpu")
    calls = []

    def record(module, args, kwargs, out):
        positions = (args[1] if len(args) > 1 else kwargs["position_ids"]).expand(len(lengths), -1)
        # a call past the prefill over T > 1 tokens is Phi-3's recompute of the whole sequence when
        # it first crosses the switch (transformers 5.24's prepare_inputs_for_generation)
        real = torch.ones_like(positions, dtype=torch.bool)
        if positions.shape[1] > 1:
            real[:, :ids.shape[1]] = mask.bool()
        half = out[0].shape[-1] // 2
        calls.append((positions.clone(), real, torch.cat([out[0][..., :half], out[1][..., :half]], -1).clone()))

    hook = model.model.rotary_emb.register_forward_hook(record, with_kwargs=True)
    try:
        model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                       eos_token_id=None, pad_token_id=0)
    finally:
        hook.remove()
    return calls


@pytest.mark.parametrize("kind", list(CONFIGS))
@pytest.mark.parametrize("lengths", [[SWITCH + 8], [20], [10, 28], [SWITCH + 5, 12]],
                         ids=["prompt past the switch", "decode crosses it", "batch crosses it",
                              "batch of one past it"])
def test_cos_sin_equal_hf_at_each_step(kind, lengths):
    model = tiny(kind)
    rope = LengthDependentRope(model.model.rotary_emb)  # before generate: HF's fresh state
    longest = max(lengths)
    offsets = torch.tensor([longest - n for n in lengths])
    bases = torch.full((len(lengths),), longest)
    past_switch = 0
    for step, (positions, real, expected) in enumerate(hf_rotary_calls(model, lengths)):
        # HF's S: the call's largest position + 1, for all its tokens
        call_len = torch.full((int(real.sum()),), int(positions.max()) + 1)
        assert torch.equal(rope.cos_sin(positions[real], call_len), expected[real]), (kind, step)
        past_switch += int((call_len > SWITCH).sum())
        if step == 0 or positions.shape[1] == 1:  # rope_lens: the prefill and decode steps
            rows = torch.arange(len(lengths))[:, None].expand_as(positions)[real]
            assert torch.equal(rope_lens(positions[real], rows, offsets, bases), call_len)
    assert past_switch > 0  # the test reaches the switch
    assert rope.switch == SWITCH and (kind == "dynamic" or rope.scaling > 1.0)


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_the_switch_changes_the_rotation(kind):
    """Past the switch the frequencies differ (so the test above can tell S apart), and a
    batch's shorter row follows the longest row's S, not its own length."""
    rope = LengthDependentRope(tiny(kind).model.rotary_emb)
    positions = torch.tensor([20, 20])
    within, past = rope.cos_sin(positions, torch.tensor([SWITCH, SWITCH + 1]))
    assert not torch.equal(within, past)
    own = rope_lens(torch.tensor([29]), torch.tensor([0]), torch.tensor([0]), torch.tensor([10]))
    batch = rope_lens(torch.tensor([29]), torch.tensor([0]), torch.tensor([5]), torch.tensor([10]))
    assert own.item() == SWITCH - 2 and batch.item() == SWITCH + 3


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_a_static_table_is_still_refused(kind):
    """One cos/sin table per position cannot follow S: the native decoder computes each step's
    rows instead (RopeByLength, tests/test_rope_by_length.py)."""
    with pytest.raises(NotImplementedError, match=kind):
        build_cos_sin_cache(tiny(kind).config, 64, "cpu")
