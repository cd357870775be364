"""Mixture of experts natively (layers/moe.py): the two expert ops against plain PyTorch over a
grid, and tiny random Mixtral / Qwen2-MoE / Qwen3-MoE models with each one's routing (top-k,
renormalisation both ways, a shared expert with its sigmoid gate, dense layers between MoE ones)
giving HF's greedy tokens through pagedkv.generate and pagedkv.LLM."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import pagedkv
import tp_worker
from conftest import DEVICES
from models import _COMMON, random_model
from pagedkv.layers import moe
from pagedkv.models.registry import UnsupportedModel
from pagedkv.runtime.model import prepared, weight_bytes
from test_engine import assert_llm_gives_hf_greedy_tokens, random_prompts
from tolerance import assert_close_to_baseline, assert_tokens_equal_up_to_near_tie

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
NUM_TOKENS = [1, 3, 17]
EXPERTS_TOP_K = [(4, 1), (8, 2), (16, 8)]
SIZES = [(64, 32), (60, 50)]  # (hidden, intermediate); 60 takes the kernels' scalar path


# name -> (model_type, config fields beyond _COMMON): what each case exercises in the comment.
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=96)
CASES = {
    # top-2 of 8, always renormalised, top-k weights kept in fp32
    "mixtral": ("mixtral", dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=96)),
    # a shared expert with its sigmoid gate, no renormalisation (the default), QKV bias
    "qwen2_moe": ("qwen2_moe", dict(MOE, shared_expert_intermediate_size=160)),
    "qwen2_moe_norm": ("qwen2_moe", dict(MOE, shared_expert_intermediate_size=160, norm_topk_prob=True)),
    # a dense MLP layer between MoE layers (mlp_only_layers), q/k norm, renormalised top-4
    "qwen3_moe": ("qwen3_moe", dict(MOE, num_experts_per_tok=4, num_hidden_layers=3, mlp_only_layers=[1],
                                    intermediate_size=192, norm_topk_prob=True, head_dim=64)),
    # every second layer MoE (decoder_sparse_step), no renormalisation
    "qwen3_moe_sparse_step": ("qwen3_moe", dict(MOE, num_hidden_layers=4, decoder_sparse_step=2,
                                                intermediate_size=192, norm_topk_prob=False)),
}
GREEDY = dict(max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
# The ways of running the experts: the kernels (decode, CUDA graphs) and grouped by expert, with
# torch's grouped GEMM or (where it does not run) one GEMM per hit expert.
PATHS = {"kernels": 10**9, "grouped": 0, "grouped_per_expert": 0}


def tiny(name: str, device: str = "cpu", seed: int = 0):
    model_type, fields = CASES[name]
    return random_model(model_type, {**_COMMON, **fields}, device, seed=seed)


# The ops ------------------------------------------------------------------------------------

def gate_up_reference(x, gate_up, ids):
    """HF's rounding: each projection in the dtype, silu(gate) rounded, times up rounded."""
    out = []
    for t in range(ids.shape[0]):
        rows = []
        for e in ids[t].tolist():
            gate, up = F.linear(x[t], gate_up[e]).chunk(2)
            rows.append(F.silu(gate) * up)
        out.append(torch.stack(rows))
    return torch.stack(out)


def down_sum_reference(act, down, ids, weights):
    """HF's grouped experts forward: expert outputs in the dtype, times weights in theirs, summed
    in fp32 (float64 for the reference run), rounded."""
    out = []
    for t in range(ids.shape[0]):
        ys = [F.linear(act[t, j], down[e]) for j, e in enumerate(ids[t].tolist())]
        weighted = torch.stack(ys) * weights[t].unsqueeze(-1)
        out.append(weighted.to(torch.float64 if act.dtype == torch.float64 else torch.float32).sum(0))
    return torch.stack(out).to(act.dtype)


def random_ids(num_tokens, num_experts, top_k, device):
    return torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(num_tokens)]).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("experts_top_k", EXPERTS_TOP_K)
@pytest.mark.parametrize("sizes", SIZES)
def test_moe_gate_up_silu(device, dtype, num_tokens, experts_top_k, sizes):
    (num_experts, top_k), (hidden, inter) = experts_top_k, sizes
    x = torch.randn(num_tokens, hidden, dtype=dtype, device=device)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, dtype=dtype, device=device) / hidden ** 0.5
    ids = random_ids(num_tokens, num_experts, top_k, device)
    out = torch.full((num_tokens, top_k, inter), float("nan"), dtype=dtype, device=device)
    moe.moe_gate_up_silu(x, gate_up, ids, out=out)
    assert_close_to_baseline(out, baseline=gate_up_reference(x, gate_up, ids),
                             reference=gate_up_reference(x.double(), gate_up.double(), ids))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("experts_top_k", EXPERTS_TOP_K)
@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("fp32_weights", [True, False])
def test_moe_down_sum(device, dtype, num_tokens, experts_top_k, sizes, fp32_weights):
    (num_experts, top_k), (hidden, inter) = experts_top_k, sizes
    act = torch.randn(num_tokens, top_k, inter, dtype=dtype, device=device)
    down = torch.randn(num_experts, hidden, inter, dtype=dtype, device=device) / inter ** 0.5
    ids = random_ids(num_tokens, num_experts, top_k, device)
    weights = torch.rand(num_tokens, top_k, device=device).to(torch.float32 if fp32_weights else dtype)
    out = torch.full((num_tokens, hidden), float("nan"), dtype=dtype, device=device)
    moe.moe_down_sum(act, down, ids, weights, out=out)
    assert_close_to_baseline(out, baseline=down_sum_reference(act, down, ids, weights),
                             reference=down_sum_reference(act.double(), down.double(), ids, weights.double()))


def grouped_weights(num_experts, top_k, hidden, inter, dtype, device) -> moe.MoEWeights:
    return moe.MoEWeights(
        router=torch.randn(num_experts, hidden, dtype=dtype, device=device),
        gate_up=torch.randn(num_experts, 2 * inter, hidden, dtype=dtype, device=device) / hidden ** 0.5,
        down=torch.randn(num_experts, hidden, inter, dtype=dtype, device=device) / inter ** 0.5,
        top_k=top_k, normalize=True, fp32_weights=False, shared_gate=None)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 17, 64])
@pytest.mark.parametrize("experts_top_k", EXPERTS_TOP_K)
@pytest.mark.parametrize("per_expert", [False, True])
def test_grouped_experts(device, dtype, num_tokens, experts_top_k, per_expert, monkeypatch):
    """Prefill's grouped experts (torch's grouped GEMM, or one GEMM per hit expert) against the
    per-pair reference: each projection in the dtype, HF's activation rounding, weighted, summed."""
    (num_experts, top_k), (hidden, inter) = experts_top_k, (64, 32)
    w = grouped_weights(num_experts, top_k, hidden, inter, dtype, device)
    x = torch.randn(num_tokens, hidden, dtype=dtype, device=device)
    ids = random_ids(num_tokens, num_experts, top_k, device)
    weights = torch.rand(num_tokens, top_k, device=device).to(dtype)
    if per_expert:
        monkeypatch.setattr(moe, "grouped_mm_runs", lambda x, w: False)
    out = moe._grouped_experts(x, w, ids, weights)

    def reference(x, gate_up, down, weights):
        return down_sum_reference(gate_up_reference(x, gate_up, ids), down, ids, weights)

    assert_close_to_baseline(out, baseline=reference(x, w.gate_up, w.down, weights),
                             reference=reference(x.double(), w.gate_up.double(), w.down.double(), weights.double()))


@pytest.mark.skipif(not hasattr(F, "grouped_mm"), reason="torch's grouped GEMM comes with torch 2.10")
def test_grouped_experts_take_torch_grouped_gemm_where_it_runs():
    cpu = grouped_weights(8, 2, 64, 32, torch.float32, "cpu")
    assert moe.grouped_mm_runs(torch.randn(3, 64), cpu)
    cpu.down = torch.randn(8 * 64 * 32 + 1)[1:].view(8, 64, 32)  # 4-byte aligned data
    assert not moe.grouped_mm_runs(torch.randn(3, 64), cpu)


@pytest.mark.cuda
@pytest.mark.skipif(not hasattr(F, "grouped_mm"), reason="torch's grouped GEMM comes with torch 2.10")
def test_grouped_experts_on_cuda_read_nothing_back():
    """bf16 on the GPU: the grouped GEMM path, and no host synchronization on the way (the
    per-expert form reads the counts back)."""
    w = grouped_weights(16, 8, 64, 32, torch.bfloat16, "cuda")
    x = torch.randn(64, 64, dtype=torch.bfloat16, device="cuda")
    assert moe.grouped_mm_runs(x, w)
    assert not moe.grouped_mm_runs(x.float(), grouped_weights(16, 8, 64, 32, torch.float32, "cuda"))
    ids, weights = moe.route(x, w)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        moe._grouped_experts(x, w, ids, weights)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    x = torch.randn(3, 64, device=device)
    gate_up, down = torch.randn(4, 64, 64, device=device), torch.randn(4, 64, 32, device=device)
    ids, weights = random_ids(3, 4, 2, device), torch.rand(3, 2, device=device)
    act = torch.empty(3, 2, 32, device=device)
    torch.library.opcheck(torch.ops.pagedkv.moe_gate_up_silu.default, (act, x, gate_up, ids))
    torch.library.opcheck(torch.ops.pagedkv.moe_down_sum.default, (torch.empty(3, 64, device=device), act, down,
                                                                   ids, weights))


def test_bad_arguments_are_named():
    x, gate_up = torch.randn(3, 64), torch.randn(4, 64, 64)
    with pytest.raises(RuntimeError, match="expert_ids holds 4; allowed: 0 to 3"):
        moe.moe_gate_up_silu(x, gate_up, torch.tensor([[0, 4]] * 3))
    with pytest.raises(RuntimeError, match="expert_ids has dtype Int; it must be torch.int64"):
        moe.moe_gate_up_silu(x, gate_up, torch.zeros(3, 2, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="weights has dtype Half; allowed: torch.float32"):
        moe.moe_down_sum(torch.randn(3, 2, 32), torch.randn(4, 64, 32), torch.zeros(3, 2, dtype=torch.int64),
                         torch.rand(3, 2).half())


# The models ---------------------------------------------------------------------------------

@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("name", list(CASES))
def test_generate_gives_hf_greedy_tokens(name, path, monkeypatch):
    monkeypatch.setattr(moe, "GROUPED_MIN_PAIRS", PATHS[path])
    if path == "grouped_per_expert":
        monkeypatch.setattr(moe, "grouped_mm_runs", lambda x, w: False)
    model = tiny(name)
    assert pagedkv.support_path(model) == "native", pagedkv.unsupported_reason(model)
    ids, mask = tp_worker.left_padded([5, 19], 256, "cpu", seed=1)
    expected = model.generate(ids, attention_mask=mask, **GREEDY)
    assert torch.equal(pagedkv.generate(model, ids, attention_mask=mask, **GREEDY), expected)


@pytest.mark.parametrize("name", list(CASES))
def test_llm_gives_hf_greedy_tokens(name):
    model = tiny(name)
    prompts = random_prompts([5, 19])
    assert_llm_gives_hf_greedy_tokens(pagedkv.LLM(model, max_num_seqs=2), model, prompts, GREEDY)


@pytest.mark.cuda
@pytest.mark.parametrize("name", list(CASES))
def test_bf16_on_gpu_agrees_with_hf(name):
    """bf16 on the GPU (decode steps in CUDA graphs, the expert kernels): equal tokens up to the
    first near-tie of HF's logits."""
    model = tiny(name, "cuda").to(torch.bfloat16)
    assert pagedkv.support_path(model) == "native", pagedkv.unsupported_reason(model)
    ids, mask = tp_worker.left_padded([5, 19], 256, "cuda", seed=1)
    hf = model.generate(ids, attention_mask=mask, output_logits=True, return_dict_in_generate=True, **GREEDY)
    got = pagedkv.generate(model, ids, attention_mask=mask, **GREEDY)
    assert_tokens_equal_up_to_near_tie(got, hf, ids.shape[1])


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_weight_bytes_count_the_experts(name):
    model = tiny(name)
    taken = weight_bytes(prepared(model).weights)
    assert taken == sum(p.numel() * p.element_size() for p in model.parameters())


def test_tensor_parallel_refuses_moe_by_name():
    with pytest.raises(UnsupportedModel, match="mixture-of-experts"):
        pagedkv.tensor_parallel(tiny("mixtral"))
