"""pagedkv.LLM: continuous batching of many requests on the model runner."""

from pagedkv.engine.llm import LLM
from pagedkv.engine.outputs import CompletionOutput, EngineStats, Logprob, RequestMetrics, RequestOutput
from pagedkv.engine.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineStats", "Logprob", "RequestMetrics", "RequestOutput",
           "SamplingParams"]
