"""Tensor parallelism (pagedkv.tensor_parallel): two ranks over gloo on the CPU give HF's greedy
tokens for every architecture; sharding rules and refusals; on CUDA, one NCCL rank through the
same code inside CUDA graphs (several GPUs: benchmarks/bench_tensor_parallel.py under torchrun)."""

from __future__ import annotations

import dataclasses
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import Qwen2Config, Qwen2ForCausalLM

import pagedkv
import tp_worker
from models import _COMMON, ARCHITECTURES, tiny_model
from pagedkv.models.llama import extract_weights
from pagedkv.models.sharding import shard_weights


def _spawn(fn, world_size: int, tmp_path, *args) -> list[dict]:
    init_file = tmp_path / "rendezvous"
    mp.spawn(fn, args=(world_size, str(init_file), *args), nprocs=world_size, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world_size)]


def test_two_ranks_give_hf_greedy_tokens(tmp_path):
    """fp32 on the CPU: the ranks' partial O/down sums change only the order of additions, so
    greedy tokens stay HF's. Sampling: each rank seeds its own RNG differently, and still all
    ranks draw the same tokens (the first rank's seeds are broadcast)."""
    archs = sorted(ARCHITECTURES)
    ranks = _spawn(tp_worker.run, 2, tmp_path, archs, str(tmp_path))
    for arch in archs:
        first, second = ranks[0][arch], ranks[1][arch]
        assert torch.equal(first["plain"], first["hf"]), arch
        assert torch.equal(first["tp"], first["hf"]), arch
        assert torch.equal(second["tp"], first["tp"]), arch
        assert torch.equal(second["sampled"], first["sampled"]), arch
        assert first["kv_heads"] == first["model_kv_heads"] // 2, arch  # each rank caches its half


def test_engine_on_two_ranks(tmp_path):
    """pagedkv.LLM: the same greedy tokens as the unsharded engine through chunked prefills,
    prefix-cache hits and preemptions; sampled tokens the same on both ranks."""
    archs = ["qwen3", "llama_bias"]
    ranks = _spawn(tp_worker.run_engine, 2, tmp_path, archs, str(tmp_path))
    for arch in archs:
        first, second = ranks[0][arch], ranks[1][arch]
        assert first["got"] == first["expected"], arch
        assert second["got"] == first["got"], arch
        assert second["sampled"] == first["sampled"], arch
        assert first["blocks"] == second["blocks"] == 12, arch  # the smaller budget: rank 0's
        assert first["preemptions"] > 0 and first["cached_tokens"] > 0, arch


def test_ranks_with_different_calls_refuse_together(tmp_path):
    ranks = _spawn(tp_worker.run_mismatch, 2, tmp_path, str(tmp_path))
    for r in ranks:
        assert "rank(s) [1] of the tensor-parallel group got other prompts or generation settings" in r["error"]
    assert torch.equal(ranks[0]["out"], ranks[1]["out"])


@pytest.mark.parametrize("world_size", [2, 4])
def test_shards_put_back_together_are_the_weights(world_size):
    """Every weight row/column lands on exactly one rank: the ranks' shards, concatenated the way
    the forward combines them, are the unsharded weights."""
    # Qwen2 (QKV bias) with 4 kv heads, so that 4 ranks can split them; random values throughout.
    model = Qwen2ForCausalLM(Qwen2Config(**{**_COMMON, "num_key_value_heads": 4}))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    w = extract_weights(model)
    shards = [shard_weights(w, r, world_size, torch.device("cpu")) for r in range(world_size)]
    hd, hq, hkv = w.head_dim, w.num_heads // world_size, w.num_kv_heads // world_size
    layer = w.layers[0]
    for field in ("qkv", "qkv_bias"):
        full = torch.split(getattr(layer, field), [w.num_heads * hd, w.num_kv_heads * hd, w.num_kv_heads * hd])
        mine = [torch.split(getattr(s.layers[0], field), [hq * hd, hkv * hd, hkv * hd]) for s in shards]
        for i, part in enumerate("qkv"):  # each rank's query heads, then its K and V rows
            assert torch.equal(torch.cat([m[i] for m in mine]), full[i]), (field, part)
    assert torch.equal(torch.cat([s.layers[0].o for s in shards], dim=1), layer.o)
    assert torch.equal(torch.cat([s.layers[0].down for s in shards], dim=1), layer.down)
    inter = layer.down.shape[1]
    gates = torch.cat([s.layers[0].gate_up[:inter // world_size] for s in shards])
    ups = torch.cat([s.layers[0].gate_up[inter // world_size:] for s in shards])
    assert torch.equal(torch.cat([gates, ups]), layer.gate_up)
    assert torch.equal(torch.cat([s.lm_head for s in shards])[:w.vocab_size], w.lm_head)
    assert all(s.num_heads == hq and s.num_kv_heads == hkv for s in shards)


def test_vocabulary_that_does_not_split_evenly_is_padded():
    w = extract_weights(tiny_model("llama"))
    w = dataclasses.replace(w, lm_head=w.lm_head[:255], vocab_size=255)
    shards = [shard_weights(w, r, 2, torch.device("cpu")) for r in range(2)]
    assert [s.lm_head.shape[0] for s in shards] == [128, 128]
    assert torch.equal(torch.cat([s.lm_head for s in shards])[:255], w.lm_head)
    assert (shards[1].lm_head[127] == 0).all()


@pytest.mark.parametrize("world_size, what", [(3, "num_attention_heads = 4"), (4, "num_key_value_heads = 2")])
def test_sizes_that_do_not_split_are_refused(world_size, what):
    w = extract_weights(tiny_model("llama"))  # 4 query heads, 2 kv heads
    with pytest.raises(pagedkv.UnsupportedModel, match=f"{what} does not split over {world_size} ranks"):
        shard_weights(w, 0, world_size, torch.device("cpu"))


def test_needs_an_initialised_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised; call "
                                           "torch.distributed.init_process_group first"):
        pagedkv.tensor_parallel(tiny_model("llama"), device="cpu")


@pytest.fixture
def one_rank_gloo(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_refusals_with_one_rank(one_rank_gloo):
    with pytest.raises(ValueError, match="device meta with the 'gloo' backend is not supported; allowed: "
                                         "a CUDA device with 'nccl', or the CPU with 'gloo'"):
        pagedkv.tensor_parallel(tiny_model("llama"), device="meta")
    model = tiny_model("llama")
    pagedkv.generate(model, torch.tensor([[5, 6, 7]]), max_new_tokens=2)  # makes the plain runner
    with pytest.raises(ValueError, match="pagedkv already runs this model"):
        pagedkv.tensor_parallel(model, device="cpu")


@pytest.mark.cuda
@pytest.mark.parametrize("graphs", [False, True])
def test_one_nccl_rank_on_cuda(tmp_path, graphs):
    """The NCCL path on one GPU: all-reduce and all-gather inside the decode step's CUDA graph;
    bf16 tokens equal the unsharded runner's (one rank: same products, same order)."""
    ranks = _spawn(tp_worker.run, 1, tmp_path, ["qwen3", "llama_bias"], str(tmp_path), "nccl", "cuda",
                   torch.bfloat16, graphs)
    for arch, r in ranks[0].items():
        assert torch.equal(r["tp"], r["plain"]), arch
        assert r["kv_heads"] == r["model_kv_heads"], arch


@pytest.mark.cuda
def test_engine_on_one_nccl_rank(tmp_path):
    """pagedkv.LLM's CUDA-graph decode steps with the collectives inside, bf16: one rank gives
    the unsharded engine's tokens."""
    ranks = _spawn(tp_worker.run_engine, 1, tmp_path, ["qwen3"], str(tmp_path), "nccl", "cuda", torch.bfloat16)
    result = ranks[0]["qwen3"]
    assert result["got"] == result["expected"]
    assert result["preemptions"] > 0


two_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                              reason="needs 2 GPUs (device kinds nvidia-h100-x2 / nvidia-h200-x2)")


@pytest.mark.cuda
@two_gpus
@pytest.mark.parametrize("all_reduce", ["peer", "nccl"])
@pytest.mark.parametrize("graphs", [False, True])
def test_two_gpus_give_one_gpus_tokens(tmp_path, graphs, all_reduce):
    """Two NCCL ranks, fp32: the tokens of pagedkv on one GPU and of HF, with the decode steps'
    all-reduces over peer memory (fused with the add + RMSNorm) or through NCCL, graphs on/off;
    sampling agrees across the ranks."""
    archs = ["qwen3", "llama_bias", "qwen2"]
    ranks = _spawn(tp_worker.run, 2, tmp_path, archs, str(tmp_path), "nccl", "cuda", torch.float32,
                   graphs, all_reduce)
    for arch in archs:
        first, second = ranks[0][arch], ranks[1][arch]
        assert torch.equal(first["plain"], first["hf"]), arch
        assert torch.equal(first["tp"], first["plain"]), arch
        assert torch.equal(second["tp"], first["tp"]), arch
        assert torch.equal(second["sampled"], first["sampled"]), arch


@pytest.mark.cuda
@two_gpus
@pytest.mark.parametrize("all_reduce", ["peer", "nccl"])
def test_engine_on_two_gpus(tmp_path, all_reduce):
    """pagedkv.LLM on two NCCL ranks, fp32, CUDA-graph decode steps: the unsharded engine's tokens
    through chunked prefills, prefix-cache hits and preemptions."""
    ranks = _spawn(tp_worker.run_engine, 2, tmp_path, ["qwen3", "llama_bias"], str(tmp_path), "nccl", "cuda",
                   torch.float32, all_reduce)
    for arch in ("qwen3", "llama_bias"):
        first, second = ranks[0][arch], ranks[1][arch]
        assert first["got"] == first["expected"], arch
        assert second["got"] == first["got"] and second["sampled"] == first["sampled"], arch
        assert first["preemptions"] > 0 and first["cached_tokens"] > 0, arch


def test_peer_all_reduce_needs_gpus_of_one_host(one_rank_gloo):
    with pytest.raises(ValueError, match="all_reduce='peer' needs every rank on a GPU of this host"):
        pagedkv.tensor_parallel(tiny_model("llama"), device="cpu", all_reduce="peer")
    with pytest.raises(ValueError, match="all_reduce='ring'; allowed: 'auto', 'peer', 'nccl'"):
        pagedkv.tensor_parallel(tiny_model("llama"), device="cpu", all_reduce="ring")


def test_graphs_with_collectives_are_dropped_before_the_process_group(tmp_path):
    """CUDA graphs that captured NCCL calls make destroy_process_group (and the interpreter's
    exit) wait forever (pytorch/pytorch#115388; lab/tp_exit_probe.py on 2 GPUs): pagedkv's wrapper
    drops every registered graph set first."""
    from pagedkv.runtime.parallel import graphs_hold_collectives

    class Graphs:  # stands in for runtime.graphs.CudaGraphs (which needs CUDA)
        cleared_while_group_alive = None

        def clear(self):
            self.cleared_while_group_alive = dist.is_initialized()

    graphs = Graphs()
    graphs_hold_collectives(graphs)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    dist.destroy_process_group()
    assert graphs.cleared_while_group_alive is True
    assert dist.destroy_process_group.pagedkv_original is not dist.destroy_process_group
