"""Megatron's split of a Llama-family model's weights over tensor-parallel ranks: QKV and gate/up
by output rows (each rank owns Hq/n query heads, Hkv/n kv heads and I/n of the MLP), O and down by
input columns (partial sums, all-reduced by the runtime), the LM head by vocabulary rows.

The split is written once, over HF's tensor names (shard_decoder): shard_weights takes a rank's
part of weights already loaded, models/checkpoint_shards.py reads only that part from a
checkpoint; both give the same tensors."""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch

from pagedkv.models.llama import DecoderWeights, LayerWeights
from pagedkv.models.registry import UnsupportedModel

WHOLE = slice(None)

# part(name, rows, cols): rows `rows` (and columns `cols`, None: all) of the model's tensor `name`,
# named as in HF's state dict ("model.layers.0.self_attn.q_proj.weight"), on the shard's device
# and dtype; None if the model has no such tensor (a bias, Qwen3's q/k norm).
Part = Callable[[str, slice, "slice | None"], "torch.Tensor | None"]


@dataclasses.dataclass(frozen=True, slots=True)
class RankSlices:
    """What one rank owns of each weight the split divides."""

    rank: int
    num_heads: int  # query heads of this rank (Hq / n)
    num_kv_heads: int  # Hkv / n
    q: slice  # rows of q_proj, columns of o_proj: this rank's query heads
    kv: slice  # rows of k_proj and v_proj: its kv heads
    mlp: slice  # rows of gate_proj and up_proj, columns of down_proj
    vocab: slice  # rows of the LM head (the last rank's may run past the vocabulary)
    vocab_shard: int  # LM-head rows of every rank: equal, for all_gather (the last zero-padded)


def rank_slices(rank: int, world_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                intermediate: int, vocab_size: int) -> RankSlices:
    """Rank `rank` of `world_size`'s slices. Raises UnsupportedModel naming the size that does
    not split evenly."""
    n = world_size
    for what, size in (("num_attention_heads", num_heads), ("num_key_value_heads", num_kv_heads),
                       ("intermediate_size", intermediate)):
        if size % n:
            raise UnsupportedModel(f"pagedkv.tensor_parallel: {what} = {size} does not split over "
                                   f"{n} ranks; the world size must divide it (and the other "
                                   f"head and MLP sizes: heads {num_heads}/{num_kv_heads}, "
                                   f"intermediate {intermediate})")
    hq, hkv, i_rank = num_heads // n, num_kv_heads // n, intermediate // n
    shard = math.ceil(vocab_size / n)

    def mine(count: int) -> slice:
        return slice(rank * count, (rank + 1) * count)

    return RankSlices(rank, hq, hkv, q=mine(hq * head_dim), kv=mine(hkv * head_dim), mlp=mine(i_rank),
                      vocab=mine(shard), vocab_shard=shard)


def shard_decoder(part: Part, s: RankSlices, num_layers: int, vocab_size: int, head_dim: int,
                  eps: float, scale: float, windows: list[int]) -> DecoderWeights:
    """One rank's weights, each tensor taken through `part`; windows: each layer's (all ranks')."""
    def cat(*parts: torch.Tensor | None) -> torch.Tensor | None:
        return None if parts[0] is None else torch.cat(parts)

    layers = []
    for i in range(num_layers):
        def get(name: str, rows: slice = WHOLE, cols: slice | None = None, at: str = f"model.layers.{i}."):
            return part(at + name, rows, cols)

        layers.append(LayerWeights(
            input_norm=get("input_layernorm.weight"),
            # This rank's query heads, then its kv heads' K rows and V rows.
            qkv=cat(get("self_attn.q_proj.weight", s.q), get("self_attn.k_proj.weight", s.kv),
                    get("self_attn.v_proj.weight", s.kv)),
            qkv_bias=cat(get("self_attn.q_proj.bias", s.q), get("self_attn.k_proj.bias", s.kv),
                         get("self_attn.v_proj.bias", s.kv)),
            q_norm=get("self_attn.q_norm.weight"), k_norm=get("self_attn.k_norm.weight"),
            o=get("self_attn.o_proj.weight", WHOLE, s.q),
            # The all-reduce sums the ranks' partial O products: the bias joins one of them.
            o_bias=get("self_attn.o_proj.bias") if s.rank == 0 else None,
            post_norm=get("post_attention_layernorm.weight"),
            gate_up=cat(get("mlp.gate_proj.weight", s.mlp), get("mlp.up_proj.weight", s.mlp)),
            down=get("mlp.down_proj.weight", WHOLE, s.mlp),
        ))
    # Vocabulary rows in equal shards (all_gather needs equal sizes): the last is zero-padded.
    lm_head = part("lm_head.weight", s.vocab, None)
    if lm_head.shape[0] < s.vocab_shard:
        padded = lm_head.new_zeros((s.vocab_shard, lm_head.shape[1]))
        padded[:lm_head.shape[0]] = lm_head
        lm_head = padded
    return DecoderWeights(
        embed=part("model.embed_tokens.weight", WHOLE, None), layers=layers,
        final_norm=part("model.norm.weight", WHOLE, None), lm_head=lm_head, vocab_size=vocab_size,
        num_heads=s.num_heads, num_kv_heads=s.num_kv_heads, head_dim=head_dim, eps=eps, scale=scale,
        windows=list(windows))


def hf_tensors(w: DecoderWeights) -> dict[str, torch.Tensor]:
    """The weights by HF's names: views of the fused QKV and gate/up (biases and norms the model
    lacks are left out)."""
    hd = w.head_dim
    sizes = [w.num_heads * hd, w.num_kv_heads * hd, w.num_kv_heads * hd]
    tensors = {"model.embed_tokens.weight": w.embed, "model.norm.weight": w.final_norm, "lm_head.weight": w.lm_head}
    for i, layer in enumerate(w.layers):
        at = f"model.layers.{i}."
        inter = layer.down.shape[1]
        parts = {"input_layernorm.weight": layer.input_norm, "post_attention_layernorm.weight": layer.post_norm,
                 "self_attn.q_norm.weight": layer.q_norm, "self_attn.k_norm.weight": layer.k_norm,
                 "self_attn.o_proj.weight": layer.o, "self_attn.o_proj.bias": layer.o_bias,
                 "mlp.down_proj.weight": layer.down}
        parts.update(zip(("mlp.gate_proj.weight", "mlp.up_proj.weight"), layer.gate_up.split([inter, inter])))
        for kind in ("weight", "bias"):
            fused = layer.qkv if kind == "weight" else layer.qkv_bias
            if fused is not None:
                parts.update(zip((f"self_attn.{p}_proj.{kind}" for p in "qkv"), fused.split(sizes)))
        tensors.update((at + name, t) for name, t in parts.items() if t is not None)
    return tensors


def shard_weights(w: DecoderWeights, rank: int, world_size: int, device: torch.device) -> DecoderWeights:
    """Rank `rank` of `world_size`'s slice of the model's weights, copied to `device`. Raises
    UnsupportedModel naming the size that does not split evenly."""
    s = rank_slices(rank, world_size, w.num_heads, w.num_kv_heads, w.head_dim, w.layers[0].down.shape[1],
                    w.vocab_size)
    tensors = hf_tensors(w)

    def part(name: str, rows: slice, cols: slice | None) -> torch.Tensor | None:
        t = tensors.get(name)
        if t is None:
            return None
        t = t[rows] if cols is None else t[rows, cols]
        return t.to(device).contiguous()

    return shard_decoder(part, s, len(w.layers), w.vocab_size, w.head_dim, w.eps, w.scale, w.windows)
