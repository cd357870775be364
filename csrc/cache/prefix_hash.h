// The prefix-cache key of a full block: a 64-bit hash chained over (hash of the previous block,
// this block's token ids). Equal keys mean equal whole prefixes, not just equal blocks; the
// allocator still compares the stored token ids and parent key on a hit, so a hash collision can
// never hand a sequence another prompt's K/V.
#pragma once
#include <cstdint>

namespace pagedkv {

// The "previous block" of a sequence's first block.
inline constexpr uint64_t kRootHash = 0x9e3779b97f4a7c15ULL;

// splitmix64's finalizer: a bijection that spreads every input bit over the whole word.
inline uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

inline uint64_t chain_hash(uint64_t parent, const int32_t* tokens, int32_t num_tokens) {
  uint64_t h = mix64(parent);
  for (int32_t i = 0; i < num_tokens; ++i) {
    h = mix64(h ^ (static_cast<uint64_t>(static_cast<uint32_t>(tokens[i])) + kRootHash));
  }
  return h;
}

}  // namespace pagedkv
