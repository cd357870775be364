"""The verification rows of one pagedkv.LLM step, and the speculative-sampling rule for those of
sampling requests (temperature > 0).

The rule is runtime/speculative_sampling.py's for a point-mass draft (a proposed token d is
accepted with its target probability p_j(d), at the first rejection the row draws from p_j
without d, after m accepted from p_m), with each request's temperature, top_k and top_p, so every
emitted token follows the distribution of sampling without speculation. Its random numbers come
from the row's own generator, seeded by the request's seed and the row's generated-token count:
a seeded request's tokens do not depend on what runs beside it (they are not ops.sample's
draws: the same distribution, other tokens than a step without a proposal would give).
"""

from __future__ import annotations

import dataclasses
import random
from typing import Callable

import torch

from pagedkv.engine.request import Sequence, Status
from pagedkv.runtime.runner import to_device
from pagedkv.runtime.speculative_sampling import accept_rule, warped_probs


@dataclasses.dataclass(slots=True, eq=False)
class VerifyRows:
    seqs: list[Sequence] = dataclasses.field(default_factory=list)  # decode rows with a proposal
    proposals: list[list[int]] = dataclasses.field(default_factory=list)  # each row's proposed tokens
    logits_rows: list[int] = dataclasses.field(default_factory=list)  # their positions in the step's logits
    greedy: torch.Tensor | None = None  # [G] greedy token at each position of the greedy rows
    sampled: tuple[list[int], torch.Tensor] | None = None  # (rows, [3, S]: accepted, next token, bad)
    accepted: list[int] = dataclasses.field(default_factory=list)  # [B] once read
    emitted: list[list[int]] = dataclasses.field(default_factory=list)  # [B] tokens to append, once read

    def read(self, abort: Callable[[str], None]) -> None:
        """Read the rows' results back (waits for the device): each row's accepted count and
        tokens. A row with NaN or infinite logits at a token it takes aborts its request with
        abort(request_id) and raises, as LaunchedStep.read does; read again, the others' are intact."""
        greedy = [] if self.greedy is None else self.greedy.tolist()
        sampled_rows, sampled = self.sampled if self.sampled is not None else ([], None)
        values = dict(zip(sampled_rows, zip(*sampled.tolist()))) if sampled is not None else {}
        self.accepted, self.emitted = [], []
        invalid = []
        start = 0
        for r, (seq, proposal) in enumerate(zip(self.seqs, self.proposals)):
            if r in values:
                accepted, token, bad = values[r]
                tokens = proposal[:accepted] + [token]
            else:
                best = greedy[start:start + len(proposal) + 1]
                start += len(proposal) + 1
                accepted = next((j for j, t in enumerate(proposal) if t != best[j]), len(proposal))
                tokens = best[:accepted + 1]
                bad = min(tokens) < 0
            self.accepted.append(accepted)
            self.emitted.append(tokens)
            if bad and seq.status is not Status.FINISHED:
                invalid.append(seq.request.request_id)
        for request_id in dict.fromkeys(invalid):
            abort(request_id)
        if invalid:
            raise RuntimeError(f"pagedkv.LLM: request(s) {list(dict.fromkeys(invalid))} have NaN or infinite "
                               "logits at a verified position, so there is no token to take; they were "
                               "aborted, the other requests go on")


def sample_verify(spec: torch.Tensor, rows: VerifyRows, sampled: list[int]) -> tuple[list[int], torch.Tensor]:
    """Queue the rule for rows `sampled` (indices into rows) of the verification logits spec
    [T, V] (each row's m + 1 positions, row after row); returns (sampled, [3, S] int64: accepted
    count, next token, 1 where the position drawn at has no distribution)."""
    starts, at = [], 0
    for proposal in rows.proposals:
        starts.append(at)
        at += len(proposal) + 1
    lengths = [len(rows.proposals[r]) + 1 for r in sampled]
    positions = [starts[r] + j for r, n in zip(sampled, lengths) for j in range(n)]
    logits = spec[to_device(positions, spec.device)].float()  # [P, V]
    probs = torch.empty_like(logits)
    drawable = torch.empty(logits.shape[0], dtype=torch.bool, device=logits.device)
    groups: dict[tuple, list[int]] = {}  # rows alike: one warped_probs call
    offset = 0
    for r, n in zip(sampled, lengths):
        p = rows.seqs[r].request.params
        groups.setdefault((p.temperature, p.top_k, p.top_p), []).extend(range(offset, offset + n))
        offset += n
    for (temperature, top_k, top_p), members in groups.items():
        index = to_device(members, logits.device)
        probs[index], drawable[index] = warped_probs(logits[index], temperature, top_k, top_p)
    draft = to_device([t for r in sampled for t in rows.proposals[r] + [-1]], logits.device)
    draft = draft.where(drawable, -1)  # never accepted where p_j has no distribution
    uniforms, last = [], []
    for r, n in zip(sampled, lengths):
        seq = rows.seqs[r]
        rng = random.Random(f"{seq.seed}:{seq.num_output}")  # the row's own stream
        uniforms += [rng.random() for _ in range(n)]
        last.append(rng.random())
    count = to_device(lengths, logits.device)  # [S]
    accepted, tokens, at_pos = seeded_verify(probs, draft, count, torch.tensor(uniforms, device=logits.device),
                                             torch.tensor(last, dtype=torch.float64, device=logits.device))
    return sampled, torch.stack([accepted, tokens, (~drawable[at_pos]).long()])


def seeded_verify(probs: torch.Tensor, draft: torch.Tensor, count: torch.Tensor, u: torch.Tensor,
                  last_u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """speculative_sampling.accept_rule with given uniforms: probs [T, V], draft [T] (-1 at each
    row's last position), count [S] positions per row, u [T] the acceptance draws, last_u [S]
    float64 the final draw (inverse CDF). Returns (accepted [S], next token [S], the position drawn
    at [S])."""
    accepted, at, dist = accept_rule(probs, draft, count, u.to(probs.dtype))
    cdf = dist.double().cumsum(-1)  # [S, V]
    tokens = torch.searchsorted(cdf, (last_u * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    return accepted, tokens.clamp(max=probs.shape[1] - 1), at
