"""HF's cheap logits processors on generate()'s fast path (the captured decode step): single-token
suppress_tokens, begin_suppress_tokens, bad_words_ids and sequence_bias as one additive [V]
vector, and min_p with do_sample where its set is exactly HF's (top_p == 1). Greedy tokens equal
HF's own generate (tiny fp32 Llama, CPU); a spy shows which path ran. Each case also checks that
its setting changed the tokens, so a path that ignored it would fail."""

from __future__ import annotations


import pytest
import torch

import pagedkv
from conftest import DEVICES
from limits import assert_generate_works, gen, model  # noqa: F401 (gen: fixture)
from models import tiny_model
from padded_batch import GREEDY, IDS, MASK, S, A, B, hf  # noqa: F401
from pagedkv.hf import processed_decode
from pagedkv.runtime import fixed_batch



@pytest.fixture
def paths(monkeypatch):
    """Which decode paths ran: 'processed' (HF's processors on the host) and/or 'fast' (the
    captured step), with the fast steps' samplers."""
    ran: dict[str, list] = {"processed": [], "fast": []}
    processed_call = processed_decode.ProcessedDecode.__call__
    decode_step = fixed_batch.FixedBatch._decode_step

    def spy_processed(self, *args):
        ran["processed"].append(self)
        return processed_call(self, *args)

    def spy_fast(self, *args):
        replay, state, sampler = decode_step(self, *args)
        ran["fast"].append(sampler)
        return replay, state, sampler

    monkeypatch.setattr(processed_decode.ProcessedDecode, "__call__", spy_processed)
    monkeypatch.setattr(fixed_batch.FixedBatch, "_decode_step", spy_fast)
    return ran


def plain() -> torch.Tensor:
    return hf(model(), **GREEDY)  # [2, S + 8]


def _cases():
    p = plain()
    first0, first1, second0, third1 = int(p[0, S]), int(p[1, S]), int(p[0, S + 1]), int(p[1, S + 2])
    fourth0 = int(p[0, S + 3])
    return {
        "suppress_tokens": dict(suppress_tokens=[first0, second0, 10**6]),  # out of vocabulary: ignored
        "begin_suppress_tokens": dict(begin_suppress_tokens=[first0, first1]),
        "bad_words_ids": dict(bad_words_ids=[[first0], [first1]]),
        "bad word that is the EOS": dict(bad_words_ids=[[first0], [third1]], eos_token_id=third1),
        "sequence_bias": dict(sequence_bias=[[[first0], -50.0], [[first1], -50.0]]),
        "sequence_bias up": dict(sequence_bias=[[[fourth0], 6.0], [[third1], 6.0]]),
        "all of them": dict(suppress_tokens=[first0], begin_suppress_tokens=[first1],
                            bad_words_ids=[[second0]], sequence_bias=[[[third1], -0.5], [[A[0]], 2.0]]),
        # HF adds sequence_bias before the repetition penalty divides (or multiplies) the logits
        "with repetition_penalty": dict(sequence_bias=[[[fourth0], 5.0], [[third1], 5.0], [[A[3]], -2.0]],
                                        repetition_penalty=1.8, suppress_tokens=[first0]),
        "with min_new_tokens": dict(suppress_tokens=[first1], begin_suppress_tokens=[first0],
                                    min_new_tokens=4, eos_token_id=[second0, third1]),
    }


CASES = list(_cases())


@pytest.mark.parametrize("case", CASES)
def test_cheap_processors_give_hf_greedy_tokens_on_the_fast_path(gen, paths, case):
    kwargs = {**GREEDY, **_cases()[case]}
    got, expected = gen(IDS, attention_mask=MASK, **kwargs), hf(model(), **kwargs)
    assert torch.equal(got, expected)
    assert not torch.equal(expected, hf(model(), **{k: v for k, v in kwargs.items() if k not in (
        "suppress_tokens", "begin_suppress_tokens", "bad_words_ids", "sequence_bias")})), \
        "the processors must change the tokens for this test to mean anything"
    assert paths["fast"] and not paths["processed"]
    assert_generate_works(gen)


@pytest.mark.parametrize("kwargs", [dict(bad_words_ids=[[5], [6, 7]]), dict(sequence_bias=[[[5, 6], 2.0]]),
                                    dict(suppress_tokens=[5], no_repeat_ngram_size=2),
                                    dict(min_p=0.2, top_p=0.9, do_sample=True)])
def test_multi_token_words_and_other_settings_stay_processed(paths, kwargs):
    m = model()
    torch.manual_seed(3)
    got = pagedkv.generate(m, IDS, attention_mask=MASK, **{**GREEDY, **kwargs})
    torch.manual_seed(3)
    assert torch.equal(got, hf(m, **{**GREEDY, **kwargs}))
    assert paths["processed"] and not paths["fast"]


def test_no_processor_no_cost(paths):
    """Without these settings the step is today's: no bias vector, no min_p tensors."""
    pagedkv.generate(model(), IDS, attention_mask=MASK, **GREEDY)
    (sampler,) = paths["fast"]
    assert sampler.bias is None and sampler.min_p is None


def test_bad_fast_processor_values_raise_and_leave_generate_working(gen):
    for kwargs, match in [(dict(sequence_bias=[[[10**6], 1.0]]), r"pagedkv.generate: .*vocabulary size is 256"),
                          (dict(sequence_bias=[[[5], 1]]), r"pagedkv.generate: Each element in `sequence_bias`"),
                          (dict(bad_words_ids=[[-1]]), r"pagedkv.generate: Each list in `bad_words_ids`"),
                          (dict(min_p=2.0, do_sample=True), r"pagedkv.generate: `min_p` has to be a float")]:
        with pytest.raises(ValueError, match=match):
            gen(IDS, attention_mask=MASK, **{**GREEDY, **kwargs})
        assert_generate_works(gen)


SAMPLE = dict(max_new_tokens=12, do_sample=True, eos_token_id=None, pad_token_id=0)


@pytest.mark.parametrize("warpers", [dict(), dict(temperature=0.7), dict(top_k=30, temperature=1.3)])
def test_min_p_sampling_on_the_fast_path(paths, warpers):
    """No drawn token below min_p * p_max; a seed reproduces; min_p cut tokens HF's sampling
    would otherwise draw (the same seed without min_p draws some below the threshold)."""
    m, min_p = model(), 0.6
    temperature = warpers.get("temperature", 1.0)
    ids, mask = IDS.repeat(4, 1), MASK.repeat(4, 1)  # 8 rows x 12 draws
    runs = []
    for _ in range(2):
        torch.manual_seed(11)
        runs.append(pagedkv.generate(m, ids, attention_mask=mask, min_p=min_p, **SAMPLE, **warpers))
    assert torch.equal(runs[0], runs[1])
    assert paths["fast"] and not paths["processed"]
    drawn = _drawn_ratio(m, runs[0], mask, temperature)
    assert bool((drawn >= min_p).all())
    torch.manual_seed(11)
    free = pagedkv.generate(m, ids, attention_mask=mask, **SAMPLE, **warpers)
    assert bool((_drawn_ratio(m, free, mask, temperature) < min_p).any())


def _drawn_ratio(m, sequences, mask, temperature) -> torch.Tensor:
    """p(drawn token) / p_max at each generated position: [B, N]."""
    full = torch.cat([mask, torch.ones_like(sequences[:, S:])], dim=1)
    with torch.no_grad():
        logits = m(sequences, attention_mask=full).logits[:, S - 1:-1].float()  # [B, N, V]
    probs = torch.softmax(logits / temperature, dim=-1)
    picked = probs.gather(2, sequences[:, S:, None]).squeeze(2)
    return picked / probs.amax(-1)


def test_min_p_one_samples_hf_greedy_tokens(gen, paths):
    """min_p = 1 keeps only the top token: sampling gives HF's greedy tokens, with the cheap
    processors and repetition penalty in HF's order before it."""
    extra = dict(repetition_penalty=1.5, sequence_bias=[[[A[2]], 2.0]], suppress_tokens=[int(plain()[0, S])])
    torch.manual_seed(0)
    got = gen(IDS, attention_mask=MASK, min_p=1.0, top_k=40, temperature=0.9, **SAMPLE, **extra)
    assert torch.equal(got, hf(model(), **{**GREEDY, "max_new_tokens": 12, **extra}))
    assert paths["fast"] and not paths["processed"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("graphs", [False, True])
def test_fast_processors_on_each_device(device, graphs, paths):
    """With CUDA graphs, one captured step serves every value: the second and third calls
    replay it with other tokens suppressed and biased, and still give HF's tokens."""
    if graphs and device == "cpu":
        pytest.skip("CUDA graphs need CUDA")
    m = tiny_model("qwen2", device=device)
    ids, mask = IDS.to(device), MASK.to(device)
    base = hf(m, ids, **GREEDY)
    first0, first1 = int(base[0, S]), int(base[1, S])
    for kwargs in (dict(suppress_tokens=[first0], sequence_bias=[[[first1], -9.0]], min_new_tokens=2),
                   dict(suppress_tokens=[first1], sequence_bias=[[[first0], 5.0]], begin_suppress_tokens=[3]),
                   dict(bad_words_ids=[[first0], [first1]], repetition_penalty=1.4)):
        kwargs = {**GREEDY, **kwargs}
        got = pagedkv.generate(m, ids, attention_mask=mask, use_cuda_graphs=graphs, **kwargs)
        assert torch.equal(got, hf(m, ids, **kwargs)), kwargs
    torch.manual_seed(0)
    got = pagedkv.generate(m, ids, attention_mask=mask, use_cuda_graphs=graphs, min_p=1.0, **SAMPLE)
    assert torch.equal(got, hf(m, ids, **{**GREEDY, "max_new_tokens": 12}))
    assert len(paths["fast"]) == 4 and not paths["processed"]


def test_a_banned_token_with_an_infinite_logit_is_not_chosen():
    """HF bans with masked_fill (-inf whatever the logit); adding -inf to a +inf logit gives NaN,
    which argmax would choose. The ban must hold for any logit a broken model produces."""
    from pagedkv.runtime.fast_processors import FastProcessors
    from pagedkv.runtime.sampler import Sampler

    vocab = 32
    sampler = Sampler(1, torch.device("cpu"), bias_vocab=vocab)
    sampler.fill_processors(FastProcessors(bias=((3, -float("inf")), (5, 2.0))), vocab)
    logits = torch.zeros(1, vocab)
    logits[0, 3] = float("inf")
    logits[0, 7] = 1.0
    assert int(sampler(logits)[0]) == 5  # 0 + 2.0 bias beats 1.0; 3 stays banned
