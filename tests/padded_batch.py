"""The left-padded two-row batch the generate() argument tests share, and HF's generate on it."""

from __future__ import annotations

import warnings

import torch

from limits import prompt

A, B = prompt(7, seed=1), prompt(4, seed=2)
IDS = torch.tensor([A, [0] * 3 + B])  # [2, 7], row 1 left-padded
MASK = torch.tensor([[1] * 7, [0] * 3 + [1] * 4])
S = IDS.shape[1]
GREEDY = dict(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)


def hf(m, ids=IDS, **kwargs):
    """HF's own generate (not a patched one) on ids with MASK, its warnings silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return type(m).generate(m, ids, attention_mask=MASK.to(ids.device), **kwargs)
