"""A draft model's proposals for greedy speculative decoding in generate() (HF's
``assistant_model`` / ``num_assistant_tokens`` / ``num_assistant_tokens_schedule``), for batches
of any size. With the "constant" schedule the whole round runs on the device
(runtime/draft_rounds.py), on this
module's draft cache; otherwise DraftProposer proposes on the host's orders and
runtime/prompt_lookup.py verifies its proposals with the target as it verifies n-gram ones.

The draft runs through pagedkv too, on its own PreparedModel, runner and KV cache (the draft's
generate() cache: its own block pool). A row's draft sequence holds the prompt and the row's new
tokens but the last ones it has not seen; each round feeds those (the bonus token of the last
round, and the last accepted proposal token, which the draft proposed but never fed) as the first
step, then decodes greedily one token per step, up to min(k, remaining max_new_tokens - 1) tokens,
stopping after an EOS (HF's assistant stops there too). After verification the draft sequence is
truncated to the accepted prefix. k follows HF's AssistedCandidateGenerator per row: "constant"
keeps it; "heuristic" and "heuristic_transient" add 2 when every proposed token was accepted,
else take 1 off (at least 1); "heuristic" leaves the rows' last k (their mean, rounded; a
batch of one: HF's) in the draft's generation_config for the next call, as HF does.
HF's assistant_confidence_threshold (stopping the draft early where it is unsure) is not applied:
it changes how many tokens are proposed, never the tokens generated.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Iterator

import torch

from pagedkv.models.registry import support_path, unsupported_reason
from pagedkv.runtime.fixed_batch import BLOCK_SIZE, FixedBatch
from pagedkv.runtime.model import PreparedModel, prepared
from pagedkv.runtime.prefix_reuse import weights_version
from pagedkv.runtime.runner import ModelRunner, StepInput

SCHEDULES = ("constant", "heuristic", "heuristic_transient")


class DraftRefused(ValueError):
    """An assistant_model pagedkv does not draft with (hf/generate.py re-raises it as
    UnsupportedGenerationArgument)."""


def check_draft(target, draft) -> None:
    """Refuse, naming why, a draft pagedkv cannot run next to `target` (both HF models); takes
    the draft's weights (its PreparedModel) when it can."""
    if draft is target:
        raise DraftRefused("assistant_model is the model itself; pass a smaller model of the same "
                           "vocabulary (e.g. a layer-truncated copy)")
    config = getattr(draft, "config", None)
    if not isinstance(draft, torch.nn.Module) or config is None:
        raise DraftRefused(f"assistant_model must be an HF causal LM, got {type(draft).__name__}")
    vocab, target_vocab = getattr(config, "vocab_size", None), target.config.vocab_size
    if vocab != target_vocab:
        raise DraftRefused(f"assistant_model has vocab_size {vocab} but the model has {target_vocab}; "
                           "the draft must share the model's tokenizer and vocabulary (HF's universal "
                           "assisted decoding with assistant_tokenizer is not supported)")
    path = support_path(draft)
    if path != "native":
        reason = unsupported_reason(draft) if path is None else "pagedkv runs it by its own HF modules"
        raise DraftRefused(f"assistant_model {type(draft).__name__} (model_type "
                           f"{config.model_type!r}) is not a type pagedkv runs natively ({reason}); "
                           "allowed: a draft of a natively run type (pagedkv.support_path(draft) == 'native')")
    target_device = next(target.parameters()).device
    device = next(draft.parameters()).device
    if device != target_device:
        raise DraftRefused(f"assistant_model is on {device} but the model on {target_device}; "
                           "put both on one device")
    check_draft_state(prepared(draft))


def greedy_step(runner: ModelRunner, seq_ids: list[int], feeds: list[list[int]]) -> list[int]:
    """One draft step (generate()'s DraftProposer, the engine's EngineDraft): each sequence fed
    its tokens, its greedy token after them; a decode step when every feed is one token."""
    lens = [len(f) for f in feeds]
    decode = all(n == 1 for n in lens)
    last = None if decode else list(itertools.accumulate(lens, initial=-1))[1:]
    logits = runner.run(StepInput(seq_ids, [t for f in feeds for t in f], None if decode else lens, last))  # [R, V]
    return logits.argmax(-1).tolist()


class DraftProposer:
    """prompt_lookup.Proposer over a draft model's runner; row i is draft sequence i."""

    def __init__(self, runner: ModelRunner, prompts: list[list[int]], k: int, schedule: str,
                 max_new: int, eos_ids: tuple[int, ...]):
        self.runner, self.prompts, self.schedule, self.eos_ids = runner, prompts, schedule, eos_ids
        self.runners = (runner,)  # its decode steps replay as graphs in a call that wants them
        self.k = [k] * len(prompts)  # [B] each row's num_assistant_tokens
        # The most tokens a proposal may hold (a verification row is this + 1 tokens).
        self.max_tokens = max(0, max_new - 1 if schedule != "constant" else min(k, max_new - 1))
        self.seen: list[int | None] = [None] * len(prompts)  # new tokens in the draft's cache
        self.proposals: list[list[int]] = [[] for _ in prompts]  # each row's last proposal
        # A constant k: fixed_batch runs the rounds on the device (runtime/draft_rounds.py) on
        # this runner instead of calling propose/accepted; they free their draft sequences.
        self.on_device = schedule == "constant"

    def propose(self, rows: list[int], out: list[list[int]], caps: list[int]) -> list[list[int]]:
        """Up to min(k, cap) greedy draft tokens after each row's new tokens out[i]."""
        cache = self.runner.cache
        caps = [min(self.k[i], cap) for i, cap in zip(rows, caps)]
        for i in rows:
            self.proposals[i] = []
        feeds: list[tuple[int, list[int]]] = []  # (row, tokens the next step computes)
        for i, cap in zip(rows, caps):
            if cap <= 0:
                continue
            if self.seen[i] is None:  # the prompt, its first new token and the draft's prefix cache
                tokens = self.prompts[i] + out[i]
                feed = tokens[cache.add_sequence(i, tokens):]
            else:
                feed = out[i][self.seen[i]:]
                cache.append_tokens(i, feed)
            self.seen[i] = len(out[i])
            feeds.append((i, feed))
        limit = dict(zip(rows, caps))
        while feeds:
            tokens = greedy_step(self.runner, [i for i, _ in feeds], [f for _, f in feeds])
            stepped, feeds = [i for i, _ in feeds], []
            for i, token in zip(stepped, tokens):
                self.proposals[i].append(token)
                if len(self.proposals[i]) < limit[i] and token not in self.eos_ids:
                    cache.append_tokens(i, [token])
                    feeds.append((i, [token]))
        return [self.proposals[i] for i in rows]

    def accepted(self, rows: list[int], counts: list[int]) -> None:
        """counts[j]: how many leading tokens of row rows[j]'s proposal the target accepted."""
        cache = self.runner.cache
        for i, count in zip(rows, counts):
            proposed = len(self.proposals[i])
            if proposed:  # the draft fed all its proposal but the last token
                kept = min(count, proposed - 1)
                cache.truncate(i, proposed - 1 - kept)
                self.seen[i] += kept
            if self.schedule != "constant":
                self.k[i] = self.k[i] + 2 if count == proposed else max(1, self.k[i] - 1)

    def close(self, failed: bool) -> None:
        """Free the rows' draft sequences (after an error, their blocks leave the prefix cache:
        their K/V may be unwritten)."""
        if failed:
            self.runner.cache.free_all(keep_cached=False)
            return
        for i, seen in enumerate(self.seen):
            if seen is not None:
                self.runner.cache.free(i)

    def final_k(self) -> int:
        """What "heuristic" leaves in the draft's generation_config: the rows' mean k, rounded."""
        return round(sum(self.k) / len(self.k))


@contextlib.contextmanager
def drafting(draft, prompts: list[list[int]], k: int, schedule: str, max_new: int,
             eos_ids: tuple[int, ...]) -> Iterator[DraftProposer]:
    """A DraftProposer on the draft's own cache for one call (its lock held meanwhile); its
    sequences freed however the call ends; "heuristic" writes the last k back as HF does."""
    state = prepared(draft)  # check_draft refused what it cannot run
    with state.lock:
        if state.fixed_batch is None:
            state.fixed_batch = FixedBatch(state)
        batch = state.fixed_batch
        batch.kv_dtype = state.dtype
        batch.note_weights(weights_version(draft))
        # A row's draft sequence never holds more than prompt + max_new_tokens - 1 tokens.
        num_blocks = sum(-(-(len(p) + max_new) // BLOCK_SIZE) for p in prompts)
        runner = batch.runner_for(num_blocks, len(prompts), sum(map(len, prompts)) + 2 * len(prompts),
                                  max(map(len, prompts)) + max_new)
        runner.cache.free_all(keep_cached=False)  # rows of a call interrupted in its clean-up
        proposer = DraftProposer(runner, prompts, k, schedule, max_new, eos_ids)
        try:
            yield proposer
        except BaseException:
            proposer.close(failed=True)
            raise
        proposer.close(failed=False)
        if schedule == "heuristic":
            draft.generation_config.num_assistant_tokens = proposer.final_k()


def check_draft_state(state: PreparedModel) -> None:
    """Refuse a draft whose steps the proposer cannot run (it runs eager steps with no per-row S)."""
    if state.rope is not None or state.tp is not None:
        raise DraftRefused("assistant_model " + ("with a length-dependent rope (dynamic, longrope)"
                                                 if state.rope is not None else "under tensor parallelism")
                           + " is not supported yet")
