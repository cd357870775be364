// One prompt-lookup round of generate()'s fixed batch, per row: the rule shared by the CPU loops
// (csrc/cpu/lookup_round.cpp) and the CUDA kernels (csrc/kernels/lookup_round.cu), written after
// tests/lookup_round_reference.py. Plain C++ that nvcc and the host compiler both take.
//
// A row's state: history[b, :lengths[b]] is its prompt and the tokens emitted so far (generated[b]
// of them); the last is not in the cache yet (it is the next fed token). done rows take no part.
// lengths are kept in [1, max_length] by the caller (prompt + max_new fits the history); a device
// op cannot raise, so a value outside is clamped there and writes past the history are dropped,
// which keeps every access in bounds.
#pragma once
#include <cstdint>

#include "kernels/host_device.h"

namespace pagedkv::kernels {

struct LookupPropose {
  const int64_t* history;       // [rows, max_length]
  const int64_t* lengths;       // [rows]
  const int64_t* generated;     // [rows]
  const int64_t* max_new;       // [rows]: the most tokens a row emits
  const bool* done;             // [rows]
  const int32_t* block_tables;  // [rows, max_blocks]
  int64_t* feed;                // [rows, width]: last token, proposal, last token as filler
  int64_t* proposal_lens;       // [rows]
  int32_t* positions;           // [rows * width]
  int32_t* slot_mapping;        // [rows * width]: -1 for filler, done rows, past the table
  int32_t* context_lens;        // [rows * width]: position + 1, 0 where the slot is -1
  int64_t rows, max_length, k, max_ngram;
  int width, max_blocks, block_size;
};

struct LookupAccept {
  const int64_t* greedy;         // [rows * width]: the model's token at each fed position
  const int64_t* feed;           // [rows, width]: what lookup_propose fed
  const int64_t* proposal_lens;  // [rows]
  const int64_t* eos_ids;        // [num_eos]
  int64_t* history;              // [rows, max_length]: the emitted tokens appended
  int64_t* lengths;              // [rows]
  int64_t* generated;            // [rows]
  const int64_t* max_new;        // [rows]: the most tokens a row emits
  bool* done;                    // [rows]
  int64_t* stats;                // [rows, 3]: += (rounds, proposed, accepted)
  int64_t rows, max_length, num_eos;
  int width;
};

PAGEDKV_HD int64_t clamp_length(int64_t length, int64_t max_length) {
  return length < 1 ? 1 : (length > max_length ? max_length : length);
}

PAGEDKV_HD int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// The most tokens row b may propose: k, the width after the fed token, and the tokens it may
// still emit after this round's guaranteed one.
PAGEDKV_HD int64_t proposal_cap(const LookupPropose& a, int64_t b) {
  const int64_t cap = min64(min64(a.k, a.width - 1), a.max_new[b] - a.generated[b] - 1);
  return cap < 0 ? 0 : cap;
}

// The largest n to try: the tail's n-gram must start before the tail itself.
PAGEDKV_HD int64_t longest_ngram(const LookupPropose& a, int64_t length) {
  return min64(a.max_ngram, length - 1);
}

// Whether tokens[s, s + n) equals the row's last n tokens (s + n < length).
PAGEDKV_HD bool ngram_at(const int64_t* tokens, int64_t length, int64_t n, int64_t s) {
  for (int64_t i = 0; i < n; ++i) {
    if (tokens[s + i] != tokens[length - n + i]) return false;
  }
  return true;
}

// Writes fed slot j of row b. The proposal is tokens[src, src + proposed) of the row's history
// (proposed 0: none); done rows get feed 0, position 0, slot -1, context 0.
PAGEDKV_HD void write_fed_slot(const LookupPropose& a, int64_t b, int64_t length, int64_t src,
                               int64_t proposed, int j) {
  const int64_t at = b * a.width + j;
  if (a.done[b]) {
    a.feed[at] = 0;
    a.positions[at] = 0;
    a.slot_mapping[at] = -1;
    a.context_lens[at] = 0;
    return;
  }
  const int64_t* tokens = a.history + b * a.max_length;
  const bool in_row = j <= proposed;  // the fed token and the proposal, not the filler
  a.feed[at] = j >= 1 && in_row ? tokens[src + j - 1] : tokens[length - 1];
  const int64_t pos = length - 1 + j;
  a.positions[at] = static_cast<int32_t>(pos);
  const int64_t block = pos / a.block_size;
  if (in_row && block < a.max_blocks) {
    a.slot_mapping[at] = a.block_tables[b * a.max_blocks + block] * a.block_size +
                         static_cast<int32_t>(pos % a.block_size);
    a.context_lens[at] = static_cast<int32_t>(pos + 1);
  } else {  // filler, or past the row's table: attention skips it
    a.slot_mapping[at] = -1;
    a.context_lens[at] = 0;
  }
}

PAGEDKV_HD bool is_eos(const LookupAccept& a, int64_t token) {
  for (int64_t i = 0; i < a.num_eos; ++i) {
    if (a.eos_ids[i] == token) return true;
  }
  return false;
}

// Row b after the verification forward: accept the longest prefix of the proposal that the
// greedy tokens repeat, emit it and the model's next token (cut after an EOS and at max_new),
// append to history, and update lengths, generated, done and stats. Done rows stay as they are.
PAGEDKV_HD void accept_row(const LookupAccept& a, int64_t b) {
  if (a.done[b]) return;
  int64_t m = a.proposal_lens[b];
  m = m < 0 ? 0 : min64(m, a.width - 1);
  const int64_t* best = a.greedy + b * a.width;
  const int64_t* fed = a.feed + b * a.width;
  int64_t accepted = 0;
  while (accepted < m && fed[1 + accepted] == best[accepted]) ++accepted;
  int64_t count = min64(accepted + 1, a.max_new[b] - a.generated[b]);
  if (count < 0) count = 0;
  bool eos = false;
  for (int64_t i = 0; i < count && !eos; ++i) {
    if (is_eos(a, best[i])) {
      eos = true;
      count = i + 1;
    }
  }
  const int64_t length = clamp_length(a.lengths[b], a.max_length);
  int64_t* tokens = a.history + b * a.max_length;
  for (int64_t i = 0; i < count && length + i < a.max_length; ++i) tokens[length + i] = best[i];
  a.lengths[b] = length + count;
  a.generated[b] += count;
  a.done[b] = eos || a.generated[b] >= a.max_new[b];
  int64_t* row_stats = a.stats + b * 3;
  row_stats[0] += 1;
  row_stats[1] += m;
  row_stats[2] += accepted;
}

}  // namespace pagedkv::kernels
