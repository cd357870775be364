"""HF model types whose decoder is Llama's under another name (or with QKV and gate/up stored
fused, Phi-3): pagedkv runs them and gives HF's greedy tokens through generate, LLM and
tensor parallelism; types that differ (another norm, rotary layout, activation, extra scales)
are refused naming what differs. Types missing from the installed transformers are skipped."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

import pagedkv
import tp_worker
from tolerance import assert_tokens_equal_up_to_near_tie
from models import _COMMON, random_model
from pagedkv.models import registry
from pagedkv.models.checkpoint_shards import open_checkpoint, read_shard
from pagedkv.models.llama import extract_weights
from pagedkv.models.sharding import shard_weights
from test_engine import assert_llm_gives_hf_greedy_tokens, random_prompts
from test_tp_checkpoint import assert_same_weights

# name -> (model_type, config fields beyond _COMMON): what each case exercises in the comment.
ADDED = {
    "phi3": ("phi3", {}),  # qkv_proj and gate_up_proj stored fused
    # Phi-4-mini's shape: rotary over 3/4 of each head, tied LM head
    "phi3_partial_tied": ("phi3", dict(partial_rotary_factor=0.75, tie_word_embeddings=True)),
    "ministral": ("ministral", dict(sliding_window=512, head_dim=64)),  # every layer "sliding_attention"
    "cwm": ("cwm", dict(sliding_window=512)),  # full and sliding layers mixed, llama3 rope
    "seed_oss": ("seed_oss", dict(head_dim=64, attention_bias=True, attention_out_bias=False)),
    "internlm3": ("internlm3", dict(head_dim=64)),  # LlamaForCausalLM with its own config
    "iquestcoder": ("iquestcoder", dict(head_dim=64)),
    # sliding layers within their window equal full ones (was refused before)
    "qwen2_sliding": ("qwen2", dict(use_sliding_window=True, max_window_layers=1, sliding_window=512)),
}

# model_type -> words the refusal must contain (read from each type's modeling file).
REFUSED = {
    "hunyuan_v1_dense": "after the rotary",
    "smollm3": "NoPE",
    "ministral3": "llama_4_scaling",
    "hyperclovax": "multiplier",
    "exaone4": "after the attention and MLP",
    "arcee": "no gate",
    "jais2": "LayerNorm",
    "apertus": "xIELU",
    "olmo": "LayerNorm",
    "youtu": "latent attention",
}
FIELDS = {"hunyuan_v1_dense": dict(head_dim=128)}  # its default config leaves head_dim None


def available(model_type: str) -> None:
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"model_type {model_type!r} is not in transformers here")


def tiny(name: str, device: str = "cpu", seed: int = 0):
    """A tiny random fp32 model of ADDED[name], weights widened as tests/models.py's tiny_model."""
    model_type, fields = ADDED[name]
    available(model_type)
    return random_model(model_type, {**_COMMON, **fields}, device, seed=seed)


def left_padded(lengths: list[int], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    return tp_worker.left_padded(lengths, 256, device, seed=1)


GREEDY = dict(max_new_tokens=24, do_sample=False, eos_token_id=None)


@pytest.mark.parametrize("name", list(ADDED))
def test_generate_gives_hf_greedy_tokens(name):
    model = tiny(name)
    assert pagedkv.supports(model), pagedkv.unsupported_reason(model)
    ids, mask = left_padded([5, 19], "cpu")
    expected = model.generate(ids, attention_mask=mask, **GREEDY)
    assert torch.equal(pagedkv.generate(model, ids, attention_mask=mask, **GREEDY), expected)


@pytest.mark.parametrize("name", list(ADDED))
def test_llm_gives_hf_greedy_tokens(name):
    model = tiny(name)
    prompts = random_prompts([5, 19])
    assert_llm_gives_hf_greedy_tokens(pagedkv.LLM(model, max_num_seqs=2), model, prompts, dict(GREEDY, pad_token_id=0))


@pytest.mark.cuda
@pytest.mark.parametrize("name", list(ADDED))
def test_bf16_on_gpu_agrees_with_hf(name):
    """bf16 on the GPU: equal tokens up to the first near-tie of HF's logits."""
    model = tiny(name, "cuda").to(torch.bfloat16)
    ids, mask = left_padded([5, 19], "cuda")
    hf = model.generate(ids, attention_mask=mask, output_logits=True, return_dict_in_generate=True, **GREEDY)
    got = pagedkv.generate(model, ids, attention_mask=mask, **GREEDY)
    assert_tokens_equal_up_to_near_tie(got, hf, ids.shape[1])


# Types that run by their own HF modules instead (tests/test_fallback.py) are no longer refused.
@pytest.mark.parametrize("model_type, words", [(t, w) for t, w in REFUSED.items()
                                              if t not in registry.FALLBACK_MODEL_TYPES])
def test_other_decoders_are_refused_naming_what_differs(model_type, words):
    available(model_type)
    with torch.device("meta"):  # the reason comes from the type and config: no weights needed
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, num_hidden_layers=1,
                                                                    **FIELDS.get(model_type, {})))
    reason = pagedkv.unsupported_reason(model)
    assert reason is not None and model_type in reason and words in reason, reason
    with pytest.raises(pagedkv.UnsupportedModel, match=model_type):
        pagedkv.generate(model, torch.tensor([[3, 4]]), max_new_tokens=2)


@pytest.mark.parametrize("name", ["phi3", "cwm", "internlm3"])
def test_checkpoint_shards_equal_shard_weights(tmp_path, name):
    """A rank's shard read from the checkpoint (Phi-3: its rows of the fused tensors as stored)
    equals the shard of the loaded model's weights."""
    model = tiny(name)
    model.save_pretrained(tmp_path, max_shard_size="300KB")
    skeleton, reader = open_checkpoint(tmp_path, torch.float32)
    full = extract_weights(model)
    for rank in range(2):
        assert_same_weights(read_shard(skeleton, reader, rank, 2, torch.device("cpu"), torch.float32),
                            shard_weights(full, rank, 2, torch.device("cpu")))


def run_ranks(rank: int, world_size: int, init_file: str, names: list[str], out_dir: str) -> None:
    """One gloo rank: each model sharded by tensor_parallel, and read from its checkpoint."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        results = {}
        ids, mask = left_padded([5, 19], "cpu")
        for name in names:
            sharded = pagedkv.tensor_parallel(tiny(name), device="cpu")
            read = pagedkv.tensor_parallel_from_pretrained(f"{out_dir}/{name}", torch.float32, device="cpu")
            results[name] = [pagedkv.generate(m, ids, attention_mask=mask, **GREEDY) for m in (sharded, read)]
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_ranks_give_hf_greedy_tokens(tmp_path):
    import torch.multiprocessing as mp

    names = ["phi3_partial_tied", "cwm", "seed_oss", "internlm3"]
    names = [n for n in names if ADDED[n][0] in CONFIG_MAPPING]
    ids, mask = left_padded([5, 19], "cpu")
    expected = {}
    for name in names:
        model = tiny(name)
        model.save_pretrained(tmp_path / name, max_shard_size="300KB")
        expected[name] = model.generate(ids, attention_mask=mask, **GREEDY)
    mp.spawn(run_ranks, args=(2, str(tmp_path / "rendezvous"), names, str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for name in names:
            assert torch.equal(got[name][0], expected[name]), (rank, name, "tensor_parallel")
            assert torch.equal(got[name][1], expected[name]), (rank, name, "from checkpoint")


@pytest.mark.cuda
def test_sliding_layers_run_past_their_window_on_cuda():
    """CWM's sliding layers on CUDA (refused past the window until the CUDA attention kernels
    took sliding_window): fp32 greedy tokens past the window equal HF's."""
    model = tiny("cwm", "cuda")
    model.config.sliding_window = 16
    ids = torch.tensor([[3, 7, 11, 5, 9, 2, 8, 4, 6, 10]], device="cuda")
    expected = model.generate(ids, **GREEDY)
    assert torch.equal(pagedkv.generate(model, ids, **GREEDY), expected)
