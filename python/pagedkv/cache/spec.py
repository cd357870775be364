"""What one cache block costs for a model, and how many blocks a memory budget buys."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """The shape of a model's KV cache. One block holds K and V of ``block_size`` tokens in every
    layer: ``2 * num_layers * block_size * num_kv_heads * head_dim`` elements of ``dtype``."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16
    block_size: int = 16

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"pagedkv: KVCacheSpec.{name} must be a positive int, got {value!r}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"pagedkv: block_size must be a power of two (e.g. 16), got {self.block_size}")
        if not self.dtype.is_floating_point:
            raise ValueError(f"pagedkv: the cache dtype must be a floating type, got {self.dtype}")

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.bytes_per_token

    @classmethod
    def from_hf_config(cls, config, *, dtype: torch.dtype | None = None, block_size: int = 16) -> KVCacheSpec:
        """From a transformers ``PretrainedConfig`` (its text part for multimodal models):
        ``num_hidden_layers``, ``num_key_value_heads`` (else ``num_attention_heads``), ``head_dim``
        (else ``hidden_size // num_attention_heads``). dtype: the config's ``dtype`` when None,
        else torch's default dtype."""
        if hasattr(config, "get_text_config"):
            config = config.get_text_config()
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        if dtype is None:
            dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
            dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype or torch.get_default_dtype()
        return cls(
            num_layers=config.num_hidden_layers,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            dtype=dtype,
            block_size=block_size,
        )


def num_blocks_for(
    spec: KVCacheSpec,
    device: torch.device,
    *,
    num_blocks: int | None = None,
    memory_bytes: int | None = None,
    memory_fraction: float | None = None,
) -> int:
    """The cache size from exactly one of: a block count, a byte budget, or a fraction of the
    CUDA memory a new cache could take now (free_memory_bytes: free device memory plus what
    torch's caching allocator holds unused, as the runner's memory check counts it)."""
    given = [name for name, v in [("num_blocks", num_blocks), ("memory_bytes", memory_bytes),
                                  ("memory_fraction", memory_fraction)] if v is not None]
    if len(given) != 1:
        raise ValueError(
            "pagedkv: size the cache with exactly one of num_blocks=, memory_bytes= or "
            f"memory_fraction=; got {', '.join(given) or 'none'}"
        )
    if num_blocks is not None:
        return num_blocks
    if memory_fraction is not None:
        if device.type != "cuda":
            raise ValueError(
                f"pagedkv: memory_fraction= sizes the cache from free CUDA memory, but the device is "
                f"{device}; on it pass num_blocks= or memory_bytes= instead"
            )
        if not 0 < memory_fraction <= 1:
            raise ValueError(f"pagedkv: memory_fraction must be in (0, 1], got {memory_fraction}")
        # A freed cache stays reserved in torch's allocator as one segment of its own size, which
        # free_memory_bytes counts as available; a new cache a little larger than it (the budget
        # grows as other memory is freed) cannot use it and would need device memory that is not
        # free. Handing the unused segments back first makes what is counted what can be taken.
        torch.cuda.empty_cache()
        available = free_memory_bytes(device)
        memory_bytes = int(available * memory_fraction)
        logger.debug("cache budget: %.3g GB, %s of the %.3g GB available on %s", memory_bytes / 1e9,
                     memory_fraction, available / 1e9, device)
    # Slots (block * block_size + offset) are int32: a larger budget than 2**31 - 1 slots is
    # not spent, rather than refused.
    blocks = min(memory_bytes // spec.bytes_per_block, (2**31 - 1) // spec.block_size)
    logger.debug("%d bytes buy %d blocks of %d bytes", memory_bytes, blocks, spec.bytes_per_block)
    if blocks < 1:
        raise ValueError(
            f"pagedkv: {memory_bytes} bytes hold no cache block: one block of {spec.block_size} "
            f"tokens takes {spec.bytes_per_block} bytes for this model"
        )
    return blocks


def free_memory_bytes(device: torch.device) -> int | None:
    """Bytes a new cache could take on the device now, or None where it cannot be told. CUDA:
    free device memory plus what torch's caching allocator holds unused; CPU: the kernel's
    MemAvailable (Linux)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
    return None


def cache_sizing(kv_cache_memory: int | float | None, num_kv_blocks: int | None,
                 device: torch.device) -> dict:
    """pagedkv.LLM's cache arguments as KVCache's one sizing keyword: num_kv_blocks, or
    kv_cache_memory as bytes (int) or a fraction of the available CUDA memory (float); by default
    0.9 on CUDA, 256 MiB on the CPU."""
    if kv_cache_memory is not None and num_kv_blocks is not None:
        raise ValueError("pagedkv.LLM: give kv_cache_memory or num_kv_blocks, not both")
    if num_kv_blocks is not None:
        return {"num_blocks": num_kv_blocks}
    if kv_cache_memory is None:
        kv_cache_memory = 0.9 if device.type == "cuda" else 256 << 20
    if isinstance(kv_cache_memory, float):
        return {"memory_fraction": kv_cache_memory}
    return {"memory_bytes": int(kv_cache_memory)}
