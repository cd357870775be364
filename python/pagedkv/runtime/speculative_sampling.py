"""Speculative sampling with do_sample=True for generate()'s host-read rounds (runtime/prompt_lookup.py:
a draft model's proposals) and the engine: the standard acceptance rule for a draft that is a
point mass (n-gram lookup and a greedy draft propose tokens, not distributions), which keeps the
target distribution exactly.

A row fed its last token and the proposal d_1..d_m gets target distributions p_0..p_m (each the
distribution a plain decode step samples from there: min_new_tokens' EOS suppression, then
temperature, top-k and top-p as ops.sample applies them). d_{j+1} is accepted with probability
p_j(d_{j+1}); at the first rejection the row draws from the residual max(0, p_j - onehot(d_{j+1}))
renormalised (p_j without d_{j+1}); with all m accepted it draws the bonus token from p_m. So a
token x at a row's position is emitted with probability p_j(d) [x = d] + (1 - p_j(d)) p_j(x) / (1 -
p_j(d)) [x != d] = p_j(x).

generate()'s draws come from one torch.Generator per call, on the logits' device, seeded once
from torch's global RNG (torch.manual_seed reproduces a call). It is another random stream than
ops.sample's counter-based one: the same distribution, not the same tokens as sampling without
prompt lookup. (generate()'s n-gram lookup takes the rule's other form on the device,
runtime/lookup_rounds.py: x_j drawn from p_j at every position, the proposal accepted while x_j =
d_{j+1}; P(accept) = p_j(d_{j+1}) and a rejected x_j follows the residual, so it is this rule.)
"""

from __future__ import annotations

import torch

from pagedkv.runtime.runner import to_device
from pagedkv.runtime.sampler import suppress_eos


def warped_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """ops.sample's distribution of each row: softmax(logits / T) over HF's top-k set (logits >=
    the k-th largest, ties kept), then over the top-p set (a token is kept while the mass of the
    kept tokens strictly above it is < top_p of theirs: whole tie groups), renormalised.
    logits [T, V] float32 -> (probs [T, V] float32, drawable [T] bool). A row whose max is not
    finite (NaN, +inf, all -inf) has no distribution: drawable False, its probs uniform (ops.sample
    gives -1 there; the caller raises)."""
    vocab = logits.shape[-1]
    top = logits.max(-1, keepdim=True).values  # [T, 1]; NaN if any NaN
    drawable = top.isfinite().squeeze(-1)  # [T]
    logits = torch.where(drawable.unsqueeze(-1), logits, torch.zeros_like(logits))
    top = torch.where(drawable.unsqueeze(-1), top, torch.zeros_like(top))
    weights = ((logits - top) / temperature).exp()  # [T, V], the largest 1
    keep = torch.ones_like(logits, dtype=torch.bool)
    if 0 < top_k < vocab:
        keep = logits >= logits.topk(top_k, -1).values[:, -1:]
    if top_p < 1.0:
        kept = weights * keep
        values, order = logits.sort(-1, descending=True)  # [T, V]
        sorted_w = kept.gather(-1, order)
        above = sorted_w.cumsum(-1) - sorted_w  # mass strictly ahead in sorted order
        first = torch.ones_like(values, dtype=torch.bool)
        first[:, 1:] = values[:, 1:] != values[:, :-1]
        index = torch.arange(vocab, device=logits.device).expand_as(values)
        group = torch.where(first, index, torch.zeros_like(index)).cummax(-1).values  # tie group's first
        target = (top_p * kept.sum(-1, keepdim=True)).clamp(min=2.0**-40)  # ops.sample's least target
        in_top_p = torch.zeros_like(keep).scatter(-1, order, above.gather(-1, group) < target)
        keep &= in_top_p
    probs = weights * keep
    probs = probs / probs.sum(-1, keepdim=True)
    probs = torch.where(drawable.unsqueeze(-1), probs, torch.full_like(probs, 1.0 / vocab))
    return probs, drawable


def residual(probs: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
    """max(0, p - q) renormalised for a one-hot draft q: each row's p without its draft token.
    probs [R, V]; draft [R] int64 -> [R, V]. A row whose p is the draft token alone keeps p (that
    token is accepted with probability 1, so its residual is never drawn from)."""
    rest = probs.scatter(-1, draft.unsqueeze(-1), 0.0)
    total = rest.sum(-1, keepdim=True)
    return torch.where(total > 0, rest / total.clamp(min=torch.finfo(probs.dtype).tiny), probs)


def verify(probs: torch.Tensor, draft: torch.Tensor, lengths: list[int],
           generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The acceptance rule for rows fed lengths[r] = m_r + 1 positions each, in order.
    probs [T, V] (T = sum(lengths)): each position's target distribution; draft [T] int64: the
    proposed token after each position, -1 at each row's last. Returns (accepted [B] int64: the
    number of proposed tokens accepted, the row's next token [B] int64: drawn from the residual
    at the first rejection, or from p_m when all were accepted)."""
    count = to_device(lengths, probs.device)  # [B] (pinned: a pageable copy would wait for the step)
    u = torch.rand(probs.shape[0], generator=generator, device=probs.device, dtype=probs.dtype)
    accepted, _, dist = accept_rule(probs, draft, count, u)
    tokens = torch.multinomial(dist, 1, generator=generator).squeeze(-1)  # [B]
    return accepted, tokens


def accept_rule(probs: torch.Tensor, draft: torch.Tensor, count: torch.Tensor, u: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The acceptance rule given its draws, shared by generate() (verify) and the engine
    (engine/speculative_rows.py, its own draws): probs [T, V], draft [T] (-1 at each row's last
    position), count [B] positions per row, u [T] acceptance draws in probs' dtype. Returns
    (accepted [B], the position the next token is drawn at [B], its distribution [B, V]: the
    residual at the first rejection, else p_m)."""
    device, total = probs.device, probs.shape[0]
    row = torch.repeat_interleave(torch.arange(count.shape[0], device=device), count)  # [T]
    starts = count.cumsum(0) - count  # [B]
    position = torch.arange(total, device=device) - starts[row]  # [T], j within the row
    p_draft = probs.gather(-1, draft.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # [T]
    accept = (draft >= 0) & (u < p_draft)
    # the first position not accepted (each row's last one is not: no draft there)
    accepted = torch.full_like(count, total).scatter_reduce(0, row, torch.where(accept, total, position), "amin")
    at = starts + accepted  # [B]
    dist, rejected_draft = probs[at], draft[at]  # [B, V], [B]
    rejected = (rejected_draft >= 0).unsqueeze(-1)
    return accepted, at, torch.where(rejected, residual(dist, rejected_draft.clamp(min=0)), dist)


class SpeculativeSampler:
    """prompt_lookup's verifier for do_sample=True: (logits of the fed positions, proposals,
    tokens generated before each position) -> each row's accepted count and next token."""

    def __init__(self, temperature: float, top_k: int, top_p: float, min_new_tokens: int,
                 eos_token_ids: tuple[int, ...], device: torch.device) -> None:
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.min_new_tokens = min_new_tokens if eos_token_ids else 0
        self.eos_ids = torch.tensor(eos_token_ids, dtype=torch.int64, device=device)  # [E]
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(int(torch.randint(0, 2**62, (1,)).item()))  # torch's RNG, once
        self.device = device

    def __call__(self, logits: torch.Tensor, proposals: list[list[int]], counts: list[int]
                 ) -> tuple[list[int], list[int]]:
        """logits [T, V], T = sum(len(p) + 1); counts [T]: new tokens each position's row had
        before it. One host read-back."""
        logits = logits.float().clone()  # suppressed in place
        if self.min_new_tokens > 0:
            generated = to_device(counts, self.device).int()
            suppress_eos(logits, self.eos_ids, generated, self.min_new_tokens)
        probs, drawable = warped_probs(logits, self.temperature, self.top_k, self.top_p)
        # position j of a row is followed by its proposal's token j (d_{j+1}), the last by none
        draft = to_device([t for p in proposals for t in p + [-1]], self.device).where(drawable, -1)  # [T]; none where no p_j
        lengths = [len(p) + 1 for p in proposals]
        accepted, tokens = verify(probs, draft, lengths, self.generator)
        # the position a row draws at has no distribution (NaN/inf logits; a draft is never
        # accepted at such a position, so none before it): ops.sample's -1, raised on
        count = to_device(lengths, self.device)
        bad = ~drawable[count.cumsum(0) - count + accepted]
        accepted, tokens, bad = torch.stack([accepted, tokens, bad.long()]).tolist()
        if any(bad):
            raise nan_logits_error([r for r, b in enumerate(bad) if b], "the verified rows")
        return accepted, tokens


def nan_logits_error(rows: list[int], of: str) -> RuntimeError:
    """What a sampled row whose logits at the position it draws at are NaN or infinite raises
    (generate()'s speculative rounds, here and on the device: runtime/lookup_rounds.py)."""
    return RuntimeError(f"pagedkv.generate: row(s) {rows} of {of} have NaN or infinite logits, so "
                        "do_sample=True has no distribution to draw from (HF's generate raises too: "
                        "probability tensor contains either inf, nan or element < 0)")
