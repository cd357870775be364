"""Plain-PyTorch references of ops.lookup_propose and ops.lookup_accept: one prompt-lookup round
of generate()'s fixed batch kept on the device (runtime/lookup_rounds.py), written per row with
Python loops so that the rule is easy to read. The ops must give exactly these tensors.

A row's state between rounds: history[b, :lengths[b]] holds its prompt and the tokens emitted so
far (generated[b] of them); the last one is not in the cache yet (it is the next fed token).
Rows with done[b] (finished, or padding rows of the batch bucket) take no part.
"""

from __future__ import annotations

import torch


def propose(history: torch.Tensor, lengths: torch.Tensor, generated: torch.Tensor, done: torch.Tensor,
            block_tables: torch.Tensor, width: int, max_new: torch.Tensor, k: int, max_ngram: int,
            block_size: int) -> dict[str, torch.Tensor]:
    """Each live row's feed of `width` tokens: its last token, then up to cap = min(k, width - 1,
    max_new - generated - 1) tokens that followed the first earlier occurrence of its last n
    tokens (n = min(max_ngram, length - 1) .. 1, the first n with a match wins; a match must start
    before the tail itself), then its last token again as filler. Its positions run from
    length - 1; feed and proposal tokens get their cache slot and context (position + 1), filler
    and done rows slot -1 and context 0 (attention skips them; their logits are not read), as is a
    position past the row's block table.

    history [R, L] int64, lengths / generated [R] int64, done [R] bool, block_tables [R, MB]
    int32, max_new [R] int64 (each row's max_new_tokens) -> feed [R, width] int64 (0 for done rows), proposal_lens [R] int64, positions /
    slot_mapping / context_lens [R * width] int32 (positions 0 for done rows)."""
    rows = history.shape[0]
    feed = torch.zeros(rows, width, dtype=torch.int64)
    proposal_lens = torch.zeros(rows, dtype=torch.int64)
    positions = torch.zeros(rows, width, dtype=torch.int32)
    slots = torch.full((rows, width), -1, dtype=torch.int32)
    context = torch.zeros(rows, width, dtype=torch.int32)
    tokens_all = history.cpu().tolist()
    for b in range(rows):
        if bool(done[b]):
            continue
        length = int(lengths[b])
        tokens = tokens_all[b][:length]
        cap = max(0, min(k, width - 1, int(max_new[b]) - int(generated[b]) - 1))
        proposal: list[int] = []
        for n in range(min(max_ngram, length - 1), 0, -1):
            tail = tokens[length - n:]
            start = next((s for s in range(length - n) if tokens[s:s + n] == tail), None)
            if start is not None:
                proposal = tokens[start + n:start + n + cap]
                break
        proposal_lens[b] = len(proposal)
        row = [tokens[-1]] + proposal
        feed[b] = torch.tensor(row + [tokens[-1]] * (width - len(row)))
        for j in range(width):
            pos = length - 1 + j
            positions[b, j] = pos
            if j < len(row) and pos // block_size < block_tables.shape[1]:  # past the table: skipped
                slots[b, j] = int(block_tables[b, pos // block_size]) * block_size + pos % block_size
                context[b, j] = pos + 1
    return dict(feed=feed, proposal_lens=proposal_lens, positions=positions.flatten(),
                slot_mapping=slots.flatten(), context_lens=context.flatten())


def accept(greedy: torch.Tensor, feed: torch.Tensor, proposal_lens: torch.Tensor, eos_ids: torch.Tensor,
           history: torch.Tensor, lengths: torch.Tensor, generated: torch.Tensor, done: torch.Tensor,
           stats: torch.Tensor, max_new: torch.Tensor) -> dict[str, torch.Tensor]:
    """After the verification forward: greedy [R * width] int64 is the token the model picks at
    each fed position. A live row accepts the longest prefix of its proposal (feed[b, 1:1 + m])
    equal to the greedy tokens at positions 0.., a of them, and emits greedy[0 .. a] (the accepted
    proposal, then the model's next token): a + 1 tokens, cut after the first EOS among them and
    at max_new - generated. They are appended to history at lengths[b]; lengths and generated
    grow by the count; done is set when an EOS was emitted or generated reaches max_new.
    stats [R, 3] int64 += (1 round, m proposed, a accepted) for each live row. Done rows are left
    as they are. Returns the updated copies of history, lengths, generated, done, stats."""
    rows, width = feed.shape
    out = dict(history=history.clone(), lengths=lengths.clone(), generated=generated.clone(),
               done=done.clone(), stats=stats.clone())
    eos = set(eos_ids.tolist())
    for b in range(rows):
        if bool(done[b]):
            continue
        m = int(proposal_lens[b])
        best = greedy[b * width:(b + 1) * width].tolist()
        accepted = next((j for j in range(m) if int(feed[b, 1 + j]) != best[j]), m)
        emitted = best[:accepted + 1]
        cut = next((i + 1 for i, t in enumerate(emitted) if t in eos), len(emitted))
        emitted = emitted[:max(0, min(cut, int(max_new[b]) - int(generated[b])))]
        length = int(lengths[b])
        out["history"][b, length:length + len(emitted)] = torch.tensor(emitted, dtype=torch.int64)
        out["lengths"][b] += len(emitted)
        out["generated"][b] += len(emitted)
        out["done"][b] = any(t in eos for t in emitted) or int(out["generated"][b]) >= int(max_new[b])
        out["stats"][b] += torch.tensor([1, m, accepted])
    return out
