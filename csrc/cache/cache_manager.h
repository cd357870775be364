// The bookkeeping of the paged KV cache: which blocks hold which tokens of which sequence. It
// never touches K/V data; where a sequence must write into a block it shares (copy-on-write), it
// reports the block copy for the caller to do on the device.
//
// Every mutating call checks everything first (ids, lengths, blocks needed, counting copy-on-write
// and revived cached blocks) and only then changes state, so a failed call changes nothing.
#pragma once
#include <cstdint>
#include <span>
#include <unordered_map>
#include <vector>

#include "cache/block_allocator.h"
#include "cache/sequence.h"

namespace pagedkv {

class CacheManager {
 public:
  CacheManager(int32_t num_blocks, int32_t block_size, int64_t max_seq_len, bool prefix_caching);

  // A new sequence holding a slot for each prompt token. Full leading blocks already in the prefix
  // cache are shared instead of allocated; returns how many prompt tokens they cover (their K/V
  // need no computing). At most the prompt's length - 1 is reused, so a step always computes at
  // least the last token (whose logits it needs).
  int64_t add_sequence(int64_t seq_id, std::span<const int32_t> tokens);
  // Slots for more tokens of one sequence (a prefill chunk); block copies go to `copies`.
  void append_tokens(int64_t seq_id, std::span<const int32_t> tokens, std::vector<BlockCopy>& copies);
  // Slots for num_tokens tokens whose ids are not known yet (e.g. generate() reserving a whole
  // generation up front). The sequence's blocks from here on enter the prefix cache only as
  // name_reserved names their tokens.
  void reserve(int64_t seq_id, int64_t num_tokens, std::vector<BlockCopy>& copies);
  // The ids of the next tokens.size() slots without ids (reserved, or appended after them), once
  // known and their K/V written (generate() after its call): the full blocks they complete enter
  // the prefix cache. Naming every such slot makes the sequence keyable again.
  void name_reserved(int64_t seq_id, std::span<const int32_t> tokens);
  // Every cached block that no sequence holds leaves the prefix cache (its K/V are stale: the
  // model's weights changed).
  void drop_cached() { allocator_.drop_cached(); }
  // One more token for each sequence (a decode step), all or nothing. A token of kPendingToken
  // reserves the slot of a token not known yet; set_pending_tokens names it later, and the
  // sequence takes no other append until then.
  void append_batch(std::span<const int64_t> seq_ids, std::span<const int32_t> tokens,
                    std::vector<BlockCopy>& copies);
  // The tokens of pending slots, one per sequence, all or nothing; a block they fill enters the
  // prefix cache now.
  void set_pending_tokens(std::span<const int64_t> seq_ids, std::span<const int32_t> tokens);
  // Gives back the sequence's last num_tokens slots (e.g. speculative tokens a step rejected),
  // keeping at least one. Blocks left empty are released and leave the prefix cache (their K/V
  // may never have been written). A kept, partly emptied block keeps its K/V and its key until
  // the sequence writes into it again: then it leaves the prefix cache if the sequence holds it
  // alone, else it is copied first (copy-on-write), as for any shared block. Refused where the
  // next token's window would reach a block release_out_of_window gave back.
  void truncate(int64_t seq_id, int64_t num_tokens);
  // Sliding windows: gives back each sequence's leading blocks whose every token lies before
  // position num_tokens - window, which no token at a later position attends to when every layer
  // of the model has a window of at most `window` (>= 1) tokens. Blocks go back as free_sequence
  // gives them (a cached full block stays findable until evicted); the sequence keeps its length,
  // positions and block-table length (released entries hold kReleasedBlock). Call it only while
  // every slot of these sequences belongs to a step already queued on the device (the reads of a
  // queued step come before a later step's writes to a reused block); a sequence with slots
  // reserved without ids (reserve) is refused. All or nothing; returns the blocks released.
  int64_t release_out_of_window(std::span<const int64_t> seq_ids, int64_t window);
  // A new sequence sharing all of the parent's blocks (and tokens) by reference count.
  void fork(int64_t parent_id, int64_t child_id);
  // Drops the sequence; its blocks go back (cached full blocks stay findable until evicted, unless
  // keep_cached is false: after a failed step, whose reserved blocks may hold unwritten K/V).
  void free_sequence(int64_t seq_id, bool keep_cached = true);

  // What add_sequence / append_* would take from the free blocks (a scheduler asks first).
  // tokens_each must be in [0, max_seq_len] (checked even for an empty batch).
  int32_t blocks_needed_to_add(std::span<const int32_t> tokens) const;
  int64_t blocks_needed_to_append(std::span<const int64_t> seq_ids, int64_t tokens_each);
  // Whether num_blocks (>= 0, else invalid_argument) blocks are free.
  bool can_allocate(int64_t num_blocks) const;

  const Sequence& sequence(int64_t seq_id) const;
  bool contains(int64_t seq_id) const { return sequences_.count(seq_id) != 0; }
  std::vector<int64_t> sequence_ids() const;
  int64_t num_sequences() const { return static_cast<int64_t>(sequences_.size()); }

  // The sequence named by seq_id in the batch call marked `mark`; throws on an unknown id or on
  // an id named twice in one call.
  Sequence& batch_member(int64_t seq_id, uint64_t mark);
  uint64_t new_batch_mark() { return ++last_batch_mark_; }

  const BlockAllocator& allocator() const { return allocator_; }
  int32_t block_size() const { return block_size_; }
  int64_t max_seq_len() const { return max_seq_len_; }
  int32_t max_blocks_per_seq() const { return max_blocks_per_seq_; }
  bool prefix_caching() const { return prefix_caching_; }

 private:
  struct AppendPlan {
    Sequence* seq;
    bool copy_last;      // the last block is shared and partly filled: copy it before writing
    int32_t new_blocks;  // blocks needed past the last one
  };
  Sequence& find(int64_t seq_id);
  // Checks one sequence's append of n tokens and what it takes; `unref` holds the owners that
  // earlier members of the same batch will have moved off each shared block by then.
  AppendPlan plan_append(Sequence& seq, int64_t seq_id, int64_t n,
                         std::unordered_map<int32_t, int32_t>& unref) const;
  void check_free_blocks(int64_t needed, const char* what) const;
  // An empty prompt, one past max_seq_len or one larger than the whole cache can never be added.
  void check_prompt(std::span<const int32_t> tokens) const;
  // Token ids are >= 0. kPendingToken is taken where pending_error is null (append_batch), else
  // refused with that message.
  static void check_tokens(std::span<const int32_t> tokens, const char* pending_error);
  // n more tokens; `tokens` is read only while the sequence is keyable (reserve passes none).
  void write_tokens(Sequence& seq, const AppendPlan& plan, int64_t n, const int32_t* tokens,
                    std::vector<BlockCopy>& copies);
  // A tail of block_size known tokens: key the block holding the last named token and make it findable.
  void register_if_full(Sequence& seq);
  // Prefix-cache keys of the prompt's full blocks and the leading ones found cached (`hits`);
  // returns how many of the hits have no owner now (reviving them takes them from the free count).
  int32_t match_prefix(std::span<const int32_t> tokens, std::vector<uint64_t>& keys,
                       std::vector<int32_t>& hits) const;
  int32_t blocks_for(int64_t num_tokens) const {
    return static_cast<int32_t>((num_tokens + block_size_ - 1) / block_size_);
  }

  int32_t block_size_;
  int64_t max_seq_len_;
  int32_t max_blocks_per_seq_;
  bool prefix_caching_;
  BlockAllocator allocator_;
  std::unordered_map<int64_t, Sequence> sequences_;
  uint64_t last_batch_mark_ = 0;
  // Reused by every append call, so a decode step allocates nothing here.
  std::unordered_map<int32_t, int32_t> unref_scratch_;
  std::vector<AppendPlan> plans_scratch_;
};

}  // namespace pagedkv
