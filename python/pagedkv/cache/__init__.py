"""The paged KV cache: K/V tensors on the device, the C++ manager deciding which block holds which
tokens, and the step metadata it builds (the only place pagedkv builds step metadata)."""

from pagedkv.cache.kv_cache import PENDING_TOKEN, CacheFull, KVCache
from pagedkv.cache.spec import KVCacheSpec, free_memory_bytes, num_blocks_for
from pagedkv.cache.step_metadata import StepMetadata

__all__ = ["PENDING_TOKEN", "CacheFull", "KVCache", "KVCacheSpec", "StepMetadata", "free_memory_bytes", "num_blocks_for"]
