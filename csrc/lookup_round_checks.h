// Argument checks of lookup_propose and lookup_accept, shared by the CPU and CUDA implementations
// so both reject a bad call with the same message, before anything is written.
#pragma once
#include <cstdint>
#include <limits>
#include <utility>

#include "checks.h"
#include "kernel_checks.h"
#include "kernels/lookup_round_rule.h"

namespace pagedkv {

// history [rows, max_length] int64, contiguous; positions are int32, so max_length + width must fit.
inline void check_history(const at::Tensor& history, int64_t rows, int64_t width) {
  check_dtype(history, at::kLong, "history");
  TORCH_CHECK(history.dim() == 2 && history.size(0) == rows && history.size(1) >= 1,
              "pagedkv: history must have shape [rows, max_length] with max_length >= 1 = [", rows,
              ", >= 1], got ", history.sizes());
  TORCH_CHECK(history.size(1) + width <= std::numeric_limits<int32_t>::max(),
              "pagedkv: history's max_length ", history.size(1), " + width ", width,
              " must fit int32 positions");
  check_contiguous(history, "history");
}

// feed [rows, width] int64 with width >= 1, contiguous.
inline void check_feed(const at::Tensor& feed, int64_t rows) {
  check_dtype(feed, at::kLong, "feed");
  TORCH_CHECK(feed.dim() == 2 && feed.size(0) == rows && feed.size(1) >= 1,
              "pagedkv: feed must have shape [rows, width] = [", rows, ", width >= 1], got ",
              feed.sizes());
  check_contiguous(feed, "feed");
}

// Both ops' first checks: feed and history, whose rows and width size every other argument.
inline std::pair<int64_t, int64_t> check_feed_and_history(const at::Tensor& feed,
                                                          const at::Tensor& history) {
  TORCH_CHECK(feed.dim() == 2, "pagedkv: feed must have shape [rows, width], got ", feed.sizes());
  const int64_t rows = feed.size(0);
  check_feed(feed, rows);
  const int64_t width = feed.size(1);
  check_history(history, rows, width);
  check_same_device(history, feed, "history", "feed");
  return {rows, width};
}

inline void check_rows_of(const at::Tensor& t, at::ScalarType dtype, const char* name,
                          const at::Tensor& ref, const char* ref_name, int64_t size,
                          const char* size_name) {
  check_dtype(t, dtype, name);
  check_same_device(t, ref, name, ref_name);
  check_vector(t, size, name, size_name);
}

inline kernels::LookupPropose checked_lookup_propose(
    const at::Tensor& history, const at::Tensor& lengths, const at::Tensor& generated,
    const at::Tensor& done, const at::Tensor& block_tables, const at::Tensor& feed,
    const at::Tensor& proposal_lens, const at::Tensor& positions, const at::Tensor& slot_mapping,
    const at::Tensor& context_lens, const at::Tensor& max_new, int64_t k, int64_t max_ngram,
    int64_t block_size) {
  const auto [rows, width] = check_feed_and_history(feed, history);
  check_rows_of(lengths, at::kLong, "lengths", feed, "feed", rows, "rows");
  check_rows_of(generated, at::kLong, "generated", feed, "feed", rows, "rows");
  check_rows_of(max_new, at::kLong, "max_new", feed, "feed", rows, "rows");
  check_rows_of(done, at::kBool, "done", feed, "feed", rows, "rows");
  check_rows_of(proposal_lens, at::kLong, "proposal_lens", feed, "feed", rows, "rows");
  check_rows_of(positions, at::kInt, "positions", feed, "feed", rows * width, "rows * width");
  check_rows_of(slot_mapping, at::kInt, "slot_mapping", feed, "feed", rows * width, "rows * width");
  check_rows_of(context_lens, at::kInt, "context_lens", feed, "feed", rows * width, "rows * width");
  check_dtype(block_tables, at::kInt, "block_tables");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == rows,
              "pagedkv: block_tables must have shape [rows, max_blocks] = [", rows, ", *], got ",
              block_tables.sizes());
  check_contiguous(block_tables, "block_tables");
  check_same_device(block_tables, feed, "block_tables", "feed");
  TORCH_CHECK(k >= 0, "pagedkv: k must be >= 0, got ", k);
  TORCH_CHECK(max_ngram >= 1, "pagedkv: max_ngram must be >= 1, got ", max_ngram);
  TORCH_CHECK(block_size >= 1, "pagedkv: block_size must be >= 1, got ", block_size);
  TORCH_CHECK(block_size <= std::numeric_limits<int32_t>::max(),
              "pagedkv: block_size must fit int32, got ", block_size);
  return kernels::LookupPropose{
      history.const_data_ptr<int64_t>(),  lengths.const_data_ptr<int64_t>(),
      generated.const_data_ptr<int64_t>(), max_new.const_data_ptr<int64_t>(),
      done.const_data_ptr<bool>(),
      block_tables.const_data_ptr<int32_t>(), feed.data_ptr<int64_t>(),
      proposal_lens.data_ptr<int64_t>(),  positions.data_ptr<int32_t>(),
      slot_mapping.data_ptr<int32_t>(),   context_lens.data_ptr<int32_t>(),
      rows, history.size(1), k, max_ngram,
      static_cast<int>(width), static_cast<int>(block_tables.size(1)), static_cast<int>(block_size)};
}

inline kernels::LookupAccept checked_lookup_accept(
    const at::Tensor& greedy, const at::Tensor& feed, const at::Tensor& proposal_lens,
    const at::Tensor& eos_ids, const at::Tensor& history, const at::Tensor& lengths,
    const at::Tensor& generated, const at::Tensor& done, const at::Tensor& stats,
    const at::Tensor& max_new) {
  const auto [rows, width] = check_feed_and_history(feed, history);
  check_rows_of(greedy, at::kLong, "greedy", feed, "feed", rows * width, "rows * width");
  check_rows_of(proposal_lens, at::kLong, "proposal_lens", feed, "feed", rows, "rows");
  check_rows_of(lengths, at::kLong, "lengths", feed, "feed", rows, "rows");
  check_rows_of(generated, at::kLong, "generated", feed, "feed", rows, "rows");
  check_rows_of(done, at::kBool, "done", feed, "feed", rows, "rows");
  check_rows_of(max_new, at::kLong, "max_new", feed, "feed", rows, "rows");
  check_dtype(eos_ids, at::kLong, "eos_ids");
  TORCH_CHECK(eos_ids.dim() == 1, "pagedkv: eos_ids must have shape [num_eos] (num_eos >= 0), got ",
              eos_ids.sizes());
  check_contiguous(eos_ids, "eos_ids");
  check_same_device(eos_ids, feed, "eos_ids", "feed");
  check_dtype(stats, at::kLong, "stats");
  TORCH_CHECK(stats.dim() == 2 && stats.size(0) == rows && stats.size(1) == 3,
              "pagedkv: stats must have shape [rows, 3] = [", rows, ", 3], got ", stats.sizes());
  check_contiguous(stats, "stats");
  check_same_device(stats, feed, "stats", "feed");
  return kernels::LookupAccept{
      greedy.const_data_ptr<int64_t>(), feed.const_data_ptr<int64_t>(),
      proposal_lens.const_data_ptr<int64_t>(), eos_ids.const_data_ptr<int64_t>(),
      history.data_ptr<int64_t>(),      lengths.data_ptr<int64_t>(),
      generated.data_ptr<int64_t>(),    max_new.const_data_ptr<int64_t>(),
      done.data_ptr<bool>(),            stats.data_ptr<int64_t>(),
      rows, history.size(1), eos_ids.size(0),
      static_cast<int>(width)};
}

}  // namespace pagedkv
