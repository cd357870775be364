"""One rank of a tensor-parallel test run (torch.multiprocessing.spawn calls `run` per rank).

Each rank builds the same tiny model (same seed), asks HF for its greedy tokens, shards the model
with pagedkv.tensor_parallel and runs pagedkv.generate; it saves what it got for the parent test
to compare across ranks and against HF.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import pagedkv
from models import tiny_model

LENGTHS = [5, 17, 1, 33]  # ragged, left-padded; 33 crosses two 16-token blocks


def left_padded(lengths: list[int], vocab: int, device: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.int64)
    mask = torch.zeros(len(lengths), width, dtype=torch.int64)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(3, vocab, (n,), generator=generator)
        mask[row, width - n:] = 1
    return ids.to(device), mask.to(device)


def _start(rank: int, world_size: int, init_file: str, backend: str, device: str) -> None:
    if device == "cuda":
        torch.cuda.set_device(rank)  # one GPU per rank ("cuda" below is this rank's)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size)


def run(rank: int, world_size: int, init_file: str, archs: list[str], out_dir: str,
        backend: str = "gloo", device: str = "cpu", dtype: torch.dtype = torch.float32,
        graphs: bool | None = None, all_reduce: str = "auto") -> None:
    _start(rank, world_size, init_file, backend, device)
    try:
        results = {}
        for arch in archs:
            model = tiny_model(arch, dtype=dtype, device=device)
            ids, mask = left_padded(LENGTHS, model.config.vocab_size, device, seed=1)
            greedy = dict(max_new_tokens=20, do_sample=False, eos_token_id=None)
            hf = model.generate(ids, attention_mask=mask, **greedy).cpu()
            plain = pagedkv.generate(tiny_model(arch, dtype=dtype, device=device), ids, attention_mask=mask,
                                     use_cuda_graphs=graphs, **greedy).cpu()
            pagedkv.tensor_parallel(model, device=device, all_reduce=all_reduce)
            tp = pagedkv.generate(model, ids, attention_mask=mask, use_cuda_graphs=graphs, **greedy).cpu()
            torch.manual_seed(100 + rank)  # each rank's own RNG: the first rank's seeds must win
            sampled = pagedkv.generate(model, ids, attention_mask=mask, max_new_tokens=12, do_sample=True,
                                       top_k=50, use_cuda_graphs=graphs).cpu()
            cache = pagedkv.kv_cache_of(model)
            results[arch] = dict(hf=hf, plain=plain, tp=tp, sampled=sampled,
                                 kv_heads=cache.spec.num_kv_heads, model_kv_heads=model.config.num_key_value_heads)
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_mismatch(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    """Rank 1 asks for a different max_new_tokens: both ranks must refuse with ValueError."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        model = pagedkv.tensor_parallel(tiny_model("llama"), device="cpu")
        ids, mask = left_padded([4, 6], model.config.vocab_size, "cpu", seed=2)
        error = ""
        try:
            pagedkv.generate(model, ids, attention_mask=mask, max_new_tokens=5 + rank, do_sample=False)
        except ValueError as e:
            error = str(e)
        # The group still works after the refusal: a matching call runs.
        out = pagedkv.generate(model, ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
        torch.save(dict(error=error, out=out), f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_engine(rank: int, world_size: int, init_file: str, archs: list[str], out_dir: str,
               backend: str = "gloo", device: str = "cpu", dtype: torch.dtype = torch.float32,
               all_reduce: str = "auto") -> None:
    """pagedkv.LLM on a sharded model: chunked prefills (32 tokens a step), a shared prefix, ranks
    asking for different cache budgets (the engine takes the smallest), sampled requests without
    seeds (the generator differs per rank until the engine agrees on rank 0's)."""
    import random

    _start(rank, world_size, init_file, backend, device)
    try:
        results = {}
        generator = torch.Generator().manual_seed(3)
        shared = torch.randint(3, 256, (20,), generator=generator).tolist()
        prompts = [shared + torch.randint(3, 256, (n,), generator=generator).tolist() for n in (5, 40, 1, 70)]
        prompts.append(torch.randint(3, 256, (9,), generator=generator).tolist())
        greedy = pagedkv.SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        sampled = pagedkv.SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, ignore_eos=True)
        options = dict(max_num_seqs=4, max_num_batched_tokens=32)
        for arch in archs:
            plain = pagedkv.LLM(tiny_model(arch, dtype=dtype, device=device), num_kv_blocks=12, **options)
            expected = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy)]
            random.seed(rank)
            sharded = pagedkv.tensor_parallel(tiny_model(arch, dtype=dtype, device=device), device=device,
                                              all_reduce=all_reduce)
            llm = pagedkv.LLM(sharded, kv_cache_memory=(12 + 4 * rank) * plain.cache.spec.bytes_per_block // world_size,
                              **options)
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
            drawn = [o.outputs[0].token_ids for o in llm.generate(prompts, sampled)]
            results[arch] = dict(expected=expected, got=got, sampled=drawn, blocks=llm.cache.num_blocks,
                                 preemptions=llm.stats.num_preemptions,
                                 cached_tokens=llm.stats.num_cached_prompt_tokens)
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def engine_prompts() -> list[list[int]]:
    """pagedkv.LLM prompts of several lengths (40: a prefill chunked at 32 tokens a step)."""
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(3, 256, (n,), generator=generator).tolist() for n in (5, 40, 1, 19)]


def run_checkpoint(rank: int, world_size: int, init_file: str, paths: dict[str, str], out_dir: str,
                   backend: str = "gloo", device: str = "cpu", dtype: torch.dtype = torch.float32) -> None:
    """Each rank reads its shard of each checkpoint (pagedkv.tensor_parallel_from_pretrained) and
    saves the greedy tokens of generate, of the patched model.generate and of LLM, and what HF's
    own generate and forward say on the empty skeleton; on CUDA also the tokens of the whole
    checkpoint on this GPU (from_pretrained)."""
    from transformers import AutoModelForCausalLM

    _start(rank, world_size, init_file, backend, device)
    try:
        results = {}
        greedy = dict(max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
        params = pagedkv.SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        options = dict(num_kv_blocks=24, max_num_seqs=4, max_num_batched_tokens=32)
        for arch, path in paths.items():
            model = pagedkv.tensor_parallel_from_pretrained(path, dtype=dtype, device=device)
            ids, mask = left_padded(LENGTHS, model.config.vocab_size, device, seed=1)
            result = dict(generate=pagedkv.generate(model, ids, attention_mask=mask, **greedy).cpu(),
                          kv_heads=pagedkv.kv_cache_of(model).spec.num_kv_heads)
            llm = pagedkv.LLM(model, **options)
            result["llm"] = [o.outputs[0].token_ids for o in llm.generate(engine_prompts(), params, use_tqdm=False)]
            for what, call in (("hf_generate", lambda: model.generate(ids, attention_mask=mask, **greedy)),
                               ("hf_forward", lambda: model(ids))):
                try:
                    call()
                    result[what] = ""
                except RuntimeError as error:
                    result[what] = str(error)
            result["patched"] = pagedkv.patch(model).generate(ids, attention_mask=mask, **greedy).cpu()
            if device == "cuda":
                whole = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
                result["whole"] = pagedkv.generate(whole, ids, attention_mask=mask, **greedy).cpu()
                outs = pagedkv.LLM(whole, **options).generate(engine_prompts(), params, use_tqdm=False)
                result["whole_llm"] = [o.outputs[0].token_ids for o in outs]
            results[arch] = result
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_request_mismatch(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    """pagedkv.LLM on a sharded model, ranks adding different requests: another prompt, other
    SamplingParams, another request id, a batch with another prompt, a prompt that only one rank
    finds bad. Each must raise on every rank and queue nothing; a matching request then runs."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        model = pagedkv.tensor_parallel(tiny_model("llama"), device="cpu")
        llm = pagedkv.LLM(model, num_kv_blocks=16, max_num_seqs=2, max_num_batched_tokens=32)
        prompt = [5, 6, 7, 8]
        greedy = pagedkv.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        calls = [
            lambda: llm.add_request(prompt + [9 + rank], greedy),
            lambda: llm.add_request(prompt, pagedkv.SamplingParams(max_tokens=6, temperature=rank / 2)),
            lambda: llm.add_request(prompt, greedy, request_id=f"mine{rank}"),
            lambda: llm.generate([prompt, prompt[:2 + rank]], greedy, use_tqdm=False),
            lambda: list(llm.stream([prompt], [greedy if rank == 0 else pagedkv.SamplingParams(max_tokens=3)])),
            lambda: llm.add_request(prompt if rank == 0 else [10**6], greedy),  # out of the vocabulary
        ]
        errors = []
        for call in calls:
            try:
                call()
                errors.append("")
            except ValueError as error:
                errors.append(str(error))
        queued = llm.has_unfinished_requests()
        request_id = llm.add_request(prompt, greedy)
        outputs = []
        while llm.has_unfinished_requests():
            outputs += [o for o in llm.step() if o.finished]
        batch = llm.generate([prompt, prompt[:3]], greedy, use_tqdm=False)
        torch.save(dict(errors=errors, queued=queued, request_id=request_id,
                        tokens=[o.outputs[0].token_ids for o in outputs],
                        batch=[o.outputs[0].token_ids for o in batch], free=llm.cache.num_free_blocks,
                        blocks=llm.cache.num_blocks), f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()
