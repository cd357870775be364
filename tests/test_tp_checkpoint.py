"""pagedkv.tensor_parallel_from_pretrained: each rank reads only its shard of a safetensors
checkpoint (save_pretrained's folder, several files) into a model skeleton on the meta device.
The shards equal pagedkv.tensor_parallel's (shard_weights) tensor for tensor; two gloo ranks give
HF's greedy tokens through generate and LLM; no rank reads more than its part of a split weight;
bad checkpoints are refused naming the file or tensor."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import GPT2Config, GPT2LMHeadModel

import models
import pagedkv
import tp_worker
from models import ARCHITECTURES, tiny_model
from pagedkv.models.checkpoint_shards import SafetensorsReader, open_checkpoint, read_shard
from pagedkv.models.llama import DecoderWeights, LayerWeights, extract_weights
from pagedkv.models.sharding import shard_weights

CPU = torch.device("cpu")


def saved(tmp_path: pathlib.Path, arch: str, monkeypatch=None, kv_heads: int | None = None):
    """(the tiny model, the folder save_pretrained wrote it to, in several safetensors files)."""
    if kv_heads is not None:  # 4 ranks need 4 kv heads to split
        monkeypatch.setitem(models._COMMON, "num_key_value_heads", kv_heads)
    model = tiny_model(arch)
    path = tmp_path / arch
    model.save_pretrained(path, max_shard_size="300KB")
    files = set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].values())
    assert len(files) > 3
    return model, path


def assert_same_weights(got: DecoderWeights, want: DecoderWeights) -> None:
    """Every field equal: tensors in value, dtype and shape (None where the other is None)."""
    def same(a, b, what: str) -> None:
        if isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), what
        else:
            assert a == b, what

    for field in (f.name for f in dataclasses.fields(DecoderWeights)):  # NativeWeights' fields too
        if field != "layers":
            same(getattr(got, field), getattr(want, field), field)
    assert len(got.layers) == len(want.layers)
    for i, (a, b) in enumerate(zip(got.layers, want.layers)):
        for field in LayerWeights.__slots__:
            same(getattr(a, field), getattr(b, field), f"layers[{i}].{field}")


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_shards_read_equal_shard_weights(tmp_path, monkeypatch, arch, world_size):
    model, path = saved(tmp_path, arch, monkeypatch, kv_heads=4 if world_size == 4 else None)
    skeleton, reader = open_checkpoint(path, torch.float32)
    assert all(p.is_meta for p in skeleton.parameters())
    full = extract_weights(model)
    for rank in range(world_size):
        got = read_shard(skeleton, reader, rank, world_size, CPU, torch.float32)
        assert_same_weights(got, shard_weights(full, rank, world_size, CPU))


def test_shards_are_cast_to_the_dtype_asked_for(tmp_path):
    """An fp32 checkpoint read as bf16: the slices are cast as HF's .to(bfloat16) would."""
    model, path = saved(tmp_path, "qwen2")
    skeleton, reader = open_checkpoint(path, torch.bfloat16)
    full = extract_weights(model.to(torch.bfloat16))
    for rank in range(2):
        assert_same_weights(read_shard(skeleton, reader, rank, 2, CPU, torch.bfloat16),
                            shard_weights(full, rank, 2, CPU))


SPLIT = tuple(f"{m}_proj.weight" for m in "qkvo") + ("gate_proj.weight", "up_proj.weight", "down_proj.weight",
                                                    "q_proj.bias", "k_proj.bias", "v_proj.bias")


class CountingReader:
    """A reader that counts the elements each read returns, per tensor name."""

    def __init__(self, reader):
        self.reader = reader
        self.elements: dict[str, list[int]] = {}

    def shape(self, name: str) -> tuple[int, ...]:
        return self.reader.shape(name)

    def read(self, name: str, rows: slice = slice(None), cols: slice | None = None) -> torch.Tensor:
        t = self.reader.read(name, rows, cols)
        self.elements.setdefault(name, []).append(t.numel())
        return t


@pytest.mark.parametrize("world_size", [2, 4])
def test_no_rank_reads_a_whole_split_weight(tmp_path, monkeypatch, world_size):
    """Every matrix but the embedding is read 1/n per rank, once; the embedding and the 1-D
    tensors (norms; O bias on the first rank only) are read whole."""
    model, path = saved(tmp_path, "llama_bias", monkeypatch, kv_heads=4)
    sizes = {name: p.numel() for name, p in model.named_parameters()}
    skeleton, reader = open_checkpoint(path, torch.float32)
    for rank in range(world_size):
        counting = CountingReader(reader)
        read_shard(skeleton, counting, rank, world_size, CPU, torch.float32)
        assert all(len(counts) == 1 for counts in counting.elements.values())
        read = {name: counts[0] for name, counts in counting.elements.items()}
        split = [n for n in sizes if n == "lm_head.weight" or n.endswith(SPLIT)]
        assert len(split) == 2 * (7 + 3) + 1  # a layer's 7 matrices and q/k/v biases; the LM head
        for name in split:
            assert read[name] == sizes[name] // world_size, name
        whole = [n for n in sizes if n not in split and not (n.endswith("o_proj.bias") and rank > 0)]
        for name in whole:
            assert read[name] == sizes[name], name
        assert read.keys() == set(split) | set(whole)


def _spawn(fn, world_size: int, tmp_path, *args) -> list[dict]:
    init_file = tmp_path / "rendezvous"
    mp.spawn(fn, args=(world_size, str(init_file), *args), nprocs=world_size, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world_size)]


def hf_tokens(model, ids: torch.Tensor, mask: torch.Tensor | None, max_new: int) -> torch.Tensor:
    return model.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                          eos_token_id=None, pad_token_id=0)


def test_two_ranks_from_a_checkpoint_give_hf_greedy_tokens(tmp_path):
    """fp32 on the CPU, generate (a ragged left-padded batch) and LLM (chunked prefills): HF's
    greedy tokens; HF's own generate and forward on the meta skeleton refuse clearly."""
    archs = ["llama_bias", "qwen3_tied", "qwen2"]
    paths, expected = {}, {}
    for arch in archs:
        model, paths[arch] = saved(tmp_path, arch)
        ids, mask = tp_worker.left_padded(tp_worker.LENGTHS, 256, "cpu", seed=1)
        expected[arch] = dict(generate=hf_tokens(model, ids, mask, 20),
                              llm=[hf_tokens(model, torch.tensor([p]), None, 16)[0, len(p):].tolist()
                                   for p in tp_worker.engine_prompts()])
    ranks = _spawn(tp_worker.run_checkpoint, 2, tmp_path, {a: str(p) for a, p in paths.items()}, str(tmp_path))
    for arch in archs:
        for r in ranks:
            got = r[arch]
            assert torch.equal(got["generate"], expected[arch]["generate"]), arch
            assert torch.equal(got["patched"], expected[arch]["generate"]), arch
            assert got["llm"] == expected[arch]["llm"], arch
            assert got["kv_heads"] == 1, arch  # each rank caches its half of the 2 kv heads
            for error in (got["hf_generate"], got["hf_forward"]):
                assert "its weights are this rank's shard, held by pagedkv" in error, arch


@pytest.mark.cuda
def test_one_nccl_rank_from_a_checkpoint(tmp_path):
    """bf16 on one GPU: the shard read from the checkpoint gives the tokens of the same
    checkpoint loaded whole by from_pretrained (one rank: same products, same order)."""
    _, path = saved(tmp_path, "qwen3")
    ranks = _spawn(tp_worker.run_checkpoint, 1, tmp_path, {"qwen3": str(path)}, str(tmp_path), "nccl",
                   "cuda", torch.bfloat16)
    got = ranks[0]["qwen3"]
    assert torch.equal(got["generate"], got["whole"])
    assert got["llm"] == got["whole_llm"]


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_nccl_ranks_from_a_checkpoint(tmp_path):
    """fp32 on two GPUs: the tokens of the whole checkpoint on one GPU."""
    _, path = saved(tmp_path, "llama_bias")
    ranks = _spawn(tp_worker.run_checkpoint, 2, tmp_path, {"llama_bias": str(path)}, str(tmp_path), "nccl",
                   "cuda", torch.float32)
    for r in ranks:
        assert torch.equal(r["llama_bias"]["generate"], ranks[0]["llama_bias"]["whole"])
        assert r["llama_bias"]["llm"] == ranks[0]["llama_bias"]["whole_llm"]


# -- refusals --------------------------------------------------------------------------------------
@pytest.fixture
def one_rank_gloo(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def load(path, **kwargs):
    return pagedkv.tensor_parallel_from_pretrained(path, dtype=torch.float32, device="cpu", **kwargs)


def test_needs_an_initialised_process_group(tmp_path):
    _, path = saved(tmp_path, "llama")
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        load(path)


def test_one_rank_gives_hf_greedy_tokens(tmp_path, one_rank_gloo):
    model, path = saved(tmp_path, "mistral")
    ids = torch.tensor([[5, 9, 11, 3]])
    sharded = load(path)
    assert torch.equal(pagedkv.generate(sharded, ids, max_new_tokens=8, do_sample=False, eos_token_id=None),
                       hf_tokens(model, ids, None, 8))


def test_missing_files_are_named(tmp_path, one_rank_gloo):
    with pytest.raises(ValueError, match="is not a local folder.*save_pretrained"):
        load(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="is not a local folder"):
        load("meta-llama/Llama-3.1-8B")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no config\.json in .*empty"):
        load(tmp_path / "empty")
    _, path = saved(tmp_path, "llama")
    (path / "model.safetensors.index.json").rename(path / "index.json")
    with pytest.raises(FileNotFoundError, match=r"neither model\.safetensors nor model\.safetensors\.index\.json"):
        load(path)
    (path / "index.json").rename(path / "model.safetensors.index.json")
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    name, file = sorted(weight_map.items())[3]
    (path / file).unlink()
    with pytest.raises(FileNotFoundError, match=f"{file}, which .*index.json names for '{name}', is missing"):
        load(path)


def test_missing_or_misshapen_tensors_are_named(tmp_path, one_rank_gloo):
    _, path = saved(tmp_path, "qwen2")
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    name = "model.layers.1.self_attn.k_proj.bias"
    # The index names a file that does not hold the tensor.
    elsewhere = index["weight_map"]["model.embed_tokens.weight"]
    index["weight_map"][name] = elsewhere
    index_file.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"tensor '{name}' is not in {elsewhere}"):
        load(path)
    del index["weight_map"][name]  # the index does not list it
    index_file.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"the checkpoint has no tensor '{name}'.*index.json"):
        load(path)
    # The config does not match the tensors' shapes.
    _, path = saved(tmp_path, "llama")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "intermediate_size": 1024}))
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.gate_proj\.weight' in model-000\d\d-of-000\d\d"
                                         r"\.safetensors has shape \[512, 256\]; the config makes it \[1024, 256\]"):
        load(path)


def test_unsupported_model_type(tmp_path, one_rank_gloo):
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=64)).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(pagedkv.UnsupportedModel, match="model_type 'gpt2' is not supported"):
        load(tmp_path / "gpt2")


def test_sizes_that_do_not_split(tmp_path):
    _, path = saved(tmp_path, "llama")  # 4 query heads, 2 kv heads
    skeleton, reader = open_checkpoint(path, torch.float32)
    counting = CountingReader(reader)
    with pytest.raises(pagedkv.UnsupportedModel, match="num_key_value_heads = 2 does not split over 4 ranks"):
        read_shard(skeleton, counting, 0, 4, CPU, torch.float32)
    assert counting.elements == {}  # refused before any read


def test_plain_meta_model_is_still_refused():
    """Only a skeleton whose shard pagedkv read runs on meta; any other meta model holds nothing."""
    model = tiny_model("llama", device="meta")
    with pytest.raises(pagedkv.UnsupportedModel, match="on the meta device: it holds no weights"):
        pagedkv.generate(model, torch.tensor([[3, 4]]), max_new_tokens=2)


def test_reader_reads_only_the_slices(tmp_path):
    model, path = saved(tmp_path, "llama")
    reader = SafetensorsReader(path)
    name = "model.layers.0.mlp.down_proj.weight"
    assert reader.shape(name) == (256, 512)
    full = dict(model.named_parameters())[name]
    assert torch.equal(reader.read(name, slice(3, 9)), full[3:9])
    assert torch.equal(reader.read(name, slice(None), slice(128, 256)), full[:, 128:256])
