"""Baselines to time pagedkv against in the same run.

StaticCacheDecoder is the best PyTorch-native decoder, gpt-fast's recipe, over an HF Llama-family
model's own weights: a static KV cache, fused QKV and gate/up weights, one decode step compiled
whole by torch.compile with mode="reduce-overhead" (so it replays as a CUDA graph), greedy argmax
in the graph. BENCHMARKS.md measured gpt-fast at 87% of W1's roofline on an H100; this rebuilds
it so that it runs on the same machine, torch and model as pagedkv.

Kept from gpt-fast: the cache is [batch, kv heads, max_seq, head_dim] per layer, written with
index_copy_ at the step's position, and attention runs over the whole cache with a mask of the
positions written so far. Changed: each kv head's query heads are the rows of one matmul, where
gpt-fast repeated K/V per query head (a copy every step); QKV bias, Qwen3's q/k norms and HF's
RoPE tables (Llama-3 scaling included), so it computes what HF computes for every architecture
pagedkv runs.

    from pagedkv.tools.baselines import StaticCacheDecoder
    decoder = StaticCacheDecoder(model, batch=8, max_seq=512)
    tokens = decoder.generate(input_ids, max_new_tokens=128)   # [batch, max_new_tokens]

Prompts must share one length (no padding). The prefill runs eagerly; the decode steps run
compiled with compile_mode "reduce-overhead" or "max-autotune" (which also tunes Triton GEMMs
against cuBLAS), or eagerly with None.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SUPPORTED = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # HF's rounding: normalize in fp32, round to the input's dtype, then scale.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _concat(*tensors: torch.Tensor | None) -> torch.Tensor | None:
    if all(t is None for t in tensors):
        return None
    if any(t is None for t in tensors):
        raise ValueError("StaticCacheDecoder: the projections fused into one weight must all have "
                         "a bias or none")
    return torch.cat([t.detach() for t in tensors])


class StaticCacheDecoder(torch.nn.Module):
    """Greedy decoding of `batch` equal-length prompts of up to `max_seq` tokens in all, over the
    HF model's weights (see the module's docstring)."""

    def __init__(self, model, batch: int, max_seq: int, compile_mode: str | None = "reduce-overhead"):
        super().__init__()
        name = type(model).__name__
        if name not in SUPPORTED:
            raise ValueError(f"StaticCacheDecoder: {name} is not supported; "
                             f"supported: {', '.join(SUPPORTED)}")
        cfg = model.config
        window = getattr(cfg, "sliding_window", None)
        if window is not None and getattr(cfg, "use_sliding_window", True) and max_seq > window:
            raise ValueError(f"StaticCacheDecoder: max_seq {max_seq} passes the sliding window {window}")
        self.batch, self.max_seq = batch, max_seq
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        weight = model.model.embed_tokens.weight
        device, dtype = weight.device, weight.dtype
        # Every tensor the step reads is a buffer (no copy: HF's own storage, but the fused
        # weights): CUDA-graph trees take buffers as static, where a plain tensor attribute would
        # be copied into the graph's input at every replay.
        self.register_buffer("embed", weight.detach(), persistent=False)
        self.register_buffer("norm", model.model.norm.weight.detach(), persistent=False)
        self.register_buffer("lm_head", model.lm_head.weight.detach(), persistent=False)
        self.num_layers = len(model.model.layers)
        self.qk_norm = hasattr(model.model.layers[0].self_attn, "q_norm")
        cache_shape = (batch, self.num_kv_heads, max_seq, self.head_dim)
        for i, layer in enumerate(model.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            tensors = dict(
                input_norm=layer.input_layernorm.weight.detach(),
                post_norm=layer.post_attention_layernorm.weight.detach(),
                wqkv=_concat(attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight),
                bqkv=_concat(attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias),
                wo=attn.o_proj.weight.detach(),
                bo=None if attn.o_proj.bias is None else attn.o_proj.bias.detach(),
                w_gate_up=_concat(mlp.gate_proj.weight, mlp.up_proj.weight),
                w_down=mlp.down_proj.weight.detach(),
                q_norm=attn.q_norm.weight.detach() if self.qk_norm else None,
                k_norm=attn.k_norm.weight.detach() if self.qk_norm else None,
                k_cache=torch.zeros(cache_shape, dtype=dtype, device=device),
                v_cache=torch.zeros(cache_shape, dtype=dtype, device=device),
            )
            for name, t in tensors.items():
                self.register_buffer(f"{name}_{i}", t, persistent=False)

        # HF's own RoPE tables (its scaling rules), as HF rounds them: [max_seq, head_dim].
        positions = torch.arange(max_seq, device=device)
        cos, sin = model.model.rotary_emb(torch.empty(1, dtype=dtype, device=device), positions[None])
        self.register_buffer("cos", cos[0], persistent=False)
        self.register_buffer("sin", sin[0], persistent=False)
        self.register_buffer("positions", positions, persistent=False)
        # Both compile modes gpt-fast offers end in CUDA graphs; None runs the step eagerly.
        self.step = self.decode_step if compile_mode is None else \
            torch.compile(self.decode_step, mode=compile_mode, fullgraph=True)

    def _layer(self, name: str, i: int) -> torch.Tensor | None:
        return getattr(self, f"{name}_{i}")

    def _attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """q [B, Hq, T, D] over the caches [B, Hkv, S, D] where mask [T, S] -> [B, Hq, T, D].
        Each kv head's G query heads are G x T rows of one matmul: GQA without repeating K/V."""
        B, Hq, T, D = q.shape
        Hkv = k_cache.shape[1]
        G = Hq // Hkv
        scores = q.reshape(B, Hkv, G * T, D) @ k_cache.transpose(-1, -2)  # [B, Hkv, G T, S]
        scores = scores.float() * D**-0.5
        scores = scores.masked_fill(~mask.repeat(G, 1), float("-inf"))
        probs = scores.softmax(dim=-1).to(q.dtype)
        return (probs @ v_cache).view(B, Hq, T, D)

    def forward_tokens(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """ids [B, T] at positions pos [T] (int64) -> logits of the last position [B, V]."""
        B, T = ids.shape
        Hq, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        cos, sin = self.cos[pos][None, None], self.sin[pos][None, None]  # [1, 1, T, D]
        mask = self.positions[None, :] <= pos[:, None]  # [T, max_seq]: what each position sees
        x = F.embedding(ids, self.embed)  # [B, T, H]
        for i in range(self.num_layers):
            h = _rms_norm(x, self._layer("input_norm", i), self.eps)
            qkv = F.linear(h, self._layer("wqkv", i), self._layer("bqkv", i))  # [B, T, (Hq + 2 Hkv) D]
            q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
            q = q.view(B, T, Hq, D)
            k = k.view(B, T, Hkv, D)
            if self.qk_norm:
                q = _rms_norm(q, self._layer("q_norm", i), self.eps)
                k = _rms_norm(k, self._layer("k_norm", i), self.eps)
            q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, H, T, D]
            v = v.view(B, T, Hkv, D).transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            k_cache, v_cache = self._layer("k_cache", i), self._layer("v_cache", i)
            k_cache.index_copy_(2, pos, k)
            v_cache.index_copy_(2, pos, v)
            o = self._attend(q, k_cache, v_cache, mask)
            x = x + F.linear(o.transpose(1, 2).reshape(B, T, Hq * D), self._layer("wo", i),
                             self._layer("bo", i))
            h = _rms_norm(x, self._layer("post_norm", i), self.eps)
            gate, up = F.linear(h, self._layer("w_gate_up", i)).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, self._layer("w_down", i))
        return F.linear(_rms_norm(x[:, -1], self.norm, self.eps), self.lm_head)

    def decode_step(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """ids [B, 1] at position pos [1] -> the greedy next ids [B, 1]."""
        return self.forward_tokens(ids, pos).argmax(dim=-1, keepdim=True)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy: input_ids [B, T] -> new tokens [B, max_new_tokens]."""
        B, T = input_ids.shape
        if B != self.batch:
            raise ValueError(f"StaticCacheDecoder: built for batch {self.batch}, got {B}")
        if input_ids.device != self.embed.device:
            raise ValueError(f"StaticCacheDecoder: input_ids are on {input_ids.device}, the model on "
                             f"{self.embed.device}")
        if max_new_tokens < 1:
            raise ValueError(f"StaticCacheDecoder: max_new_tokens must be >= 1, got {max_new_tokens}")
        if T + max_new_tokens - 1 > self.max_seq:
            raise ValueError(f"StaticCacheDecoder: prompt {T} + {max_new_tokens} new tokens needs "
                             f"max_seq >= {T + max_new_tokens - 1}, built with {self.max_seq}")
        pos = torch.arange(T, device=input_ids.device)
        token = self.forward_tokens(input_ids, pos).argmax(dim=-1, keepdim=True)
        tokens = [token]
        step_pos = torch.tensor([T], device=input_ids.device)
        for _ in range(max_new_tokens - 1):
            # The graph's output buffer is rewritten by the next replay: keep a copy.
            torch.compiler.cudagraph_mark_step_begin()
            token = self.step(token, step_pos).clone()
            tokens.append(token)
            step_pos += 1
        return torch.cat(tokens, dim=1)
