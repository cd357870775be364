#include "cache/cache_manager.h"

#include <string>

#include "cache/errors.h"

namespace pagedkv {
namespace {

std::string str(int64_t v) { return std::to_string(v); }


// Runs before any member is built, so a bad argument never sizes the allocator.
int32_t checked_block_size(int32_t num_blocks, int32_t block_size, int64_t max_seq_len) {
  if (num_blocks < 1) {
    throw std::invalid_argument("pagedkv: num_blocks must be >= 1, got " + str(num_blocks));
  }
  if (block_size < 1 || (block_size & (block_size - 1)) != 0) {
    throw std::invalid_argument("pagedkv: block_size must be a power of two (e.g. 16), got " +
                                str(block_size));
  }
  if (max_seq_len < 1 || max_seq_len > (int64_t{1} << 31) - block_size) {
    throw std::invalid_argument("pagedkv: max_seq_len must be in [1, 2^31 - block_size], got " +
                                str(max_seq_len));
  }
  // Slots (block * block_size + offset) travel as int32.
  if (static_cast<int64_t>(num_blocks) * block_size > (int64_t{1} << 31) - 1) {
    throw std::invalid_argument("pagedkv: num_blocks * block_size must be < 2^31 slots, got " +
                                str(num_blocks) + " * " + str(block_size));
  }
  return block_size;
}

}  // namespace

CacheManager::CacheManager(int32_t num_blocks, int32_t block_size, int64_t max_seq_len,
                           bool prefix_caching)
    : block_size_(checked_block_size(num_blocks, block_size, max_seq_len)),
      max_seq_len_(max_seq_len),
      max_blocks_per_seq_(static_cast<int32_t>((max_seq_len + block_size - 1) / block_size)),
      prefix_caching_(prefix_caching),
      allocator_(num_blocks, block_size, prefix_caching) {}

Sequence& CacheManager::find(int64_t seq_id) {
  const auto it = sequences_.find(seq_id);
  if (it == sequences_.end()) throw UnknownSequence(seq_id);
  return it->second;
}

const Sequence& CacheManager::sequence(int64_t seq_id) const {
  const auto it = sequences_.find(seq_id);
  if (it == sequences_.end()) throw UnknownSequence(seq_id);
  return it->second;
}

std::vector<int64_t> CacheManager::sequence_ids() const {
  std::vector<int64_t> ids;
  ids.reserve(sequences_.size());
  for (const auto& [id, seq] : sequences_) ids.push_back(id);
  return ids;
}

Sequence& CacheManager::batch_member(int64_t seq_id, uint64_t mark) {
  Sequence& seq = find(seq_id);
  if (seq.batch_mark == mark) {
    throw std::invalid_argument("pagedkv: sequence " + str(seq_id) +
                                " appears twice in one batch; name each sequence once");
  }
  seq.batch_mark = mark;
  return seq;
}

void CacheManager::check_free_blocks(int64_t needed, const char* what) const {
  if (needed <= allocator_.num_free()) return;
  throw CacheFull("pagedkv: cache full: " + std::string(what) + " needs " + str(needed) +
                  " free blocks but only " + str(allocator_.num_free()) + " of " +
                  str(allocator_.num_blocks()) + " are free (block_size " + str(block_size_) +
                  "); free or preempt a sequence, or make the cache larger. Nothing was changed.");
}

void CacheManager::check_tokens(std::span<const int32_t> tokens, const char* pending_error) {
  for (size_t i = 0; i < tokens.size(); ++i) {
    const int32_t t = tokens[i];
    if (t >= 0 || (t == kPendingToken && pending_error == nullptr)) continue;
    if (t == kPendingToken) throw std::invalid_argument(pending_error);
    throw std::invalid_argument("pagedkv: token_ids[" + str(static_cast<int64_t>(i)) + "] = " + str(t) +
                                " is not a token id; allowed: [0, 2^31 - 1]" +
                                (pending_error == nullptr ? ", or -1 (a pending token)" : ""));
  }
}

void CacheManager::check_prompt(std::span<const int32_t> tokens) const {
  const int64_t n = static_cast<int64_t>(tokens.size());
  if (n < 1) throw std::invalid_argument("pagedkv: a sequence needs at least one token, got none");
  check_tokens(tokens, "pagedkv: a prompt cannot hold token -1 (it marks a slot whose token is not "
                       "known yet, in append_batch)");
  if (n > max_seq_len_) {
    throw std::invalid_argument("pagedkv: a prompt of " + str(n) + " tokens is longer than max_seq_len " +
                                str(max_seq_len_));
  }
  if (blocks_for(n) > allocator_.num_blocks()) {
    throw std::invalid_argument("pagedkv: a prompt of " + str(n) + " tokens needs " +
                                str(blocks_for(n)) + " blocks but the whole cache has " +
                                str(allocator_.num_blocks()));
  }
}

int32_t CacheManager::match_prefix(std::span<const int32_t> tokens, std::vector<uint64_t>& keys,
                                   std::vector<int32_t>& hits) const {
  const int64_t n = static_cast<int64_t>(tokens.size());
  if (!prefix_caching_) return 0;
  const int64_t num_full = n / block_size_;
  const int64_t reusable = (n - 1) / block_size_;  // leave the last token to compute
  uint64_t parent = kRootHash;
  int32_t revived = 0;
  for (int64_t i = 0; i < num_full; ++i) {
    const int32_t* block_tokens = tokens.data() + i * block_size_;
    keys.push_back(chain_hash(parent, block_tokens, block_size_));
    if (i < reusable && static_cast<int64_t>(hits.size()) == i) {
      const int32_t block = allocator_.find_cached(keys.back(), parent, block_tokens);
      if (block != -1) {
        hits.push_back(block);
        revived += allocator_.ref_count(block) == 0;
      }
    }
    parent = keys.back();
  }
  return revived;
}

int32_t CacheManager::blocks_needed_to_add(std::span<const int32_t> tokens) const {
  std::vector<uint64_t> keys;
  std::vector<int32_t> hits;
  check_prompt(tokens);
  const int32_t revived = match_prefix(tokens, keys, hits);
  return blocks_for(static_cast<int64_t>(tokens.size())) - static_cast<int32_t>(hits.size()) + revived;
}

int64_t CacheManager::add_sequence(int64_t seq_id, std::span<const int32_t> tokens) {
  if (contains(seq_id)) {
    throw std::invalid_argument("pagedkv: sequence " + str(seq_id) +
                                " is already in the cache; free it first or use another id");
  }
  std::vector<uint64_t> keys;
  std::vector<int32_t> hits;
  check_prompt(tokens);
  const int32_t revived = match_prefix(tokens, keys, hits);
  const int64_t n = static_cast<int64_t>(tokens.size());
  const int32_t num_blocks = blocks_for(n);
  const int32_t num_hits = static_cast<int32_t>(hits.size());
  check_free_blocks(num_blocks - num_hits + revived, "adding a sequence");

  Sequence seq;
  seq.blocks.reserve(num_blocks);
  for (const int32_t block : hits) {
    allocator_.add_ref(block);
    seq.blocks.push_back(block);
  }
  while (static_cast<int32_t>(seq.blocks.size()) < num_blocks) seq.blocks.push_back(allocator_.allocate());
  seq.num_tokens = n;
  seq.named = n;
  if (prefix_caching_) {
    // New full blocks become findable now: their K/V are written by the step that computes them,
    // before any attention of that step or a later one reads them.
    const int32_t num_full = static_cast<int32_t>(keys.size());
    for (int32_t i = num_hits; i < num_full; ++i) {
      allocator_.register_full(seq.blocks[i], keys[i], i > 0 ? keys[i - 1] : kRootHash,
                               tokens.data() + static_cast<int64_t>(i) * block_size_);
    }
    seq.full_keys = std::move(keys);
    seq.tokens.assign(tokens.begin(), tokens.end());
  }
  sequences_.emplace(seq_id, std::move(seq));
  return static_cast<int64_t>(num_hits) * block_size_;
}

CacheManager::AppendPlan CacheManager::plan_append(Sequence& seq, int64_t seq_id, int64_t n,
                                                   std::unordered_map<int32_t, int32_t>& unref) const {
  if (n < 0) throw std::invalid_argument("pagedkv: cannot append " + str(n) + " tokens; the count must be >= 0");
  if (seq.pending != 0) {
    throw std::invalid_argument("pagedkv: sequence " + str(seq_id) + " has a slot whose token is not "
                                "known yet; name it with set_pending_tokens before appending more");
  }
  if (n > max_seq_len_ - seq.num_tokens) {  // not num_tokens + n: a huge n must not wrap the sum
    throw std::invalid_argument("pagedkv: sequence " + str(seq_id) + " has " + str(seq.num_tokens) +
                                " tokens; " + str(n) + " more would pass max_seq_len " +
                                str(max_seq_len_));
  }
  AppendPlan plan{&seq, false, blocks_for(seq.num_tokens + n) - blocks_for(seq.num_tokens)};
  if (n > 0 && seq.num_tokens % block_size_ != 0) {
    const int32_t last = seq.blocks.back();
    if (allocator_.ref_count(last) > 1) {
      // Earlier members of this batch that copied away from `last` no longer own it.
      int32_t& moved_off = unref[last];
      plan.copy_last = allocator_.ref_count(last) - moved_off > 1;
      moved_off += plan.copy_last;
    }
  }
  return plan;
}

int64_t CacheManager::blocks_needed_to_append(std::span<const int64_t> seq_ids, int64_t tokens_each) {
  const uint64_t mark = new_batch_mark();
  unref_scratch_.clear();
  int64_t needed = 0;
  for (const int64_t id : seq_ids) {
    const AppendPlan plan = plan_append(batch_member(id, mark), id, tokens_each, unref_scratch_);
    needed += plan.copy_last + plan.new_blocks;
  }
  // plan_append checked the count for each sequence; an empty batch checks it here.
  if (tokens_each < 0 || tokens_each > max_seq_len_) {
    throw std::invalid_argument("pagedkv: blocks_needed_to_append: num_tokens = " + str(tokens_each) +
                                " is outside [0, " + str(max_seq_len_) + "] (max_seq_len)");
  }
  return needed;
}

bool CacheManager::can_allocate(int64_t num_blocks) const {
  if (num_blocks < 0) {
    throw std::invalid_argument("pagedkv: can_allocate: num_blocks = " + str(num_blocks) + " must be >= 0");
  }
  return num_blocks <= allocator_.num_free();
}

void CacheManager::write_tokens(Sequence& seq, const AppendPlan& plan, int64_t n, const int32_t* tokens,
                                std::vector<BlockCopy>& copies) {
  if (plan.copy_last) {
    const int32_t src = seq.blocks.back();
    const int32_t dst = allocator_.allocate();
    allocator_.release(src);  // still owned by the sequences it is shared with
    seq.blocks.back() = dst;
    copies.push_back({src, dst});
  } else if (n > 0 && seq.num_tokens % block_size_ != 0) {
    // Its own partly filled last block: keyed only if truncate() reopened it, and its slots are
    // about to hold other tokens.
    allocator_.unregister(seq.blocks.back());
  }
  for (int64_t i = 0; i < n; ++i) {
    if (seq.num_tokens % block_size_ == 0) seq.blocks.push_back(allocator_.allocate());
    ++seq.num_tokens;
    if (tokens != nullptr && tokens[i] == kPendingToken) seq.pending = 1;  // only n == 1 passes one
    if (!seq.keyable) continue;
    ++seq.named;
    if (!prefix_caching_) continue;
    seq.tokens.push_back(tokens[i]);
    if (seq.pending == 0) register_if_full(seq);
  }
}

void CacheManager::register_if_full(Sequence& seq) {
  const int64_t n = static_cast<int64_t>(seq.tokens.size());
  if (n % block_size_ != 0 || n / block_size_ == static_cast<int64_t>(seq.full_keys.size())) return;
  const int32_t* block_tokens = seq.tokens.data() + (n - block_size_);
  const uint64_t parent = seq.last_full_key();
  const uint64_t key = chain_hash(parent, block_tokens, block_size_);
  allocator_.register_full(seq.blocks[static_cast<size_t>(n / block_size_ - 1)], key, parent, block_tokens);
  seq.full_keys.push_back(key);
}

void CacheManager::set_pending_tokens(std::span<const int64_t> seq_ids, std::span<const int32_t> tokens) {
  if (seq_ids.size() != tokens.size()) {
    throw std::invalid_argument("pagedkv: set_pending_tokens takes one token per sequence: got " +
                                str(seq_ids.size()) + " sequence ids and " + str(tokens.size()) +
                                " tokens");
  }
  const uint64_t mark = new_batch_mark();
  for (size_t i = 0; i < seq_ids.size(); ++i) {
    const Sequence& seq = batch_member(seq_ids[i], mark);
    if (seq.pending == 0) {
      throw std::invalid_argument("pagedkv: sequence " + str(seq_ids[i]) + " has no slot waiting for "
                                  "its token (append_batch with token -1 makes one)");
    }
    if (tokens[i] < 0) {
      throw std::invalid_argument("pagedkv: set_pending_tokens got token " + str(tokens[i]) +
                                  " for sequence " + str(seq_ids[i]) + "; token ids are >= 0");
    }
  }
  for (size_t i = 0; i < seq_ids.size(); ++i) {
    Sequence& seq = find(seq_ids[i]);
    seq.pending = 0;
    if (!prefix_caching_ || !seq.keyable) continue;
    seq.tokens.back() = tokens[i];
    register_if_full(seq);
  }
}

void CacheManager::append_tokens(int64_t seq_id, std::span<const int32_t> tokens,
                                 std::vector<BlockCopy>& copies) {
  Sequence& seq = find(seq_id);
  const int64_t n = static_cast<int64_t>(tokens.size());
  check_tokens(tokens, "pagedkv: append_tokens got token -1; a slot for a token not known yet is "
                       "reserved by append_batch");
  unref_scratch_.clear();
  const AppendPlan plan = plan_append(seq, seq_id, n, unref_scratch_);
  check_free_blocks(plan.copy_last + plan.new_blocks, "appending to a sequence");
  write_tokens(seq, plan, n, tokens.data(), copies);
}

void CacheManager::reserve(int64_t seq_id, int64_t num_tokens, std::vector<BlockCopy>& copies) {
  Sequence& seq = find(seq_id);
  unref_scratch_.clear();
  const AppendPlan plan = plan_append(seq, seq_id, num_tokens, unref_scratch_);
  check_free_blocks(plan.copy_last + plan.new_blocks, "reserving slots for a sequence");
  if (num_tokens == 0) return;
  // Blocks holding tokens not known yet are keyed only once name_reserved names them, and so
  // are the blocks after them.
  seq.keyable = false;
  write_tokens(seq, plan, num_tokens, nullptr, copies);
}

void CacheManager::name_reserved(int64_t seq_id, std::span<const int32_t> tokens) {
  Sequence& seq = find(seq_id);
  check_tokens(tokens, "pagedkv: name_reserved got token -1; name each slot with its token id");
  const int64_t n = static_cast<int64_t>(tokens.size());
  if (n > seq.num_tokens - seq.named) {
    throw std::invalid_argument("pagedkv: sequence " + str(seq_id) + " has " + str(seq.num_tokens - seq.named) +
                                " slots without token ids (reserve); cannot name " + str(n));
  }
  for (const int32_t token : tokens) {
    ++seq.named;
    if (!prefix_caching_) continue;
    seq.tokens.push_back(token);
    register_if_full(seq);
  }
  seq.keyable = seq.named == seq.num_tokens;
}

void CacheManager::append_batch(std::span<const int64_t> seq_ids, std::span<const int32_t> tokens,
                                std::vector<BlockCopy>& copies) {
  if (seq_ids.size() != tokens.size()) {
    throw std::invalid_argument("pagedkv: append_batch takes one token per sequence: got " +
                                str(seq_ids.size()) + " sequence ids and " + str(tokens.size()) +
                                " tokens");
  }
  check_tokens(tokens, nullptr);
  const uint64_t mark = new_batch_mark();
  unref_scratch_.clear();
  plans_scratch_.clear();
  int64_t needed = 0;
  for (const int64_t id : seq_ids) {
    plans_scratch_.push_back(plan_append(batch_member(id, mark), id, 1, unref_scratch_));
    needed += plans_scratch_.back().copy_last + plans_scratch_.back().new_blocks;
  }
  check_free_blocks(needed, "appending a token to each sequence of the batch");
  for (size_t i = 0; i < seq_ids.size(); ++i) {
    write_tokens(*plans_scratch_[i].seq, plans_scratch_[i], 1, &tokens[i], copies);
  }
}

void CacheManager::truncate(int64_t seq_id, int64_t num_tokens) {
  Sequence& seq = find(seq_id);
  if (num_tokens < 0 || num_tokens >= seq.num_tokens) {
    throw std::invalid_argument("pagedkv: cannot truncate " + str(num_tokens) + " tokens of sequence " +
                                str(seq_id) + ", which has " + str(seq.num_tokens) + "; allowed: [0, " +
                                str(seq.num_tokens - 1) + "] (free the sequence to drop all of it)");
  }
  if (seq.pending != 0) {
    throw std::invalid_argument("pagedkv: sequence " + str(seq_id) + " has a slot whose token is not "
                                "known yet; name it with set_pending_tokens before truncating");
  }
  if (num_tokens == 0) return;
  const int64_t kept = seq.num_tokens - num_tokens;
  if (seq.released > 0 && kept - seq.window < static_cast<int64_t>(seq.released) * block_size_) {
    throw std::invalid_argument("pagedkv: cannot truncate sequence " + str(seq_id) + " to " + str(kept) +
                                " tokens: the window (" + str(seq.window) + ") of its next token would "
                                "reach its first " + str(seq.released) + " blocks, already released; "
                                "allowed: keep at least " +
                                str(static_cast<int64_t>(seq.released) * block_size_ + seq.window) + " tokens");
  }
  const size_t kept_blocks = static_cast<size_t>(blocks_for(kept));
  for (size_t b = seq.blocks.size(); b-- > kept_blocks;) allocator_.release(seq.blocks[b], false);
  seq.blocks.resize(kept_blocks);
  seq.num_tokens = kept;
  if (seq.named > kept) {
    seq.named = kept;
    if (prefix_caching_) {
      seq.tokens.resize(static_cast<size_t>(kept));
      seq.full_keys.resize(static_cast<size_t>(kept / block_size_));
    }
  }
  seq.keyable = seq.named == seq.num_tokens;
}

void CacheManager::fork(int64_t parent_id, int64_t child_id) {
  const Sequence& parent = sequence(parent_id);
  if (contains(child_id)) {
    throw std::invalid_argument("pagedkv: cannot fork into sequence " + str(child_id) +
                                ": it is already in the cache");
  }
  Sequence child = parent;
  child.batch_mark = 0;
  for (size_t b = child.released; b < child.blocks.size(); ++b) allocator_.add_ref(child.blocks[b]);
  sequences_.emplace(child_id, std::move(child));
}

void CacheManager::free_sequence(int64_t seq_id, bool keep_cached) {
  const auto it = sequences_.find(seq_id);
  if (it == sequences_.end()) throw UnknownSequence(seq_id);
  // Last block first: the LRU then evicts a freed prompt from its end, keeping the shared start.
  const std::vector<int32_t>& blocks = it->second.blocks;
  const size_t released = static_cast<size_t>(it->second.released);  // given back already
  for (size_t b = blocks.size(); b-- > released;) allocator_.release(blocks[b], keep_cached);
  sequences_.erase(it);
}

int64_t CacheManager::release_out_of_window(std::span<const int64_t> seq_ids, int64_t window) {
  if (window < 1) {
    throw std::invalid_argument("pagedkv: release_out_of_window: window = " + str(window) +
                                " must be >= 1 (a model with a layer without a window releases nothing)");
  }
  const uint64_t mark = new_batch_mark();
  for (const int64_t id : seq_ids) {
    const Sequence& seq = batch_member(id, mark);
    if (seq.named != seq.num_tokens) {
      throw std::invalid_argument("pagedkv: release_out_of_window: sequence " + str(id) + " has " +
                                  str(seq.num_tokens - seq.named) + " slots reserved without token ids "
                                  "(reserve); their steps have not run, so its window is not known");
    }
  }
  int64_t total = 0;
  for (const int64_t id : seq_ids) {
    Sequence& seq = find(id);
    // Whole blocks only: block b holds positions [b * block_size, (b + 1) * block_size).
    const int64_t before = seq.num_tokens - window;
    const int32_t upto = before > 0 ? static_cast<int32_t>(before / block_size_) : 0;
    if (upto <= seq.released) continue;
    // Last first, as free_sequence: the LRU evicts a block after those before it.
    for (int32_t b = upto; b-- > seq.released;) {
      allocator_.release(seq.blocks[b]);
      seq.blocks[b] = kReleasedBlock;
    }
    total += upto - seq.released;
    seq.released = upto;
    seq.window = window;
  }
  return total;
}

}  // namespace pagedkv
