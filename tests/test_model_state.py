"""Changes to a model after pagedkv ran it: generate() takes the weights again (a new tensor, a
new dtype or device, a replaced module, a resized vocabulary) or sees them in place (the fused
weights are views of HF's); an existing LLM and a tensor-parallel shard refuse a changed model;
adapter wrappers are refused up front, a torch.compile wrapper runs its original; copies (deepcopy,
pickle, torch.save) carry no pagedkv state and run on their own weights. Tokens are compared with
HF's generate on the same model."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
import torch.distributed as dist
from torch import nn

import pagedkv
from pagedkv import LLM, SamplingParams
from pagedkv.runtime.model import PREPARED_ATTR
from conftest import DEVICES
from models import tiny_model

MAX_NEW = 8
PROMPTS = ([5, 17, 9, 100, 3, 44], [200, 31, 7])
PAD_WIDTH = max(len(p) for p in PROMPTS)  # batch()'s rows, left-padded to the longest


def batch(device, vocab: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Two left-padded rows [2, 6] and their mask; ids >= vocab are shifted into it."""
    rows = [[t % vocab for t in p] for p in PROMPTS]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows], device=device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
    return ids, mask


def hf_tokens(model, ids=None, mask=None) -> torch.Tensor:
    """HF's own greedy generate (also on a patched model): [B, S + MAX_NEW]."""
    if ids is None:
        ids, mask = batch(next(model.parameters()).device)
    return type(model).generate(model, ids, attention_mask=mask, max_new_tokens=MAX_NEW,
                                do_sample=False, eos_token_id=None, pad_token_id=0)


def paged_tokens(model, ids=None, mask=None) -> torch.Tensor:
    if ids is None:
        ids, mask = batch(next(model.parameters()).device)
    return pagedkv.generate(model, ids, attention_mask=mask, max_new_tokens=MAX_NEW,
                            do_sample=False, eos_token_id=None, pad_token_id=0)


def assert_matches_hf(model) -> torch.Tensor:
    want = hf_tokens(model)
    assert torch.equal(paged_tokens(model).cpu(), want.cpu())
    return want


def layer(model, i: int = 0):
    return model.model.layers[i]


def new_parameter(module: nn.Module, name: str, source: torch.Tensor) -> None:
    setattr(module, name, nn.Parameter(source.detach().clone()))


def new_data(module: nn.Module, name: str, source: torch.Tensor) -> None:
    getattr(module, name).data = source.detach().clone()


def new_linear(module: nn.Module, name: str, source: nn.Linear) -> None:
    setattr(module, name, copy.deepcopy(source))


# Each takes (model, other): `other` is a same-shaped model with other weights.
REPLACEMENTS = {
    "q_proj = Parameter (fused)": lambda m, o: new_parameter(layer(m).self_attn.q_proj, "weight",
                                                             layer(o).self_attn.q_proj.weight),
    "k_proj.weight.data = (fused)": lambda m, o: new_data(layer(m).self_attn.k_proj, "weight",
                                                          layer(o).self_attn.k_proj.weight),
    "up_proj.weight.data = (fused)": lambda m, o: new_data(layer(m, 1).mlp.up_proj, "weight",
                                                           layer(o, 1).mlp.up_proj.weight),
    "o_proj = Parameter": lambda m, o: new_parameter(layer(m).self_attn.o_proj, "weight",
                                                     layer(o).self_attn.o_proj.weight),
    "embed_tokens.weight.data =": lambda m, o: new_data(m.model.embed_tokens, "weight",
                                                        o.model.embed_tokens.weight),
    "lm_head = Parameter": lambda m, o: new_parameter(m.lm_head, "weight", o.lm_head.weight),
    "input_layernorm = Parameter": lambda m, o: new_parameter(
        layer(m).input_layernorm, "weight", torch.rand_like(layer(o).input_layernorm.weight) * 2),
    "mlp.down_proj = Linear": lambda m, o: new_linear(layer(m).mlp, "down_proj", layer(o).mlp.down_proj),
    "self_attn.v_proj = Linear": lambda m, o: new_linear(layer(m).self_attn, "v_proj",
                                                         layer(o).self_attn.v_proj),
    "load_state_dict(assign=True)": lambda m, o: m.load_state_dict(
        {k: v.clone() for k, v in o.state_dict().items()}, assign=True),
}


def _in_place(m, o, name):
    with torch.no_grad():
        if name == "load_state_dict":
            m.load_state_dict(o.state_dict())
        elif name == "q_proj.weight.data.copy_":
            layer(m).self_attn.q_proj.weight.data.copy_(layer(o).self_attn.q_proj.weight)
        else:  # gate_proj.weight.mul_
            layer(m).mlp.gate_proj.weight.mul_(-1)


IN_PLACE = ["load_state_dict", "q_proj.weight.data.copy_", "gate_proj.weight.mul_"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("change", list(REPLACEMENTS))
def test_replaced_weights_are_taken_again(device, change):
    model, other = tiny_model("llama", device=device), tiny_model("llama", device=device, seed=1)
    before = assert_matches_hf(model)
    REPLACEMENTS[change](model, other)
    after = assert_matches_hf(model)
    assert not torch.equal(before, after), "the change must matter to HF's tokens"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("change", IN_PLACE)
def test_in_place_updates_are_seen(device, change):
    model, other = tiny_model("llama", device=device), tiny_model("llama", device=device, seed=1)
    before = assert_matches_hf(model)
    _in_place(model, other, change)
    assert not torch.equal(before, assert_matches_hf(model))


def test_weights_are_taken_once_across_benign_calls():
    """Nothing that leaves the weights where they are makes generate() take them again."""
    model = tiny_model("llama")
    before = assert_matches_hf(model)
    state = getattr(model, PREPARED_ATTR)
    model(batch("cpu")[0], output_hidden_states=True).logits.sum().backward()
    torch.optim.SGD(model.parameters(), lr=0.0).step()  # in place, same values
    model.zero_grad()
    model.train().eval().float().to("cpu").requires_grad_(False)
    model.load_state_dict(model.state_dict())
    pagedkv.patch(model)
    pagedkv.unpatch(model)
    assert torch.equal(assert_matches_hf(model), before)
    assert getattr(model, PREPARED_ATTR) is state


@pytest.mark.parametrize("device", DEVICES)
def test_new_dtype_is_taken(device):
    model = tiny_model("llama", dtype=torch.bfloat16, device=device)
    paged_tokens(model)
    model.to(torch.float32)  # exactly the bf16 values, now computed in fp32
    assert_matches_hf(model)
    assert pagedkv.kv_cache_of(model).kv.dtype == torch.float32


@pytest.mark.cuda
def test_new_device_is_taken():
    model = tiny_model("llama")
    assert_matches_hf(model)
    model.to("cuda")
    assert_matches_hf(model)
    assert pagedkv.kv_cache_of(model).device.type == "cuda"


@pytest.mark.parametrize("device", DEVICES)
def test_resized_vocabulary_is_taken(device):
    model = tiny_model("llama", device=device)
    assert_matches_hf(model)
    model.resize_token_embeddings(300)
    ids, mask = batch(device)
    ids[0, -3:] = torch.tensor([299, 256, 280])  # ids only the new rows hold
    want = hf_tokens(model, ids, mask)
    assert torch.equal(paged_tokens(model, ids, mask).cpu(), want.cpu())


class LoraLinear(nn.Module):
    """PEFT-style adapter: the original Linear as `base_layer`, plus B @ A; `weight` shows the
    base's, so code that reads only `.weight` would silently drop the adapter."""

    def __init__(self, base: nn.Linear, rank: int = 4):
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.Linear(base.in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False)
        nn.init.normal_(self.lora_B.weight, std=0.5)

    @property
    def weight(self) -> torch.Tensor:
        return self.base_layer.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base_layer.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B(self.lora_A(x))


@pytest.mark.parametrize("run_first", [False, True], ids=["never run", "after a run"])
def test_adapter_wrappers_are_refused(run_first):
    model = tiny_model("llama")
    if run_first:
        assert_matches_hf(model)
    attn = layer(model, 1).self_attn
    base = attn.q_proj
    attn.q_proj = LoraLinear(base)
    reason = pagedkv.unsupported_reason(model)
    assert not pagedkv.supports(model)
    assert "model.layers.1.self_attn.q_proj is a LoraLinear" in reason and "torch.nn.Linear" in reason
    with pytest.raises(pagedkv.UnsupportedModel, match="q_proj is a LoraLinear"):
        paged_tokens(model)
    with pytest.raises(pagedkv.UnsupportedModel, match="q_proj is a LoraLinear"):
        LLM(model, num_kv_blocks=16)
    with pytest.raises(pagedkv.UnsupportedModel, match="q_proj is a LoraLinear"):
        pagedkv.patch(model)
    attn.q_proj = base  # merged or removed: runs again
    assert_matches_hf(model)


def test_a_torch_compile_wrapper_runs_its_original():
    """torch.compile(model) (an OptimizedModule forwarding HF's attributes) is its original to
    every entry point, as to HF's generate: pagedkv runs the weights with its own kernels, never
    the compiled forward, and keeps its state on the original."""
    model = tiny_model("llama")
    expected = hf_tokens(model)
    compiled = torch.compile(model)
    assert pagedkv.supports(compiled) and pagedkv.support_path(compiled) == "native"
    assert torch.equal(paged_tokens(compiled), expected)
    assert hasattr(model, PREPARED_ATTR) and pagedkv.kv_cache_of(compiled) is pagedkv.kv_cache_of(model)
    ids, mask = batch("cpu")
    pagedkv.patch(compiled)
    assert torch.equal(compiled.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False,
                                         eos_token_id=None, pad_token_id=0), expected)
    pagedkv.unpatch(compiled)
    assert compiled.generate.__func__ is type(model).generate  # HF's again
    llm = LLM(compiled, num_kv_blocks=16)
    assert llm.model is model and llm_tokens(llm) == expected[:, PAD_WIDTH:].tolist()


def test_training_mode_with_dropout_is_refused():
    """HF's generate does not call eval(): in training mode with a dropout above 0 its tokens are
    random, and pagedkv (which never drops) says so instead of giving other ones; in training mode
    without dropout (Llama's default) nothing differs and it runs; eval() runs again."""
    model = tiny_model("llama")
    llm = LLM(model, num_kv_blocks=16)  # (which puts the model in eval mode)
    model.train()
    expected = hf_tokens(model)  # attention_dropout 0.0: training mode changes nothing
    assert torch.equal(paged_tokens(model), expected)
    for attention in (layer(model, i).self_attn for i in range(len(model.model.layers))):
        attention.attention_dropout = 0.5
    with pytest.raises(ValueError, match=r"training mode with dropout at model.layers.0.self_attn "
                                         r"\(LlamaAttention, p=0.5\).*call model.eval\(\)"):
        paged_tokens(model)
    with pytest.raises(ValueError, match=r"pagedkv.LLM: the model is in training mode.*nothing was queued"):
        llm_tokens(llm)
    model.eval()
    assert torch.equal(paged_tokens(model), expected)
    assert llm_tokens(llm) == expected[:, PAD_WIDTH:].tolist()


# -- an existing pagedkv.LLM --------------------------------------------------------------------
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)


def llm_tokens(llm: LLM) -> list[list[int]]:
    return [out.token_ids for out in llm.generate(list(PROMPTS), GREEDY, use_tqdm=False)]


def hf_new_tokens(model) -> list[list[int]]:
    device = next(model.parameters()).device
    return [hf_tokens(model, torch.tensor([p], device=device), None)[0, len(p):].tolist() for p in PROMPTS]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("via_generate", [False, True], ids=["changed", "changed, then generate()"])
def test_llm_refuses_a_changed_model(device, via_generate):
    model, other = tiny_model("llama", device=device), tiny_model("llama", device=device, seed=1)
    llm = LLM(model, num_kv_blocks=32, max_num_seqs=4)
    assert llm_tokens(llm) == hf_new_tokens(model)
    REPLACEMENTS["q_proj = Parameter (fused)"](model, other)
    if via_generate:  # generate() takes the new weights; the LLM still holds the old ones
        assert_matches_hf(model)
    match = r"model.layers.0.self_attn.q_proj.weight .*; make a new pagedkv.LLM"
    with pytest.raises(pagedkv.ModelChanged, match=match):
        llm.add_request(PROMPTS[0], GREEDY)
    with pytest.raises(pagedkv.ModelChanged, match=match):
        llm.generate(list(PROMPTS), GREEDY, use_tqdm=False)
    assert not llm.has_unfinished_requests()
    assert llm.cache.num_free_blocks == llm.cache.num_blocks
    assert llm_tokens(LLM(model, num_kv_blocks=32, max_num_seqs=4)) == hf_new_tokens(model)


@pytest.mark.parametrize("device", DEVICES)  # on CUDA, its decode steps replay CUDA graphs
@pytest.mark.parametrize("change", IN_PLACE)
def test_llm_sees_in_place_updates(device, change):
    model, other = tiny_model("llama", device=device), tiny_model("llama", device=device, seed=1)
    llm = LLM(model, num_kv_blocks=32, max_num_seqs=4)
    before = llm_tokens(llm)
    _in_place(model, other, change)
    assert llm_tokens(llm) == hf_new_tokens(model) != before


# -- tensor parallel: the shards are copies ------------------------------------------------------
@pytest.fixture
def one_rank_gloo(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("change", ["q_proj = Parameter (fused)", "model.to(bfloat16)", "optimizer step"])
def test_tensor_parallel_refuses_a_changed_model(one_rank_gloo, change):
    model, other = tiny_model("llama"), tiny_model("llama", seed=1)
    pagedkv.tensor_parallel(model, device="cpu")
    assert torch.equal(paged_tokens(model), hf_tokens(model))
    if change == "model.to(bfloat16)":
        model.to(torch.bfloat16)
    elif change == "optimizer step":
        model(batch("cpu")[0]).logits.sum().backward()
        torch.optim.SGD(model.parameters(), lr=1.0).step()
    else:
        REPLACEMENTS[change](model, other)
    with pytest.raises(pagedkv.ModelChanged, match=r"tensor_parallel copied .* model.*\.weight"):
        paged_tokens(model)
    with pytest.raises(pagedkv.ModelChanged, match=r"tensor_parallel copied"):
        LLM(model, num_kv_blocks=16)


# -- copies ---------------------------------------------------------------------------------------
def _deepcopy(model):
    return copy.deepcopy(model)


def _pickle(model):
    return pickle.loads(pickle.dumps(model))


def _torch_save(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


COPIES = {"deepcopy": _deepcopy, "pickle": _pickle, "torch.save": _torch_save}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("how", list(COPIES))
@pytest.mark.parametrize("patched", [False, True], ids=["plain", "patched"])
def test_copies_run_on_their_own_weights(device, how, patched):
    model = tiny_model("llama", device=device)
    if patched:
        pagedkv.patch(model)
    original = assert_matches_hf(model)
    clone = COPIES[how](model)
    assert getattr(clone, PREPARED_ATTR, None) is None  # taken again on first use
    assert torch.equal(assert_matches_hf(clone), original)
    if patched:  # the copy's generate is pagedkv's, on the copy
        ids, mask = batch(device)
        assert torch.equal(clone.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW,
                                          do_sample=False, eos_token_id=None).cpu(), original.cpu())
    with torch.no_grad():  # the copy's weights are its own, both ways
        layer(clone).self_attn.q_proj.weight.mul_(-1)
        layer(model, 1).mlp.up_proj.weight.mul_(-1)
    changed_clone, changed_model = assert_matches_hf(clone), assert_matches_hf(model)
    assert not torch.equal(changed_clone, original) and not torch.equal(changed_model, original)
    assert not torch.equal(changed_clone, changed_model)
