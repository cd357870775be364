"""pagedkv: paged KV cache and fused decode kernels for Hugging Face causal LMs."""

import logging

# The library logs under "pagedkv.<module>" and never configures logging: the application does
# (e.g. logging.basicConfig(level=logging.INFO) shows weights taken, cache size, graphs captured).
logging.getLogger(__name__).addHandler(logging.NullHandler())

from pagedkv._ext import _C
from pagedkv import ops
from pagedkv.cache import CacheFull, KVCache, KVCacheSpec, StepMetadata
from pagedkv.models import UnsupportedModel, support_path, supports, unsupported_reason
from pagedkv.runtime import ModelChanged, from_pretrained_quantized, tensor_parallel, tensor_parallel_from_pretrained
from pagedkv.hf import UnsupportedGenerationArgument, generate, kv_cache_of, patch, unpatch
from pagedkv.engine import LLM, CompletionOutput, EngineStats, RequestMetrics, RequestOutput, SamplingParams

__version__ = "0.1.0"  # the one place it is written: pyproject.toml reads it from here

build_info: str = _C.build_info
"""What the extension was built with, e.g. ``CPU + CUDA (archs 80;90, torch 2.14.1+cu130, ...)``."""

with_cuda: bool = _C.with_cuda
"""True when the CUDA kernels were compiled in."""

__all__ = ["generate", "patch", "unpatch", "kv_cache_of", "tensor_parallel", "tensor_parallel_from_pretrained", "from_pretrained_quantized", "LLM", "SamplingParams", "RequestOutput",
           "CompletionOutput", "RequestMetrics", "EngineStats", "supports", "support_path", "unsupported_reason", "UnsupportedModel", "ModelChanged",
           "UnsupportedGenerationArgument", "ops", "KVCache", "KVCacheSpec", "CacheFull",
           "StepMetadata", "build_info", "with_cuda", "__version__"]
