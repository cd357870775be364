"""generate() means what HF's generate means where the arguments are unusual: no attention_mask
(HF infers it from pad_token_id), the default length, odd argument types (NumPy ints, 0-d
tensors, floats, bools), eos_token_id as a tensor or array, attention_mask values other than
0/1, sampling from NaN logits (HF raises; so do generate() and pagedkv.LLM), and plain (not
inference) output tensors. Each is checked against HF's own generate (tiny fp32 models, CPU)."""

from __future__ import annotations

import functools
import warnings

import numpy as np
import pytest
import torch

import pagedkv
from pagedkv import LLM, SamplingParams
from conftest import DEVICES
from limits import assert_cache_clean, assert_generate_works, gen, model  # noqa: F401 (gen: fixture)
from models import tiny_model


def hf(m, ids, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return type(m).generate(m, ids, **kwargs)


def rows(*prompts, pad=0):
    """Left-padded input_ids [B, S] of the prompts."""
    width = max(map(len, prompts))
    return torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts])


A, B = [5, 6, 7], [8, 9, 10, 11, 12, 13]


# -- no attention_mask: HF infers it from pad_token_id -------------------------------------------
@pytest.mark.parametrize("kwargs", [
    dict(),  # pad 0 (the model's), in the input, not an EOS: the mask is inferred
    dict(pad_token_id=7),  # another pad id, in the input
    dict(pad_token_id=2, eos_token_id=2),  # pad == eos: no mask inferred, pads are tokens
    dict(pad_token_id=None, eos_token_id=[0, 2]),  # pad defaults to eos[0]: not inferred
    dict(pad_token_id=99),  # pad not in the input: not inferred
])
def test_no_attention_mask_infers_it_like_hf(gen, kwargs):
    ids = rows([5, 6], B, pad=7) if kwargs.get("pad_token_id") == 7 else rows(A, B)
    args = dict(max_new_tokens=5, do_sample=False, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = gen(ids, **args)
    assert torch.equal(got, hf(model(), ids, **args))


def test_no_attention_mask_warns_when_hf_does(gen):
    ids = rows(A, B)
    with pytest.warns(UserWarning, match="cannot be inferred from input because pad token is same as eos"):
        gen(ids, max_new_tokens=2, pad_token_id=2, eos_token_id=2)
    with pytest.warns(UserWarning) as record:  # HF warns twice: pad unset, then pad == eos
        gen(ids, max_new_tokens=2, pad_token_id=None, eos_token_id=2)
    assert [str(w.message)[:30] for w in record] == ["The attention mask and the pad",
                                                     "The attention mask is not set "]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gen(ids, max_new_tokens=2)  # the mask is inferred: no warning
        gen(ids[:1], max_new_tokens=2, pad_token_id=2, eos_token_id=2)  # one row: nothing to pad


def test_inferred_mask_that_is_not_left_padded_is_refused(gen):
    ids = torch.tensor([[5, 0, 6], [7, 8, 9]])  # pad id 0 inside row 0
    with pytest.raises(ValueError, match=r"inferred from pad_token_id=0 .* pass attention_mask"):
        gen(ids, max_new_tokens=2)
    assert_generate_works(gen)


# -- the default length --------------------------------------------------------------------------
@pytest.mark.parametrize("width", [3, 19, 20, 30, 500])
def test_default_length_like_hf(gen, width):
    """HF generates 20 new tokens by default (capped at max_position_embeddings), whatever the
    prompt length, and warns that it used its default."""
    ids = torch.randint(3, 256, (2, width), generator=torch.Generator().manual_seed(width))
    with pytest.warns(UserWarning, match=r"model-agnostic default `max_length`"):
        got = gen(ids, do_sample=False, eos_token_id=None)
    assert torch.equal(got, hf(model(), ids, do_sample=False, eos_token_id=None))
    assert got.shape[1] == min(width + 20, 512)


def test_default_length_from_generation_config_and_too_long_prompts(gen):
    m = model()
    ids = torch.randint(3, 256, (1, 6))
    old = m.generation_config.max_length
    try:
        m.generation_config.max_length = 10  # the model's own max_length: a total length
        got = gen(ids, do_sample=False, eos_token_id=None)
        assert torch.equal(got, hf(m, ids, do_sample=False, eos_token_id=None)) and got.shape[1] == 10
        with pytest.raises(ValueError, match=r"max_length=10 with prompts of length 12 leaves no token"):
            gen(torch.randint(3, 256, (1, 12)), do_sample=False)
    finally:
        m.generation_config.max_length = old
    with pytest.raises(ValueError, match=r"max_length=5 with prompts of length 6 leaves no token"):
        gen(ids, max_length=5)
    with (pytest.raises(ValueError, match=r"prompts of length 512 leave no token .* max_position_embeddings"),
          pytest.warns(UserWarning, match=r"model-agnostic default `max_length`")):  # as HF: warns, raises
        gen(torch.randint(3, 256, (1, 512)), do_sample=False)
    assert_generate_works(gen)


def test_min_new_tokens_takes_precedence_over_min_length_like_hf(gen):
    ids = rows(A)
    free = hf(model(), ids, max_new_tokens=8, do_sample=False, eos_token_id=None)
    eos = int(free[0, 3 + 1])  # the 2nd new token as EOS
    args = dict(max_new_tokens=8, do_sample=False, eos_token_id=eos, min_new_tokens=1, min_length=9)
    assert torch.equal(gen(ids, **args), hf(model(), ids, **args))


# -- attention_mask values -----------------------------------------------------------------------
MASK = torch.tensor([[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]])


@pytest.mark.parametrize("mask", [MASK.bool(), MASK.int(), MASK.to(torch.uint8), MASK.float()],
                         ids=["bool", "int32", "uint8", "float"])
def test_attention_mask_of_0_1_in_any_dtype_like_hf(gen, mask):
    ids = rows(A, B)
    args = dict(max_new_tokens=4, do_sample=False)
    assert torch.equal(gen(ids, attention_mask=mask, **args), hf(model(), ids, attention_mask=MASK, **args))


@pytest.mark.parametrize("mask", [MASK * 2, MASK - (MASK == 0).long(), MASK.float() * 0.5],
                         ids=["2", "-1", "0.5"])
def test_attention_mask_values_other_than_0_1_are_refused(gen, mask):
    with pytest.raises(ValueError, match=r"attention_mask must hold only 0 and 1 .* got \["):
        gen(rows(A, B), attention_mask=mask, max_new_tokens=4)
    assert_generate_works(gen)


# -- argument types ------------------------------------------------------------------------------
INT_FORMS = [np.int64, np.int32, torch.tensor, float]  # 5 -> np.int64(5), ..., 5.0


@pytest.mark.parametrize("form", INT_FORMS, ids=["np.int64", "np.int32", "tensor", "float"])
@pytest.mark.parametrize("kwargs", [
    dict(max_new_tokens=5), dict(max_new_tokens=None, max_length=8), dict(min_new_tokens=3),
    dict(top_k=5, do_sample=True), dict(pad_token_id=0), dict(eos_token_id=85), dict(bos_token_id=1),
], ids=lambda kw: next(iter(kw)) if "max_length" not in kw else "max_length")
def test_integer_arguments_in_other_forms_mean_the_same(gen, form, kwargs):
    ids = rows(A, B)
    mask = (ids != 0).long()
    base = dict(max_new_tokens=5, do_sample=False, eos_token_id=None, attention_mask=mask)
    plain = {**base, **kwargs}
    other = {k: (form(v) if isinstance(v, int) and not isinstance(v, bool) else v)
             for k, v in plain.items() if k != "attention_mask"}
    torch.manual_seed(3)
    expected = pagedkv.generate(model(), ids, **plain)
    torch.manual_seed(3)
    assert torch.equal(gen(ids, attention_mask=mask, **other), expected)
    if not plain.get("do_sample"):  # HF's own tokens with plain ints
        assert torch.equal(expected, hf(model(), ids, **plain))


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(max_new_tokens=True), TypeError, r"max_new_tokens=True is a bool; it must be an integer"),
    (dict(max_new_tokens=5.5), ValueError, r"max_new_tokens=5.5 is not a whole number"),
    (dict(max_new_tokens="5"), TypeError, r"max_new_tokens must be an integer .* got str"),
    (dict(max_new_tokens=[5]), TypeError, r"max_new_tokens must be an integer .* got list"),
    (dict(max_new_tokens=torch.tensor([5, 6])), TypeError, r"max_new_tokens must be an integer .* 0-d"),
    (dict(min_new_tokens=np.bool_(True)), TypeError, r"min_new_tokens=True is a bool"),
    (dict(max_new_tokens=None, max_length=8.5), ValueError, r"max_length=8.5 is not a whole number"),
    (dict(top_k=2.5, do_sample=True), ValueError, r"top_k=2.5 is not a whole number"),
    (dict(pad_token_id=True), TypeError, r"pad_token_id=True is a bool"),
    (dict(eos_token_id=[2, 3.5]), ValueError, r"eos_token_id=3.5 is not a whole number"),
    (dict(eos_token_id=torch.tensor([[2]])), TypeError, r"eos_token_id must be an integer or a 1-D"),
    (dict(temperature="0.7", do_sample=True), TypeError, r"temperature must be a number .* got str"),
    (dict(top_p=True, do_sample=True), TypeError, r"top_p=True is a bool"),
    (dict(do_sample="yes"), TypeError, r"do_sample must be a bool .* got str"),
    (dict(min_new_tokens=-1), ValueError, r"min_new_tokens=-1; it must be >= 0"),
])
def test_bad_argument_types_are_refused_naming_the_argument(gen, kwargs, error, match):
    with pytest.raises(error, match=match):
        gen(rows(A), **{"max_new_tokens": 3, **kwargs})
    assert_generate_works(gen)


@pytest.mark.parametrize("kwargs", [
    dict(temperature=np.float32(0.5)), dict(temperature=torch.tensor(0.5)), dict(top_p=np.float64(0.9)),
    dict(repetition_penalty=np.float64(1.0)), dict(do_sample=np.bool_(True)), dict(do_sample=1),
], ids=lambda kw: f"{next(iter(kw))}:{type(next(iter(kw.values()))).__name__}")
def test_real_and_flag_arguments_in_other_forms(kwargs):
    ids = rows(A)
    plain = {k: (float(v) if k != "do_sample" else bool(v)) for k, v in kwargs.items()}
    base = dict(max_new_tokens=4, do_sample=True)
    torch.manual_seed(5)
    expected = pagedkv.generate(model(), ids, **{**base, **plain})
    torch.manual_seed(5)
    assert torch.equal(pagedkv.generate(model(), ids, **{**base, **kwargs}), expected)


@pytest.mark.parametrize("eos", [torch.tensor(85), torch.tensor([85]), torch.tensor([7, 85]), [85, 7],
                                 (85,), np.array([85, 7]), np.int64(85), torch.tensor([85.0])],
                         ids=["0-d tensor", "1-D tensor", "2 ids tensor", "list", "tuple", "np.array",
                              "np.int64", "float tensor"])
def test_eos_token_id_forms_like_hf(gen, eos):
    ids = rows(A, B)
    mask = (ids != 0).long()
    args = dict(max_new_tokens=6, do_sample=False, eos_token_id=eos, attention_mask=mask)
    expected = hf(model(), ids, **{**args, "eos_token_id": [85, 7] if len(np.atleast_1d(np.asarray(eos))) > 1 else 85})
    assert torch.equal(gen(ids, **args), expected)


def test_eos_ids_outside_the_vocabulary_like_hf(gen):
    """They can never be generated (HF never matches them); min_new_tokens must not index with them."""
    ids = rows(A, B)
    mask = (ids != 0).long()
    args = dict(max_new_tokens=6, do_sample=False, eos_token_id=[300, 85, -4], min_new_tokens=3,
                attention_mask=mask)
    assert torch.equal(gen(ids, **args), hf(model(), ids, **args))


# -- sampling from NaN logits --------------------------------------------------------------------
POISON = 77  # a token id whose embedding is NaN: every logit after it is NaN


@functools.lru_cache(maxsize=None)
def nan_model(device: str = "cpu"):
    m = tiny_model("llama", device=device)
    with torch.no_grad():
        m.model.embed_tokens.weight[POISON] = float("nan")
    return m


def test_hf_raises_when_sampling_nan_logits():
    """The reference for the tests below (CPU only: on CUDA HF's multinomial may assert)."""
    with pytest.raises(RuntimeError, match=r"probability tensor contains either `inf`, `nan`"):
        hf(nan_model(), rows([5, POISON, 6], [8, 9, 10]), max_new_tokens=4, do_sample=True)


@pytest.mark.parametrize("device", DEVICES)
def test_sampling_nan_logits_raises_like_hf(device):
    m = nan_model(device)
    ids, clean = rows([5, POISON, 6], [8, 9, 10]).to(device), rows([5, 6], [8, 9, 10]).to(device)
    greedy = dict(max_new_tokens=4, do_sample=False, eos_token_id=None)
    before = pagedkv.generate(m, clean, **greedy)
    with pytest.raises(RuntimeError, match=r"row\(s\) \[0\] of the batch have NaN or infinite logits"):
        pagedkv.generate(m, ids, max_new_tokens=4, do_sample=True)
    assert_cache_clean(pagedkv.kv_cache_of(m))
    # Greedy takes torch.argmax (NaN is the largest: token 0 for an all-NaN row), as HF does;
    # the NaN left in freed cache blocks reaches no later call.
    out = pagedkv.generate(m, ids, **greedy)
    assert (out[0, 3:] == 0).all()
    if device == "cpu":
        assert torch.equal(out, hf(m, ids, **greedy)) and torch.equal(before, hf(m, clean, **greedy))
    assert torch.equal(pagedkv.generate(m, clean, **greedy), before)
    assert_cache_clean(pagedkv.kv_cache_of(m))


@pytest.mark.usefixtures("engine_overlap")
@pytest.mark.parametrize("device", DEVICES)
def test_sampling_nan_logits_aborts_the_request_in_the_llm(device):
    m = nan_model(device)
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=11, ignore_eos=True)
    alone = LLM(m, num_kv_blocks=16, max_num_seqs=4).generate([[8, 9, 10]], params, use_tqdm=False)
    llm = LLM(m, num_kv_blocks=16, max_num_seqs=4)
    llm.add_request([8, 9, 10], params, request_id="good")
    llm.add_request([5, POISON, 6], params, request_id="bad")
    finished = {}
    with pytest.raises(RuntimeError, match=r"request\(s\) \['bad'\] have NaN or infinite logits"):
        while llm.has_unfinished_requests():
            finished.update((o.request_id, o) for o in llm.step() if o.finished)
    while llm.has_unfinished_requests():  # the engine goes on with the others
        finished.update((o.request_id, o) for o in llm.step() if o.finished)
    assert list(finished) == ["good"] and finished["good"].token_ids == alone[0].token_ids
    assert llm.cache.num_free_blocks == llm.cache.num_blocks and not llm._requests
    with pytest.raises(RuntimeError, match=r"\['0'\] have NaN"):
        llm.generate([[5, POISON]], params, use_tqdm=False)
    assert llm.cache.num_free_blocks == llm.cache.num_blocks and not llm._requests
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)  # argmax, like HF
    outs = llm.generate([[5, POISON], [8, 9, 10]], greedy, use_tqdm=False)
    assert outs[0].token_ids == [0] * 4
    if device == "cpu":
        assert outs[1].token_ids == hf(m, torch.tensor([[8, 9, 10]]), max_new_tokens=4, do_sample=False,
                                       eos_token_id=None)[0, 3:].tolist()


# -- output tensors ------------------------------------------------------------------------------
def test_outputs_are_normal_tensors(gen):
    out = gen(rows(A, B), max_new_tokens=3)
    assert not out.is_inference()
    with torch.enable_grad():
        assert torch.equal(out + 1 - 1, out)
        out.add_(1)  # in place: refused for an inference tensor outside inference mode
    seqs = gen(rows(A), max_new_tokens=3, return_dict_in_generate=True).sequences
    assert not seqs.is_inference()
