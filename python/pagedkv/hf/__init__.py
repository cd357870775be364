"""For HF users: pagedkv.generate (HF's generate() arguments, same greedy tokens) and patch."""

from pagedkv.hf.generate import generate, kv_cache_of
from pagedkv.hf.generation_config import UnsupportedGenerationArgument
from pagedkv.hf.patch import patch, unpatch

__all__ = ["UnsupportedGenerationArgument", "generate", "kv_cache_of", "patch", "unpatch"]
