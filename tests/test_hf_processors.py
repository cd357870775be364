"""generate()'s processed decode path: HF's own logits processors and stopping criteria, built as
HF's generate builds them and fed the same growing input_ids, between pagedkv's forwards. Each
argument is checked against HF's own generate (tiny fp32 Llama, CPU): same tokens (greedy, and
sampled with the same seed), same scores and logits; each test also checks that its argument
changed the tokens, so that a path that ignored it would fail."""

from __future__ import annotations


import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.generation import MaxLengthCriteria, RepetitionPenaltyLogitsProcessor

import pagedkv
from conftest import DEVICES
from limits import assert_generate_works, gen, model  # noqa: F401 (gen: fixture)
from models import tiny_model
from padded_batch import GREEDY, IDS, MASK, S, A, B, hf  # noqa: F401
from recording_streamer import RecordingStreamer



def ours(gen, ids=IDS, **kwargs):
    return gen(ids, attention_mask=MASK.to(ids.device), **kwargs)


def plain() -> torch.Tensor:
    """HF's greedy tokens without processors [2, S + 8]."""
    return hf(model(), **GREEDY)


class AddZero(LogitsProcessor):
    """Adds 0 (the benchmark's processor): greedy tokens unchanged, but the processed path runs."""

    def __call__(self, input_ids, scores):
        return scores + 0.0


class FavourNext(LogitsProcessor):
    """Raises the token after the one each row fed last: reads input_ids, so it checks what the
    loop feeds it."""

    def __call__(self, input_ids, scores):
        return scores.scatter_add(1, (input_ids[:, -1:] + 1) % scores.shape[1], torch.full_like(scores[:, :1], 8.0))


class StopAfter(StoppingCriteria):
    """Row r is done once it has n_r new tokens (per-row, so rows finish at different steps)."""

    def __init__(self, lengths: list[int]):
        self.lengths = torch.tensor(lengths)

    def __call__(self, input_ids, scores, **kwargs):
        return (input_ids.shape[1] - S) >= self.lengths.to(input_ids.device)


def _cases():
    p = plain()
    first0, first1, second0 = int(p[0, S]), int(p[1, S]), int(p[0, S + 1])
    return {
        "no_repeat_ngram_size": dict(no_repeat_ngram_size=1),
        "bad_words_ids": dict(bad_words_ids=[[first0], [first1]]),
        "suppress_tokens": dict(suppress_tokens=[first0, second0]),
        "begin_suppress_tokens": dict(begin_suppress_tokens=[first0, first1]),
        "sequence_bias": dict(sequence_bias=[[[first0], -50.0], [[first1], -50.0]]),
        "logits_processor": dict(logits_processor=LogitsProcessorList([FavourNext()])),
        "prefix_allowed_tokens_fn": dict(prefix_allowed_tokens_fn=lambda row, ids: list(range(3, 40 + row))),
        # A user processor of a type HF also builds replaces HF's (HF's merge).
        "merged processor": dict(repetition_penalty=1.1,
                                 logits_processor=[RepetitionPenaltyLogitsProcessor(4.0)]),
        "with fast-path settings": dict(no_repeat_ngram_size=1, repetition_penalty=1.3, min_new_tokens=3,
                                        eos_token_id=second0),
        "renormalize_logits": dict(renormalize_logits=True, bad_words_ids=[[first0]]),
        "forced_eos_token_id": dict(forced_eos_token_id=9),  # the last token is 9
        "exponential_decay_length_penalty": dict(exponential_decay_length_penalty=(2, 30.0),
                                                 eos_token_id=int(p[1, S + 4])),
        "encoder_repetition_penalty": dict(encoder_repetition_penalty=5.0),  # favours the prompt's ids
        # repetition_penalty < 1 favours the prompt's ids, which the n-gram ban then bans
        "encoder_no_repeat_ngram_size": dict(encoder_no_repeat_ngram_size=1, repetition_penalty=0.05),
        "watermarking_config": dict(watermarking_config={"bias": 8.0}),
    }


CASES = list(_cases())


@pytest.mark.parametrize("case", CASES)
def test_processors_give_hf_greedy_tokens(gen, case):
    kwargs = {**GREEDY, **_cases()[case]}
    got, expected = ours(gen, **kwargs), hf(model(), **kwargs)
    assert torch.equal(got, expected)
    assert not torch.equal(expected, plain()), "the argument must change the tokens for this test to mean anything"
    assert_generate_works(gen)


def test_forced_bos_token_like_hf(gen):
    """forced_bos_token_id forces the first token of a 1-token prompt (HF's rule)."""
    ids, kwargs = torch.tensor([[5]]), {**GREEDY, "forced_bos_token_id": 9}
    got = gen(ids, **kwargs)
    assert torch.equal(got, type(model()).generate(model(), ids, **kwargs)) and int(got[0, 1]) == 9


def assert_outputs_equal(got, expected):
    assert torch.equal(got.sequences, expected.sequences)
    for name in ("scores", "logits"):
        mine, theirs = getattr(got, name), getattr(expected, name)
        assert (mine is None) == (theirs is None), name
        if theirs is not None:
            assert len(mine) == len(theirs), name
            for step, (a, b) in enumerate(zip(mine, theirs)):
                assert a.dtype == b.dtype and a.shape == b.shape and not a.is_inference(), (name, step)
                torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4, msg=f"{name}[{step}]")


@pytest.mark.parametrize("outputs", [dict(output_scores=True), dict(output_logits=True),
                                     dict(output_scores=True, output_logits=True)])
def test_scores_and_logits_like_hf(gen, outputs):
    """Scores (processed) and logits (raw) per step, finished rows included (HF keeps
    computing them: row 0 meets its EOS at its 2nd token and is padded after)."""
    eos = int(plain()[0, S + 1])
    kwargs = {**GREEDY, "eos_token_id": eos, "no_repeat_ngram_size": 2, "return_dict_in_generate": True,
              "repetition_penalty": 1.2, **outputs}
    got, expected = ours(gen, **kwargs), hf(model(), **kwargs)
    assert_outputs_equal(got, expected)
    assert (expected.sequences[0, S + 2:] == 0).all()


def test_scores_alone_run_the_fast_path_tokens(gen):
    """output_scores with no other processor: HF's scores of the plain greedy step."""
    kwargs = {**GREEDY, "return_dict_in_generate": True, "output_scores": True, "output_logits": True}
    assert_outputs_equal(ours(gen, **kwargs), hf(model(), **kwargs))


@pytest.mark.parametrize("warper", [dict(min_p=0.1), dict(typical_p=0.8), dict(epsilon_cutoff=0.01),
                                    dict(eta_cutoff=0.01), dict(min_p=0.05, top_k=20, top_p=0.9,
                                                                temperature=0.8, no_repeat_ngram_size=2)])
def test_sampling_warpers_draw_hf_tokens_with_the_same_seed(gen, warper):
    """do_sample with the processed path draws as HF's _sample does (softmax, torch.multinomial
    from torch's global RNG): the same seed gives HF's tokens."""
    kwargs = dict(max_new_tokens=10, do_sample=True, eos_token_id=None, pad_token_id=0,
                  return_dict_in_generate=True, output_scores=True, **warper)
    torch.manual_seed(7)
    got = ours(gen, **kwargs)
    torch.manual_seed(7)
    expected = hf(model(), **kwargs)
    assert_outputs_equal(got, expected)
    assert bool(torch.isinf(expected.scores[0]).any()), "the warper must cut some tokens"


def test_stopping_criteria_per_row_like_hf(gen):
    """A user criterion that stops rows at different steps: without an EOS criterion HF does not
    pad a stopped row (it keeps generating it until every row stops); with one it pads."""
    for eos in (None, 2):
        kwargs = {**GREEDY, "max_new_tokens": 10, "eos_token_id": eos,
                  "stopping_criteria": StoppingCriteriaList([StopAfter([3, 6])])}
        got, expected = ours(gen, **kwargs), hf(model(), **kwargs)
        assert torch.equal(got, expected) and expected.shape[1] == S + 6
    assert_generate_works(gen)


def _char_tokenizer():
    """A tokenizer whose 256 ids are single characters, for stop strings."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({chr(0x30 + i): i for i in range(256)}, unk_token="0"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_stop_strings_like_hf(gen):
    p = plain()
    text = ["".join(chr(0x30 + int(t)) for t in row[S:]) for row in p]
    stops = [text[0][1:3], text[1][2:4]]  # row 0's 2nd-3rd tokens, row 1's 3rd-4th
    kwargs = {**GREEDY, "stop_strings": stops, "tokenizer": _char_tokenizer()}
    got, expected = ours(gen, **kwargs), hf(model(), **kwargs)
    assert torch.equal(got, expected) and expected.shape[1] == S + 4


def test_max_time_like_hf(gen):
    """max_time=0: every row is done after its first token (the criterion sees time pass)."""
    kwargs = {**GREEDY, "max_time": 0.0}
    got, expected = ours(gen, **kwargs), hf(model(), **kwargs)
    assert torch.equal(got, expected) and expected.shape[1] == S + 1


def test_processed_path_streams_and_runs_the_processor_each_step(gen):
    seen: list[int] = []

    class Count(LogitsProcessor):
        def __call__(self, input_ids, scores):
            seen.append(input_ids.shape[1])
            return scores

    recorder = RecordingStreamer()
    out = ours(gen, **GREEDY, logits_processor=[Count()], streamer=recorder)
    assert torch.equal(out, plain())
    assert seen == list(range(S, S + 8))  # HF's input_ids: the prompt, then one more per step
    assert recorder.ended and torch.equal(recorder.chunks[0], IDS)
    assert torch.equal(torch.stack(recorder.chunks[1:], 1), out[:, S:])


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(stop_strings=["ab"]), ValueError, r"pagedkv.generate: .*must pass the model's tokenizer"),
    (dict(min_p=2.0, do_sample=True), ValueError, r"pagedkv.generate: `min_p` has to be a float in the \[0, 1\]"),
    (dict(stopping_criteria=[MaxLengthCriteria(max_length=100)]), pagedkv.UnsupportedGenerationArgument,
     r"MaxLengthCriteria\(max_length=100\).*max_new_tokens"),
    (dict(guidance_scale=1.5), pagedkv.UnsupportedGenerationArgument, r"guidance_scale"),
    (dict(logits_processor=[lambda ids, s: 1 / 0]), ZeroDivisionError, "division by zero"),
])
def test_bad_processed_calls_leave_generate_working(gen, kwargs, error, match):
    with pytest.raises(error, match=match):
        ours(gen, **{**GREEDY, **kwargs})
    assert_generate_works(gen)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("graphs", [False, True])
def test_processed_path_on_each_device(device, graphs):
    """The processed path's forward step (a CUDA graph of forward + advance on CUDA) gives HF's
    tokens and scores on the model's device."""
    if graphs and device == "cpu":
        pytest.skip("CUDA graphs need CUDA")
    m = tiny_model("qwen2", device=device)
    ids = IDS.to(device)
    kwargs = {**GREEDY, "no_repeat_ngram_size": 2, "logits_processor": [AddZero()],
              "return_dict_in_generate": True, "output_scores": True}
    expected = hf(m, ids, **kwargs)
    for _ in range(2):  # the second call replays the captured step
        got = pagedkv.generate(m, ids, attention_mask=MASK.to(device), use_cuda_graphs=graphs, **kwargs)
        assert_outputs_equal(got, expected)


@pytest.mark.cuda
def test_a_replayed_logits_step_writes_only_tensors_it_keeps():
    """The captured step of the processed path writes its advance's RNG offsets; a graph whose
    offsets tensor was freed with the first call's step added 1 to whatever tensor took that
    memory next (on an H100 it ended a later call after 3 of 8 tokens). Small tensors allocated
    between the calls take freed blocks; a replay must leave them as they were."""
    m = tiny_model("qwen2", device="cuda")
    kwargs = {**GREEDY, "logits_processor": [AddZero()]}
    ids, mask = IDS.cuda(), MASK.cuda()
    expected = hf(m, ids, **kwargs)
    assert torch.equal(pagedkv.generate(m, ids, attention_mask=mask, use_cuda_graphs=True, **kwargs), expected)
    torch.cuda.synchronize()
    sentinels = [torch.zeros(2, dtype=torch.int64, device="cuda") for _ in range(512)]
    assert torch.equal(pagedkv.generate(m, ids, attention_mask=mask, use_cuda_graphs=True, **kwargs), expected)
    torch.cuda.synchronize()
    assert all(int(s.abs().sum()) == 0 for s in sentinels)
