"""The fast path's repetition penalty reads the prompt as the installed transformers does: from
5.2x HF leaves each row's left padding out (RepetitionPenaltyLogitsProcessor's
prompt_ignore_length from the attention mask); earlier versions penalize every id of the padded
rows. A pad id the model would pick next tells the two apart."""

import pytest
import torch

import pagedkv
from pagedkv.hf.generation_config import hf_penalizes_padding
from models import tiny_model


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_left_padding_is_penalized_as_hf_does(name):
    model = tiny_model(name)
    torch.manual_seed(1)
    long = torch.randint(3, model.config.vocab_size, (1, 9))
    short = torch.randint(3, model.config.vocab_size, (1, 4))
    # HF's first token of the short row (its padding cannot change it when HF ignores padding)
    first = model.generate(short, attention_mask=torch.ones_like(short), max_new_tokens=1,
                           do_sample=False, repetition_penalty=30.0)[0, -1].item()
    assert first not in short[0].tolist() and first not in long[0].tolist()
    pad = first  # the padding holds the token HF picks next for that row
    ids = torch.cat([long, torch.cat([torch.full((1, 5), pad), short], dim=1)])
    mask = torch.cat([torch.ones(1, 9), torch.cat([torch.zeros(1, 5), torch.ones(1, 4)], dim=1)]).long()
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, repetition_penalty=30.0,
                  pad_token_id=pad)
    expected = model.generate(ids, **kwargs)
    assert torch.equal(pagedkv.generate(model, ids, **kwargs), expected)
    if not hf_penalizes_padding():  # the case this test is about: HF ignores the padding
        assert expected[1, 9].item() == first
