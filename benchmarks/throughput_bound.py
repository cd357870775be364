"""The fastest W2 can possibly run on a device: a lower bound on its time, from bytes and FLOPs.

Decode: every step reads the weights once and each running sequence's K/V once (at the cache's
element size: 1 byte for an fp8 cache), at the device's measured copy bandwidth (bytes read +
written by a large device-to-device copy, as the W1 roofline counts it). The bound assumes the
best schedule: every request runs from the first step (so the weight reads are shared by the
most sequences) and none is ever preempted.
Prefill: the prompts' matmul and causal-attention FLOPs at the measured bf16 matmul rate.
"""

from __future__ import annotations

import torch


def matmul_tflops(device: str, n: int = 8192, repeats: int = 10) -> float:
    """bf16 dense matmul rate of this device (one n x n x n product, median of `repeats`)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * n**3 / sorted(times)[len(times) // 2] / 1e12


def w2_bound_seconds(model, prompts: list[list[int]], max_tokens: list[int], copy_gbs: float,
                     tflops: float, kv_element_size: int | None = None) -> tuple[float, float]:
    """(decode seconds, prefill seconds) at best for the workload on `model` (an HF model).
    kv_element_size: bytes per cached K/V element (1: an fp8 cache); None: the model dtype's."""
    config = model.config
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied: once
    kv_element_size = kv_element_size or next(model.parameters()).element_size()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_bytes_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * kv_element_size
    # Step t (1-based) runs every request with max_tokens >= t; each reads its prompt + t tokens.
    decode_bytes = 0
    for t in range(1, max(max_tokens) + 1):
        running = [len(p) for p, m in zip(prompts, max_tokens) if m >= t]
        decode_bytes += weight_bytes + kv_bytes_per_token * (sum(running) + t * len(running))
    embedding = config.vocab_size * config.hidden_size
    matmul_params = sum(p.numel() for p in model.parameters()) - embedding  # the LM head reads it
    flops = 0.0
    for prompt in prompts:
        n = len(prompt)
        flops += 2 * matmul_params * n + 2 * embedding  # layers for every token, the LM head once
        flops += 2 * 2 * config.num_hidden_layers * config.num_attention_heads * head_dim * n * n / 2
    return decode_bytes / (copy_gbs * 1e9), flops / (tflops * 1e12)
