"""The one runtime under generate() and pagedkv.LLM: a prepared model (weights taken once), the
model runner that executes steps over a KV cache, the only CUDA-graph manager, the one sampler,
and generate()'s fixed batch that advances its own metadata on the device."""

from pagedkv.runtime.model import ModelChanged, PreparedModel, prepared, tensor_parallel, tensor_parallel_from_pretrained
from pagedkv.runtime.quantized import from_pretrained_quantized
from pagedkv.runtime.runner import ModelRunner, StepInput

__all__ = ["ModelChanged", "ModelRunner", "PreparedModel", "StepInput", "from_pretrained_quantized", "prepared", "tensor_parallel",
           "tensor_parallel_from_pretrained"]
