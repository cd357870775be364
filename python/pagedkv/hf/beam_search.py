"""Beam search (num_beams > 1; with do_sample, beam sampling) on the paged cache, with HF's
own selection and scoring.

HF's _beam_search keeps every beam's K/V in a dense cache and, after each step, gathers the
whole cache along the beams chosen (reorder_cache). Here each running beam is a cache sequence,
and beams share their prefix by block reference: a beam that continues beam j is a fork of j's
sequence and the beams no one continues are freed, so nothing but a shared, partly filled last
block is ever copied (copy-on-write, when the next token is appended). The selection, length
penalty, early stopping and outputs are HF's own helpers (GenerationMixin._get_top_k_continuations
and the rest) on the same tensors, with HF's logits processors and stopping criteria built from
the same config, so sequences, sequences_scores, beam_indices and scores are HF's.

A step is one eager forward of the runner over the B*K beams; the host reads back which beam
each new beam continues and its token (one small copy) to fork and append.
"""

from __future__ import annotations

import copy
import itertools
import math
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.utils import GenerateBeamDecoderOnlyOutput

from pagedkv.hf import arguments
from pagedkv.hf.generation_config import UnsupportedGenerationArgument
from pagedkv.hf.processing import CallArguments
from pagedkv.runtime.fixed_batch import BLOCK_SIZE, FixedBatch, GenerationSettings, check_call
from pagedkv.runtime.runner import ModelRunner, StepInput


class _BeamRows:
    """The running beams as cache sequences: ids[i] is flat beam i's sequence (b * K + k)."""

    def __init__(self, runner: ModelRunner, prompts: list[list[int]], num_beams: int):
        self.runner, self.cache = runner, runner.cache
        self.ids = [b for b in range(len(prompts)) for _ in range(num_beams)]
        self._next_id = len(prompts)
        self.prompts = prompts

    def prefill(self) -> torch.Tensor:
        """Each prompt once (its K beams share its blocks): logits [B, V] of its last token."""
        cache, computed = self.cache, []
        for sid, prompt in enumerate(self.prompts):
            cached = cache.add_sequence(sid, prompt)  # tokens already in the prefix cache
            computed.append(prompt[cached:])
        lens = [len(c) for c in computed]
        last = list(itertools.accumulate(lens, initial=-1))[1:]  # each prompt's last token
        return self.runner.run(StepInput(list(range(len(self.prompts))), [t for c in computed for t in c],
                                         lens, last))

    def advance(self, sources: list[int], tokens: list[int]) -> torch.Tensor:
        """New beam i continues flat beam sources[i] with tokens[i]: a fork of its sequence
        (blocks shared), the old beams freed, then one decode step. Returns logits [B*K, V]."""
        cache = self.cache
        new_ids = list(range(self._next_id, self._next_id + len(sources)))
        self._next_id += len(sources)
        for new, src in zip(new_ids, sources):
            cache.fork(self.ids[src], new)
        for old in dict.fromkeys(self.ids):  # every K/V of theirs was written: blocks stay cached
            cache.free(old)
        self.ids = new_ids
        cache.append_batch(new_ids, tokens)  # copies a last block still shared (copy-on-write)
        return self.runner.run(StepInput(new_ids, tokens, None))


def _blocks_needed(prompts: list[list[int]], num_beams: int, max_new: int) -> int:
    """At most K beams of each prompt, each at most prompt + max_new - 1 tokens held at once."""
    return sum(num_beams * math.ceil((len(p) + max_new) / BLOCK_SIZE) for p in prompts)


def _hf_config(model, config: GenerationConfig, width: int, max_new: int, device: torch.device,
               batch: int) -> GenerationConfig:
    """The config as HF's generate prepares it before _beam_search: lengths (max_length counts the
    padded prompt; min_new_tokens becomes a min_length) and the special tokens as tensors."""
    cfg = copy.deepcopy(config)
    cfg.max_length = width + max_new
    if cfg.min_new_tokens is not None:
        cfg.min_length = cfg.min_new_tokens + width
    # None: no padding warnings (resolve_generation gave HF's already)
    model._prepare_special_tokens(cfg, None, device=device, batch_size=batch)
    return cfg


def _check(settings: GenerationSettings, streamer, tp) -> None:
    """Refuse what HF refuses with beams, and what pagedkv does not run with them (settings
    neither implements, e.g. num_beam_groups, were refused by resolve_generation)."""
    if streamer is not None:  # HF's own check and message
        raise ValueError("`streamer` cannot be used with beam search (yet!). Make sure that `num_beams` is "
                         "set to 1.")
    if settings.do_sample and tp is not None:
        raise UnsupportedGenerationArgument(
            "pagedkv.generate: beam sampling (num_beams > 1 with do_sample=True) is not supported under "
            "tensor parallelism (each rank would draw its own beams); use do_sample=False")


def beam_search(model, fixed_batch: FixedBatch, prompts: list[list[int]], input_ids: torch.Tensor,
                attention_mask: torch.Tensor | None, generation_config: GenerationConfig | None,
                kwargs: dict[str, Any], call: CallArguments, settings: GenerationSettings,
                streamer) -> GenerateBeamDecoderOnlyOutput:
    """HF's _beam_search on the paged cache. input_ids: [B, S] left-padded (prompts: each row's
    real tokens); attention_mask: [B, S], given or inferred, or None (every token real);
    generation_config and kwargs: the call's settings (call: its processors and criteria),
    `settings` the same resolved. Returns HF's output (sequences [B * num_return_sequences,
    S + N]), its tensors made in inference mode (see plain())."""
    config = model._prepare_generation_config(generation_config, **arguments.normalized(kwargs))[0]
    _check(settings, streamer, fixed_batch.model.tp)
    prepared = fixed_batch.model
    num_beams, batch, width = config.num_beams, *input_ids.shape
    device = input_ids.device
    max_new = settings.max_new_tokens
    longest = check_call(prepared, prompts, settings, config)
    cfg = _hf_config(model, config, width, max_new, device, batch)
    expanded_mask = None  # HF's processors see the mask expanded to the beams, none when all ones
    if attention_mask is not None and not bool((attention_mask == 1).all()):
        expanded_mask = attention_mask.repeat_interleave(num_beams, dim=0)
    try:
        processors = model._get_logits_processor(
            generation_config=cfg, input_ids_seq_length=width, encoder_input_ids=input_ids,
            prefix_allowed_tokens_fn=call.prefix_allowed_tokens_fn,
            logits_processor=LogitsProcessorList(call.logits_processor or []), device=device,
            model_kwargs={"attention_mask": expanded_mask})
        criteria = model._get_stopping_criteria(cfg, StoppingCriteriaList(call.stopping_criteria or []),
                                                tokenizer=call.tokenizer)
    except ValueError as error:  # HF's checks of the settings (min_p in [0, 1], ...)
        if str(error).startswith("pagedkv"):
            raise
        raise ValueError(f"pagedkv.generate: {error}") from error

    runner = fixed_batch.runner_for(_blocks_needed(prompts, num_beams, max_new), batch * num_beams,
                                    sum(map(len, prompts)), longest)
    runner.cache.free_all(keep_cached=False)  # rows of a call interrupted in its own clean-up
    rows = _BeamRows(runner, prompts, num_beams)
    try:
        output = _search(model, rows, input_ids, cfg, processors, criteria)
    except BaseException:
        runner.cache.free_all(keep_cached=False)  # blocks whose K/V may never have been written
        raise
    runner.cache.free_all()  # the beams' full blocks stay in the prefix cache for a later prompt
    return output


def _search(model, rows: _BeamRows, input_ids: torch.Tensor, cfg: GenerationConfig,
            processors: LogitsProcessorList, criteria: StoppingCriteriaList) -> GenerateBeamDecoderOnlyOutput:
    """HF's _beam_search loop (transformers 5.x, vectorized), step for step; only the forward
    and the cache's reorder (forks) are pagedkv's."""
    pad_token_id, eos_token_id = cfg._pad_token_tensor, cfg._eos_token_tensor
    scores_wanted = cfg.return_dict_in_generate and cfg.output_scores
    logits_wanted = cfg.return_dict_in_generate and cfg.output_logits
    early_stopping, length_penalty = cfg.early_stopping, cfg.length_penalty
    max_length, num_beams, do_sample = cfg.max_length, cfg.num_beams, cfg.do_sample
    batch_size, cur_len = input_ids.shape
    prompt_len = cur_len
    device = input_ids.device
    n_eos = eos_token_id.shape[0] if eos_token_id is not None else 0
    beams_to_keep = max(2, 1 + n_eos) * num_beams
    top_num_beam_mask = torch.cat((torch.ones(num_beams, dtype=torch.bool),
                                   torch.zeros(beams_to_keep - num_beams, dtype=torch.bool))).to(device)
    all_scores = () if scores_wanted else None
    raw_logits = () if logits_wanted else None

    # HF's expression, precedence included: (pad or eos[0]) if there is an EOS, else -1.
    output_fill_value = pad_token_id or eos_token_id[0] if eos_token_id is not None else -1
    running_sequences = torch.full((batch_size, num_beams, max_length), fill_value=output_fill_value,
                                   dtype=torch.int64, device=device)  # [B, K, max_length]
    running_sequences[:, :, :cur_len] = input_ids.repeat_interleave(num_beams, dim=0).view(
        batch_size, num_beams, cur_len)
    sequences = running_sequences.detach().clone()  # finished hypotheses, best first
    running_beam_scores = torch.zeros((batch_size, num_beams), dtype=torch.float, device=device)
    running_beam_scores[:, 1:] = -1e9  # only the first beam's tokens count at the first step
    beam_scores = torch.full((batch_size, num_beams), fill_value=-1e9, dtype=torch.float, device=device)
    is_sent_finished = torch.zeros((batch_size, num_beams), dtype=torch.bool, device=device)
    is_early_stop_heuristic_unsatisfied = torch.ones((batch_size, 1), dtype=torch.bool, device=device)
    next_token_hits_stopping_criteria = torch.zeros((batch_size, num_beams), dtype=torch.bool, device=device)
    running_beam_indices = torch.full((batch_size, num_beams, max_length - cur_len), fill_value=-1,
                                      dtype=torch.int32, device=device)
    beam_indices = running_beam_indices.detach().clone()

    # The K beams of a prompt are alike at the first step: one prefill row each, repeated.
    logits = rows.prefill().repeat_interleave(num_beams, dim=0)  # [B*K, V]
    flat_running_sequences = model._flatten_beam_dim(running_sequences[:, :, :cur_len])
    while True:
        logits = logits.to(copy=True, dtype=torch.float32)
        log_probs = torch.nn.functional.log_softmax(logits, dim=-1)
        log_probs = processors(flat_running_sequences, log_probs)
        if logits_wanted:
            raw_logits += (logits.clone(),)
        if scores_wanted:
            all_scores += (log_probs.clone(),)
        log_probs = model._unflatten_beam_dim(log_probs, batch_size, num_beams)
        log_probs = log_probs + running_beam_scores[:, :, None]
        log_probs = torch.reshape(log_probs, (batch_size, -1))  # [B, K * V]

        topk_log_probs, topk_running_sequences, topk_running_beam_indices = model._get_top_k_continuations(
            accumulated_log_probs=log_probs, running_sequences=running_sequences,
            running_beam_indices=running_beam_indices, cur_len=cur_len, decoder_prompt_len=prompt_len,
            do_sample=do_sample, beams_to_keep=beams_to_keep, num_beams=num_beams, batch_size=batch_size,
            vocab_size=log_probs.shape[-1] // num_beams)  # transformers <= 5.1x needs it; later ones ignore it
        next_token_hits_stopping_criteria = criteria(
            model._flatten_beam_dim(topk_running_sequences[:, :, :cur_len + 1]), all_scores)
        next_token_hits_stopping_criteria = model._unflatten_beam_dim(
            next_token_hits_stopping_criteria, batch_size, beams_to_keep)
        running_sequences, running_beam_scores, running_beam_indices = model._get_running_beams_for_next_iteration(
            topk_log_probs=topk_log_probs, topk_running_sequences=topk_running_sequences,
            topk_running_beam_indices=topk_running_beam_indices,
            next_token_hits_stopping_criteria=next_token_hits_stopping_criteria, num_beams=num_beams)
        sequences, beam_scores, beam_indices, is_sent_finished = model._update_finished_beams(
            sequences=sequences, topk_running_sequences=topk_running_sequences, beam_scores=beam_scores,
            topk_log_probs=topk_log_probs, beam_indices=beam_indices,
            topk_running_beam_indices=topk_running_beam_indices,
            is_early_stop_heuristic_unsatisfied=is_early_stop_heuristic_unsatisfied,
            is_sent_finished=is_sent_finished, next_token_hits_stopping_criteria=next_token_hits_stopping_criteria,
            top_num_beam_mask=top_num_beam_mask, num_beams=num_beams, cur_len=cur_len,
            decoder_prompt_len=prompt_len, length_penalty=length_penalty, early_stopping=early_stopping)
        # What the cache reorder needs: which beam each new beam continues, with which token.
        sources = model._flatten_beam_dim(running_beam_indices[..., cur_len - prompt_len]).long()  # [B*K]
        tokens = model._flatten_beam_dim(running_sequences[:, :, cur_len])  # [B*K]

        cur_len = cur_len + 1
        is_early_stop_heuristic_unsatisfied = model._check_early_stop_heuristic(
            is_early_stop_heuristic_unsatisfied=is_early_stop_heuristic_unsatisfied,
            running_beam_scores=running_beam_scores, beam_scores=beam_scores, is_sent_finished=is_sent_finished,
            cur_len=cur_len, max_length=max_length, decoder_prompt_len=prompt_len,
            early_stopping=early_stopping, length_penalty=length_penalty)
        unfinished = model._beam_search_has_unfinished_sequences(
            is_early_stop_heuristic_unsatisfied, is_sent_finished, next_token_hits_stopping_criteria,
            early_stopping)
        *read, go_on = torch.cat([sources, tokens, unfinished.view(1).long()]).tolist()  # the step's one sync
        if not go_on:
            break
        sources, tokens = read[:len(read) // 2], read[len(read) // 2:]
        logits = rows.advance(sources, tokens)  # [B*K, V]
        flat_running_sequences = model._flatten_beam_dim(running_sequences[:, :, :cur_len])

    num_return_sequences = cfg.num_return_sequences
    sequences = model._flatten_beam_dim(sequences[:, :num_return_sequences, :])
    beam_scores = model._flatten_beam_dim(beam_scores[:, :num_return_sequences])
    beam_indices = model._flatten_beam_dim(beam_indices[:, :num_return_sequences, :])
    # beam_indices is -1 past each hypothesis' length: the longest sets the output's width.
    max_generated_length = ((beam_indices + 1).bool()).sum(dim=1).max()
    sequences = sequences[:, :prompt_len + max_generated_length]
    beam_indices = beam_indices[:, :max_generated_length]
    return GenerateBeamDecoderOnlyOutput(
        sequences=sequences, sequences_scores=beam_scores if cfg.output_scores else None,
        scores=all_scores, logits=raw_logits, beam_indices=beam_indices)


def plain(output: GenerateBeamDecoderOnlyOutput) -> GenerateBeamDecoderOnlyOutput:
    """The output's tensors as ordinary tensors (HF's are; they were made in inference mode).
    Call outside inference mode."""
    with torch.no_grad():
        return GenerateBeamDecoderOnlyOutput(**{
            k: v.clone() if isinstance(v, torch.Tensor) else tuple(t.clone() for t in v)
            for k, v in output.items()})
