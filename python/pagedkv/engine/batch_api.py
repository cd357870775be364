"""pagedkv.LLM's batch and streaming calls, generate(), chat() and stream(): queue a batch of prompts, all
or none, and step the engine until every one has finished (a mixin of engine/llm.py's LLM, on its
_checked, _auto_ids, _new_request, _commit, _step and abort_request). Their steps run every
request; the finished outputs of requests added by add_request wait for a step() call.

Under tensor parallelism every rank must add the same requests in the same order (a rank that
ran other requests would wait on the others' collectives forever): add_request and each batch
check that with one small collective (_agreed) before anything is queued."""

from __future__ import annotations

import time
from typing import Callable, Iterable, Iterator, Sequence as Seq

import torch

from pagedkv.engine.chat import chat_prompts
from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.prompts import Prompt, batch_of
from pagedkv.engine.request import Request
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.models.module_hooks import check_no_forward_hooks
from pagedkv.models.registry import check_no_dropout
from pagedkv.runtime.model import ModelChanged, check_unchanged
from pagedkv.runtime.prefix_reuse import weights_version
from pagedkv.runtime.parallel import call_digest


# A request checked by LLM._checked: (text or None, prompt token ids, sampling params).
Checked = tuple[str | None, list[int], SamplingParams]


def requests_digest(checked: list[Checked], request_ids: list[str | None], error: Exception | None) -> list[int]:
    """What differs between two calls that add different requests (or failed their checks
    differently)."""
    return call_digest([c[1] for c in checked], [c[2] for c in checked], request_ids, error)


class BatchAPI:
    _weights_version: int | None = None  # weights_version(model) the cache's K/V came from

    def _check_weights_unwritten(self) -> None:
        """Before queueing requests: the K/V in the cache came from the weights as they were. After
        an in-place write (an optimizer step, load_state_dict, an op under no_grad) the prefix
        cache's blocks are dropped; unfinished requests hold such K/V too, so new requests are
        refused (ModelChanged, nothing queued) until those finish or are aborted. Writes through
        ``.data`` are not seen (autograd's version counter): call ``llm.cache.drop_prefix_cache()``.
        About 0.1 ms a call (per batch or add_request, never per step). A model put in training
        mode with an active dropout is refused too (ValueError: pagedkv never drops)."""
        check_no_dropout(self.model, "pagedkv.LLM", "; nothing was queued")
        check_no_forward_hooks(self.model, "pagedkv.LLM", "; nothing was queued")
        version = weights_version(self.model)
        if version == self._weights_version:
            return
        if self._weights_version is not None:
            if self.scheduler.has_unfinished():
                unfinished = [r for r, q in self._requests.items() if not q.finished]
                raise ModelChanged(
                    f"pagedkv.LLM: the model's weights were written in place while request(s) "
                    f"{unfinished[:5]} were unfinished; their K/V came from the old weights. Finish "
                    "them (step()) or abort them (llm.abort_request) before adding requests; nothing "
                    "was queued")
            self.cache.drop_prefix_cache()
        self._weights_version = version

    def _agreed(self, check: Callable[[], list[Checked]], request_ids: list[str | None]) -> list[Checked]:
        """check()'s requests; under tensor parallelism only if every rank got the same ones (and
        request ids; None: automatic), else ValueError on every rank. The collective runs also
        when a check failed, so that a rank that alone got a bad request does not leave the
        others waiting: all raise."""
        checked, error = [], None
        try:
            checked = check()
        except (TypeError, ValueError) as e:
            error = e
        if self.tp is not None:
            try:
                self.tp.check_same("requests (prompt token ids, SamplingParams or request ids)",
                                   requests_digest(checked, request_ids, error), who="pagedkv.LLM")
            except ValueError as mismatch:
                raise mismatch from error
        if error is not None:
            raise error
        return checked

    def _new_batch(self, prompts, sampling_params) -> list[Request]:
        """The batch's requests with their ids, checked (on every rank) and not queued: a bad
        prompt (or a KeyboardInterrupt here) leaves nothing queued. Auto ids skip ids in use."""
        check_unchanged(self.model, self.runner.model)  # ModelChanged; once a batch (~0.4 ms)
        self._check_weights_unwritten()

        def check() -> list[Checked]:
            batch, params = batch_of(prompts, sampling_params)
            checked = []
            for i, (prompt, p) in enumerate(zip(batch, params)):
                try:
                    checked.append(self._checked(prompt, p))
                except (TypeError, ValueError) as error:
                    raise type(error)(f"{error} (prompt {i} of {len(batch)})") from None
            return checked

        checked = self._agreed(check, [])
        ids = self._auto_ids(len(checked))
        return [self._new_request(*request, request_id) for request, request_id in zip(checked, ids)]

    def stream(self, prompts: Prompt | Iterable[Prompt],
               sampling_params: SamplingParams | Seq[SamplingParams] | None = None
               ) -> Iterator[RequestOutput]:
        """Queue the prompts and yield RequestOutputs as they progress (partial ones after every
        step they got a token in, then the finished one), until all of them are finished."""
        with self._lock:  # another thread's steps would take this stream's outputs
            yield from self._stream(prompts, sampling_params)

    def _stream(self, prompts, sampling_params) -> Iterator[RequestOutput]:
        self._repair()
        batch = self._new_batch(prompts, sampling_params)
        ids = {r.request_id for r in batch}
        try:
            self._commit(batch)
            while ids:
                ids &= self._requests.keys()  # abort_request() during the loop: yields no more
                if not ids:
                    break
                with torch.inference_mode():
                    outputs = self._step(partial=True, wanted=ids)
                for out in outputs:
                    if out.finished:
                        ids.discard(out.request_id)
                    yield out
        finally:
            for request_id in ids:  # the consumer stopped early, or an exception stopped the loop
                self.abort_request(request_id)

    @torch.inference_mode()
    def generate(self, prompts: Prompt | Iterable[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run the prompts to the end; outputs in the order of the prompts. A tqdm bar shows
        finished requests and output tok/s (use_tqdm=False turns it off)."""
        with self._lock:  # another thread's steps would take this call's outputs
            return self._generate(prompts, sampling_params, use_tqdm)

    def chat(self, messages, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = True, *, chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list | None = None,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """generate() on conversations: messages is a list of {"role", "content"} dicts (one
        conversation) or a list of such lists (a batch), rendered with the tokenizer's chat
        template (or chat_template) by HF's apply_chat_template, with the assistant's turn opened
        (add_generation_prompt) or the last message continued (continue_final_message). Each
        output's prompt is the rendered text."""
        prompts = chat_prompts(self.tokenizer, messages, chat_template, add_generation_prompt,
                               continue_final_message, tools, chat_template_kwargs)
        return self.generate(prompts, sampling_params, use_tqdm)

    def _generate(self, prompts, sampling_params, use_tqdm: bool) -> list[RequestOutput]:
        self._repair()
        batch = self._new_batch(prompts, sampling_params)
        ids = [r.request_id for r in batch]
        results: dict[str, RequestOutput] = {}
        bar = None
        try:
            self._commit(batch)
            if use_tqdm:
                from tqdm.auto import tqdm

                bar = tqdm(total=len(ids), desc="pagedkv", unit="req", dynamic_ncols=True)
            start, generated0 = time.perf_counter(), self.stats.num_generated_tokens
            wanted = set(ids)
            while len(results) < len(ids):
                for out in self._step(partial=False, wanted=wanted):
                    results[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
                if bar is not None:
                    rate = (self.stats.num_generated_tokens - generated0) / (time.perf_counter() - start)
                    bar.set_postfix_str(f"{rate:.0f} tok/s", refresh=False)
        except BaseException:
            for request_id in ids:  # those finished have left the table: ignored
                if request_id not in results:
                    self.abort_request(request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[i] for i in ids]
