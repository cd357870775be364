"""The fields every native family's weights share (models/llama.py's DecoderWeights and the Gemma,
OLMo-2 and Cohere families'): the embedding, the layers, the final norm and LM head, and the
attention's shape. The runtime reads these of any native model; each family adds what its
forward needs beyond them."""

from __future__ import annotations

import dataclasses
from typing import Generic, TypeVar

import torch

LayerT = TypeVar("LayerT")


@dataclasses.dataclass(slots=True)
class NativeWeights(Generic[LayerT]):
    embed: torch.Tensor  # [V, D]
    layers: list[LayerT]
    final_norm: torch.Tensor  # [D]
    lm_head: torch.Tensor  # [V, D] (the embedding itself when tied); [ceil(V / n), D] on n ranks
    vocab_size: int  # V
    num_heads: int  # on this rank (Hq / n under tensor parallelism)
    num_kv_heads: int
    head_dim: int
    eps: float  # the norms' epsilon
    scale: float  # the attention's score scale
