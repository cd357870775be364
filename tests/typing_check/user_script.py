"""A user's script over pagedkv's public API, type-checked (never run) by tests/test_typing.py.
Each assert_type is what a user's type checker must see; a wrong or missing annotation (or a
missing py.typed, which makes every pagedkv name Any) fails the check."""

from __future__ import annotations

from typing import Iterator, assert_type

import torch
from transformers import LlamaForCausalLM, PreTrainedModel
from transformers.generation.utils import GenerateBeamDecoderOnlyOutput, GenerateDecoderOnlyOutput

import pagedkv
from pagedkv import LLM, CompletionOutput, EngineStats, KVCache, KVCacheSpec, RequestOutput, SamplingParams

model = LlamaForCausalLM.from_pretrained("a/local/folder")
ids = torch.tensor([[1, 2, 3]])

# generate: a tensor, as HF's, or its output object when asked for one.
assert_type(pagedkv.generate(model, ids, max_new_tokens=8), torch.Tensor)
# (the beam output for num_beams > 1: HF's own split, which the argument's value decides)
assert_type(pagedkv.generate(model, ids, max_new_tokens=8, return_dict_in_generate=True),
            GenerateDecoderOnlyOutput | GenerateBeamDecoderOnlyOutput)
sequences = pagedkv.generate(model, ids, attention_mask=torch.ones_like(ids), do_sample=False)
assert_type(sequences[:, ids.shape[1]:].tolist(), list)

# patch / unpatch keep the model's own type.
assert_type(pagedkv.patch(model), LlamaForCausalLM)
assert_type(pagedkv.unpatch(model), LlamaForCausalLM)
cache = pagedkv.kv_cache_of(model)
assert_type(cache, KVCache | None)
if cache is not None:
    assert_type(cache.num_free_blocks, int)
    assert_type(cache.block_table(0), list[int])
spec = KVCacheSpec.from_hf_config(model.config)
assert_type(spec.bytes_per_block, int)
assert_type(pagedkv.supports(model), bool)
assert_type(pagedkv.unsupported_reason(model), str | None)
assert_type(pagedkv.tensor_parallel(model), LlamaForCausalLM)
assert_type(pagedkv.tensor_parallel_from_pretrained("a/local/folder"), PreTrainedModel)

# The engine.
llm = LLM(model, max_num_seqs=4, num_kv_blocks=64)
outs = llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0))
assert_type(outs, list[RequestOutput])
completion = outs[0].outputs[0]
assert_type(completion, CompletionOutput)
assert_type(completion.text, str | None)
assert_type(completion.token_ids, list[int])
assert_type(completion.finish_reason, str | None)
assert_type(outs[0].text, str | None)
assert_type(llm.add_request([1, 2, 3]), str)
assert_type(llm.step(), list[RequestOutput])
assert_type(llm.has_unfinished_requests(), bool)
assert_type(llm.stream("Hello"), Iterator[RequestOutput])
assert_type(llm.abort_request("0"), None)
assert_type(llm.cache, KVCache)
assert_type(llm.stats, EngineStats)

assert_type(pagedkv.__version__, str)
assert_type(pagedkv.build_info, str)
assert_type(pagedkv.with_cuda, bool)
