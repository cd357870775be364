"""pagedkv.generate against HF generate, token for token (fp32, CPU in CI; bf16 on the GPU)."""

from __future__ import annotations

import pytest
import torch

import pagedkv
from conftest import DEVICES
from tolerance import assert_tokens_equal_up_to_near_tie
from models import ARCHITECTURES, tiny_model
from recording_streamer import RecordingStreamer


def left_padded_batch(lengths, vocab, device, pad=0):
    width = max(lengths)
    ids = torch.full((len(lengths), width), pad, dtype=torch.int64)
    mask = torch.zeros(len(lengths), width, dtype=torch.int64)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(3, vocab, (n,))
        mask[row, width - n:] = 1
    return ids.to(device), mask.to(device)


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
@pytest.mark.parametrize("lengths", [[7], [5, 17, 1, 33]])
def test_greedy_matches_hf(arch, lengths):
    model = tiny_model(arch)
    ids, mask = left_padded_batch(lengths, model.config.vocab_size, "cpu")
    kwargs = dict(max_new_tokens=24, do_sample=False, eos_token_id=None)
    expected = model.generate(ids, attention_mask=mask, **kwargs)
    got = pagedkv.generate(model, ids, attention_mask=mask, **kwargs)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("prompt, new", [(17, 16), (16, 16), (1, 15), (15, 1)])
def test_block_boundaries(prompt, new):
    """Prompt + new tokens ending exactly on (or next to) a 16-token block boundary."""
    model = tiny_model("llama")
    ids, _ = left_padded_batch([prompt], model.config.vocab_size, "cpu")
    kwargs = dict(max_new_tokens=new, do_sample=False, eos_token_id=None)
    assert torch.equal(pagedkv.generate(model, ids, **kwargs), model.generate(ids, **kwargs))


def test_eos_stops_and_pads_like_hf():
    model = tiny_model("qwen2")
    ids, mask = left_padded_batch([6, 11, 3], model.config.vocab_size, "cpu")
    free_run = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                              eos_token_id=None)
    # Make the 4th new token of row 1 an EOS: HF stops that row there and pads after it.
    eos = int(free_run[1, ids.shape[1] + 3])
    kwargs = dict(max_new_tokens=20, do_sample=False, eos_token_id=[eos, 2], pad_token_id=0)
    expected = model.generate(ids, attention_mask=mask, **kwargs)
    got = pagedkv.generate(model, ids, attention_mask=mask, **kwargs)
    assert torch.equal(got, expected)
    assert (got[1, ids.shape[1] + 4:] == 0).all()


def test_min_new_tokens_and_repetition_penalty_like_hf():
    model = tiny_model("llama")
    ids, mask = left_padded_batch([9, 4], model.config.vocab_size, "cpu")
    free_run = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                              eos_token_id=None)
    eos = int(free_run[0, ids.shape[1] + 1])
    kwargs = dict(max_new_tokens=12, do_sample=False, eos_token_id=eos, min_new_tokens=5,
                  repetition_penalty=1.3)
    expected = model.generate(ids, attention_mask=mask, **kwargs)
    got = pagedkv.generate(model, ids, attention_mask=mask, **kwargs)
    assert torch.equal(got, expected)


def test_streamer_sees_the_returned_tokens():
    model = tiny_model("qwen3")
    ids, _ = left_padded_batch([8], model.config.vocab_size, "cpu")
    recorder = RecordingStreamer()
    out = pagedkv.generate(model, ids, max_new_tokens=10, do_sample=False, streamer=recorder)
    assert recorder.ended
    assert torch.equal(recorder.chunks[0], ids.cpu())
    assert torch.equal(torch.cat([c.view(-1) for c in recorder.chunks[1:]]), out[0, ids.shape[1]:].cpu())


def test_sampling_is_reproducible_with_a_seed():
    model = tiny_model("llama")
    ids, mask = left_padded_batch([5, 9], model.config.vocab_size, "cpu")
    kwargs = dict(max_new_tokens=16, do_sample=True, temperature=1.5, top_k=40, top_p=0.9,
                  eos_token_id=None)
    torch.manual_seed(123)
    first = pagedkv.generate(model, ids, attention_mask=mask, **kwargs)
    torch.manual_seed(123)
    again = pagedkv.generate(model, ids, attention_mask=mask, **kwargs)
    torch.manual_seed(124)
    other = pagedkv.generate(model, ids, attention_mask=mask, **kwargs)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def test_return_dict_and_patch():
    model = tiny_model("mistral")
    ids, mask = left_padded_batch([4, 6], model.config.vocab_size, "cpu")
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    pagedkv.patch(model)
    try:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                             return_dict_in_generate=True)
    finally:
        pagedkv.unpatch(model)
    assert torch.equal(out.sequences, expected)
    assert model.generate.__func__ is type(model).generate


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(num_beams=2, num_return_sequences=3), ValueError, r"has to be smaller or equal to .num_beams"),
    (dict(max_new_tokens=600), ValueError, r"max_position_embeddings is 512"),
])
def test_bad_calls_leave_the_cache_clean(kwargs, error, match):
    model = tiny_model("llama")
    ids, mask = left_padded_batch([4], model.config.vocab_size, "cpu")
    with pytest.raises(error, match=match):
        pagedkv.generate(model, ids, attention_mask=mask, **kwargs)
    out = pagedkv.generate(model, ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 7)


def test_bad_inputs_are_named():
    model = tiny_model("llama")
    ids, mask = left_padded_batch([4, 2], model.config.vocab_size, "cpu")
    with pytest.raises(ValueError, match="attention_mask must be left-padded"):
        pagedkv.generate(model, ids, attention_mask=mask.flip(1), max_new_tokens=2)
    with pytest.raises(ValueError, match=r"input_ids has dtype torch.float32"):
        pagedkv.generate(model, ids.float(), max_new_tokens=2)
    with pytest.raises(ValueError, match=r"input_ids hold ids in \[.*\]; allowed: \[0, 255\]"):
        pagedkv.generate(model, ids + 1000, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"input_ids is empty"):
        pagedkv.generate(model, ids[:, :0], max_new_tokens=2)


def test_padding_rows_of_a_bucket_are_inert():
    """A batch of 3 in a 4-row bucket (CUDA graphs pad to buckets): the spare row must not
    index anything. Exercised on the CPU through the eager path with a padded state."""
    from pagedkv.runtime.decode_state import DecodeState

    state = DecodeState.allocate(4, 2, None, 16, torch.device("cpu"))
    state.block_tables.fill_(7)  # stale rows of an earlier call
    state.start(torch.tensor([5, 17, 9], dtype=torch.int32),
                torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32))
    assert state.positions.tolist() == [4, 16, 8, 0] and state.context_lens.tolist() == [5, 17, 9, 0]
    assert state.block_tables[3].tolist() == [0, 0]
    offsets = torch.zeros(4, dtype=torch.int64)
    state.advance(torch.tensor([7, 8, 9, 0]), offsets)
    assert state.slot_mapping.tolist() == [5, 3 * 16 + 1, 4 * 16 + 9, -1]
    assert state.context_lens.tolist() == [6, 18, 10, 0]
    assert state.tokens.tolist()[:3] == [7, 8, 9] and offsets.tolist()[:3] == [1, 1, 1]


@pytest.mark.cuda
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("graphs", [False, True])
def test_bf16_on_gpu_agrees_with_hf(arch, graphs):
    """bf16: equal tokens up to the first near-tie of HF's logits (the usual allowance)."""
    model = tiny_model(arch, dtype=torch.bfloat16, device="cuda")
    ids, mask = left_padded_batch([5, 17, 9], model.config.vocab_size, "cuda")
    kwargs = dict(max_new_tokens=16, do_sample=False, eos_token_id=None)
    hf = model.generate(ids, attention_mask=mask, output_logits=True, return_dict_in_generate=True, **kwargs)
    got = pagedkv.generate(model, ids, attention_mask=mask, use_cuda_graphs=graphs, **kwargs)
    assert_tokens_equal_up_to_near_tie(got, hf, ids.shape[1])


def test_inputs_embeds_is_refused_by_name():
    """The error names inputs_embeds (not a missing input_ids) and says what to pass."""
    model = tiny_model("llama")
    embeds = torch.randn(1, 3, model.config.hidden_size)
    with pytest.raises(pagedkv.UnsupportedGenerationArgument,
                       match=r"inputs_embeds is not supported: pagedkv\.generate takes token ids; pass input_ids"):
        pagedkv.generate(model, inputs_embeds=embeds, max_new_tokens=2)


def test_right_padding_error_says_how_to_pad_left():
    model = tiny_model("llama")
    ids = torch.tensor([[5, 6, 7], [5, 6, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])  # right-padded, as a tokenizer's default gives
    with pytest.raises(ValueError, match=r"tokenizer\.padding_side = \"left\""):
        pagedkv.generate(model, ids, attention_mask=mask, max_new_tokens=2)
