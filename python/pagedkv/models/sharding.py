"""Megatron's split of a Llama-family model's weights over tensor-parallel ranks: QKV and gate/up
by output rows (each rank owns Hq/n query heads, Hkv/n kv heads and I/n of the MLP), O and down by
input columns (partial sums, all-reduced by the runtime), the LM head by vocabulary rows."""

from __future__ import annotations

import dataclasses
import math

import torch

from pagedkv.models.llama import DecoderWeights, LayerWeights
from pagedkv.models.registry import UnsupportedModel


def _rows(t: torch.Tensor | None, start: int, count: int) -> torch.Tensor | None:
    return None if t is None else t[start:start + count]


def shard_weights(w: DecoderWeights, rank: int, world_size: int, device: torch.device) -> DecoderWeights:
    """Rank `rank` of `world_size`'s slice of the model's weights, copied to `device`. Raises
    UnsupportedModel naming the size that does not split evenly."""
    n, hd = world_size, w.head_dim
    inter = w.layers[0].down.shape[1]
    for what, size in (("num_attention_heads", w.num_heads), ("num_key_value_heads", w.num_kv_heads),
                       ("intermediate_size", inter)):
        if size % n:
            raise UnsupportedModel(f"pagedkv.tensor_parallel: {what} = {size} does not split over "
                                   f"{n} ranks; the world size must divide it (and the other "
                                   f"head and MLP sizes: heads {w.num_heads}/{w.num_kv_heads}, "
                                   f"intermediate {inter})")
    hq, hkv, i_rank = w.num_heads // n, w.num_kv_heads // n, inter // n
    q_size, kv_size = w.num_heads * hd, w.num_kv_heads * hd

    def to_device(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device).contiguous()

    def qkv_rows(t: torch.Tensor | None) -> torch.Tensor | None:
        """This rank's query heads, then its kv heads' K rows and V rows (QKV weight or bias)."""
        if t is None:
            return None
        return torch.cat([_rows(t, rank * hq * hd, hq * hd),
                          _rows(t, q_size + rank * hkv * hd, hkv * hd),
                          _rows(t, q_size + kv_size + rank * hkv * hd, hkv * hd)])

    layers = []
    for layer in w.layers:
        gate_up = torch.cat([_rows(layer.gate_up, rank * i_rank, i_rank),
                             _rows(layer.gate_up, inter + rank * i_rank, i_rank)])
        layers.append(LayerWeights(
            input_norm=to_device(layer.input_norm),
            qkv=to_device(qkv_rows(layer.qkv)), qkv_bias=to_device(qkv_rows(layer.qkv_bias)),
            q_norm=to_device(layer.q_norm), k_norm=to_device(layer.k_norm),
            o=to_device(layer.o[:, rank * hq * hd:(rank + 1) * hq * hd]),
            # The all-reduce sums the ranks' partial O products: the bias joins one of them.
            o_bias=to_device(layer.o_bias) if rank == 0 else None,
            post_norm=to_device(layer.post_norm),
            gate_up=to_device(gate_up),
            down=to_device(layer.down[:, rank * i_rank:(rank + 1) * i_rank]),
        ))
    # Vocabulary rows in equal shards (all_gather needs equal sizes): the last is zero-padded.
    shard = math.ceil(w.vocab_size / n)
    lm_head = w.lm_head.new_zeros((shard, w.lm_head.shape[1]))
    mine = _rows(w.lm_head, rank * shard, shard)
    lm_head[:mine.shape[0]] = mine
    return dataclasses.replace(
        w, embed=to_device(w.embed), layers=layers, final_norm=to_device(w.final_norm),
        lm_head=to_device(lm_head), num_heads=hq, num_kv_heads=hkv)
