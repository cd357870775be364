// The torch-free cache core (csrc/cache/) on its own, built by scripts/cpp_sanitize.sh under
// AddressSanitizer and UBSan: fixed cases of every operation and error path, then long random
// operation sequences with the manager's invariants checked after every operation. The Python
// property tests compare the same core against a model; this program exists so that the
// sanitizers see every line of it run, with no Python, torch or pybind11 in between.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <limits>
#include <map>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "cache/cache_manager.h"
#include "cache/errors.h"
#include "cache/step_metadata.h"

using namespace pagedkv;

namespace {

int g_checks = 0;
// Outcomes of the random operations, printed so that a run shows it reached every path.
int g_done = 0, g_full = 0, g_refused = 0;

#define CHECK(cond)                                                              \
  do {                                                                           \
    ++g_checks;                                                                  \
    if (!(cond)) {                                                               \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                              \
    }                                                                            \
  } while (0)

// Runs `call`, which must throw E (and change nothing: the caller compares state around it).
template <typename E, typename F>
void expect_throw_at(int line, F&& call) {
  try {
    call();
  } catch (const E&) {
    ++g_checks;
    return;
  }
  std::fprintf(stderr, "%s:%d: expected an exception that was not thrown\n", __FILE__, line);
  std::abort();
}
#define EXPECT_THROW(E, ...) expect_throw_at<E>(__LINE__, __VA_ARGS__)

std::vector<int32_t> tokens_of(int64_t n, int32_t first = 3) {
  std::vector<int32_t> t(n);
  for (int64_t i = 0; i < n; ++i) t[i] = first + static_cast<int32_t>(i % 5);
  return t;
}

// Everything a failed call must leave as it was, and what the invariants are computed from.
struct Snapshot {
  std::map<int64_t, std::vector<int32_t>> tables;
  std::map<int64_t, int64_t> lens;
  std::vector<int32_t> refs, evictable;
  int32_t num_free;
  bool operator==(const Snapshot&) const = default;
};

Snapshot snapshot(const CacheManager& m) {
  Snapshot s;
  for (const int64_t id : m.sequence_ids()) {
    s.tables[id] = m.sequence(id).blocks;
    s.lens[id] = m.sequence(id).num_tokens;
  }
  for (int32_t b = 0; b < m.allocator().num_blocks(); ++b) s.refs.push_back(m.allocator().ref_count(b));
  s.evictable = m.allocator().evictable_blocks();
  s.num_free = m.allocator().num_free();
  return s;
}

// Ref counts equal owners, tables are as long as their tokens need, free + used = total.
void check_invariants(const CacheManager& m) {
  const int32_t n = m.allocator().num_blocks();
  std::vector<int32_t> owners(n, 0);
  for (const int64_t id : m.sequence_ids()) {
    const Sequence& seq = m.sequence(id);
    const int64_t want = (seq.num_tokens + m.block_size() - 1) / m.block_size();
    CHECK(static_cast<int64_t>(seq.blocks.size()) == want);
    CHECK(seq.num_tokens <= m.max_seq_len());
    // Only slots reserve() left without ids (and those after them) are unnamed.
    CHECK(seq.named <= seq.num_tokens && seq.keyable == (seq.named == seq.num_tokens));
    if (m.prefix_caching()) {  // the named ids and one chained key per full block of them
      CHECK(static_cast<int64_t>(seq.tokens.size()) == seq.named);
      CHECK(static_cast<int64_t>(seq.full_keys.size()) == seq.named / m.block_size());
    }
    std::vector<int32_t> sorted = seq.blocks;
    std::sort(sorted.begin(), sorted.end());
    CHECK(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end());
    for (const int32_t b : seq.blocks) {
      CHECK(b >= 0 && b < n);
      ++owners[b];
    }
  }
  int32_t used = 0;
  for (int32_t b = 0; b < n; ++b) {
    CHECK(m.allocator().ref_count(b) == owners[b]);
    used += owners[b] > 0;
  }
  CHECK(used + m.allocator().num_free() == n);
  for (const int32_t b : m.allocator().evictable_blocks()) CHECK(owners[b] == 0);
  if (!m.prefix_caching()) CHECK(m.allocator().num_evictable() == 0);
}

// truncate() gives back the last slots; a reopened block keeps its K/V and key until the sequence
// writes other tokens into it, and never stays findable under its old tokens after that.
void test_truncate() {
  CacheManager m(8, 4, 64, true);
  std::vector<BlockCopy> copies;
  const std::vector<int32_t> prompt = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  const std::vector<int32_t> again = {1, 2, 3, 4, 5, 6, 7, 8, 9};
  const std::vector<int32_t> other = {1, 2, 3, 4, 5, 6, 0, 0, 9};
  m.add_sequence(0, prompt);  // blocks 0, 1 full and keyed, block 2 partial
  m.truncate(0, 4);           // 6 tokens: block 2 freed, block 1 reopened
  CHECK(m.sequence(0).num_tokens == 6 && m.sequence(0).blocks.size() == 2);
  CHECK(m.allocator().num_free() == 6 && m.allocator().num_evictable() == 0);
  CHECK(m.blocks_needed_to_add(again) == 1);  // block 1 still holds 5 6 7 8
  m.append_tokens(0, std::vector<int32_t>{0, 0}, copies);  // written in place: 5 6 0 0
  CHECK(copies.empty());
  CHECK(m.blocks_needed_to_add(again) == 2);  // the old key is gone
  CHECK(m.add_sequence(1, other) == 8);       // the new one hits
  CHECK(m.sequence(1).blocks[1] == m.sequence(0).blocks[1]);
  // Reopened while shared, then left alone by the other owner: written in place, key dropped.
  m.truncate(1, 3);  // 6 tokens
  m.free_sequence(0);
  CHECK(m.allocator().ref_count(m.sequence(1).blocks[1]) == 1);
  m.append_tokens(1, std::vector<int32_t>{3}, copies);
  CHECK(copies.empty() && m.blocks_needed_to_add(other) == 2);
  // Reopened while shared and written while still shared: copied first.
  m.append_tokens(1, std::vector<int32_t>{3, 9}, copies);  // 1 2 3 4 | 5 6 3 3 | 9
  m.fork(1, 2);
  m.truncate(2, 2);  // 7 tokens, block 1 shared with sequence 1
  m.append_tokens(2, std::vector<int32_t>{1}, copies);
  CHECK(copies.size() == 1 && copies[0].src == m.sequence(1).blocks[1]);
  EXPECT_THROW(std::invalid_argument, [&] { m.truncate(2, 8); });  // would leave no token
  EXPECT_THROW(std::invalid_argument, [&] { m.truncate(2, -1); });
  EXPECT_THROW(UnknownSequence, [&] { m.truncate(7, 1); });
  m.append_batch(std::vector<int64_t>{2}, std::vector<int32_t>{kPendingToken}, copies);
  EXPECT_THROW(std::invalid_argument, [&] { m.truncate(2, 1); });  // its pending token first
  // Reserved slots truncated away make the sequence keyable again.
  m.reserve(1, 3, copies);
  CHECK(!m.sequence(1).keyable);
  m.truncate(1, 3);
  CHECK(m.sequence(1).keyable && m.sequence(1).named == 9);
  for (const int64_t id : m.sequence_ids()) m.free_sequence(id);
  CHECK(m.allocator().num_free() == 8);
}

void test_constructor_refuses_bad_sizes() {
  EXPECT_THROW(std::invalid_argument, [] { CacheManager(0, 16, 64, true); });
  EXPECT_THROW(std::invalid_argument, [] { CacheManager(4, 12, 64, true); });
  EXPECT_THROW(std::invalid_argument, [] { CacheManager(4, 16, 0, true); });
  EXPECT_THROW(std::invalid_argument, [] { CacheManager(1 << 30, 16, 64, true); });
  EXPECT_THROW(std::invalid_argument, [] { StepLayout(0, 4, 4); });
}

void test_add_append_fork_free() {
  CacheManager m(8, 4, 32, true);
  CHECK(m.add_sequence(1, tokens_of(6)) == 0);
  CHECK(m.sequence(1).blocks.size() == 2);
  std::vector<BlockCopy> copies;
  m.fork(1, 2);
  CHECK(m.allocator().ref_count(m.sequence(1).blocks[1]) == 2);
  // The shared last block is partly filled: the first writer copies it.
  const std::vector<int64_t> ids{1, 2};
  const std::vector<int32_t> next{9, 9};
  m.append_batch(ids, next, copies);
  CHECK(copies.size() == 1);
  CHECK(m.sequence(1).blocks[1] != m.sequence(2).blocks[1]);
  check_invariants(m);
  // Same prompt again: its first full block is a prefix hit.
  CHECK(m.add_sequence(3, tokens_of(6)) == 4);
  m.reserve(3, 5, copies);
  CHECK(m.sequence(3).num_tokens == 11);
  check_invariants(m);
  for (const int64_t id : {1, 2, 3}) m.free_sequence(id);
  CHECK(m.num_sequences() == 0 && m.allocator().num_free() == 8);
  check_invariants(m);
  // keep_cached=false (after a failed step): the freed full blocks are no longer prefix hits.
  const int32_t evictable = m.allocator().num_evictable();
  CHECK(m.add_sequence(4, tokens_of(9, 50)) == 0);
  m.free_sequence(4, false);
  CHECK(m.allocator().num_evictable() == evictable);
  CHECK(m.add_sequence(5, tokens_of(9, 50)) == 0);
  m.free_sequence(5);
  CHECK(m.allocator().num_evictable() == evictable + 2);
  CHECK(m.add_sequence(6, tokens_of(9, 50)) == 8);
  m.free_sequence(6);
  check_invariants(m);
  // Reserved slots named later (generate() after its call) key their full blocks.
  CHECK(m.add_sequence(7, tokens_of(3, 60)) == 0);
  m.reserve(7, 6, copies);
  const std::vector<int32_t> all = tokens_of(9, 60);
  m.name_reserved(7, std::span<const int32_t>(all).subspan(3, 5));  // tokens 3..7: blocks 0, 1 full
  EXPECT_THROW(std::invalid_argument, [&] { m.name_reserved(7, tokens_of(2)); });  // one slot left
  check_invariants(m);
  m.free_sequence(7);
  CHECK(m.add_sequence(8, all) == 8);
  m.free_sequence(8);
  // drop_cached: no unheld block stays findable.
  m.drop_cached();
  CHECK(m.allocator().num_evictable() == 0 && m.add_sequence(9, all) == 0);
  m.free_sequence(9);
  check_invariants(m);
}

void test_errors_change_nothing() {
  CacheManager m(4, 4, 24, true);
  std::vector<BlockCopy> copies;
  m.add_sequence(1, tokens_of(9));  // 3 blocks
  const Snapshot before = snapshot(m);
  EXPECT_THROW(CacheFull, [&] { m.add_sequence(2, tokens_of(8, 100)); });
  EXPECT_THROW(CacheFull, [&] { m.append_tokens(1, tokens_of(8), copies); });
  EXPECT_THROW(CacheFull, [&] { m.reserve(1, 8, copies); });
  EXPECT_THROW(std::invalid_argument, [&] { m.add_sequence(2, {}); });
  EXPECT_THROW(std::invalid_argument, [&] { m.add_sequence(2, tokens_of(25)); });
  EXPECT_THROW(std::invalid_argument, [&] { m.add_sequence(1, tokens_of(2)); });
  EXPECT_THROW(std::invalid_argument, [&] { m.reserve(1, -1, copies); });
  EXPECT_THROW(std::invalid_argument, [&] { m.append_tokens(1, tokens_of(16), copies); });
  EXPECT_THROW(UnknownSequence, [&] { m.free_sequence(7); });
  EXPECT_THROW(UnknownSequence, [&] { m.fork(7, 8); });
  EXPECT_THROW(std::invalid_argument, [&] { m.fork(1, 1); });
  const std::vector<int64_t> twice{1, 1};
  const std::vector<int32_t> two{5, 5};
  EXPECT_THROW(std::invalid_argument, [&] { m.append_batch(twice, two, copies); });
  const std::vector<int64_t> unknown{1, 9};
  EXPECT_THROW(UnknownSequence, [&] { m.append_batch(unknown, two, copies); });
  const std::vector<int64_t> one{1};
  EXPECT_THROW(std::invalid_argument, [&] { m.append_batch(one, two, copies); });
  CHECK(copies.empty());
  CHECK(snapshot(m) == before);
  m.free_sequence(1);
  EXPECT_THROW(UnknownSequence, [&] { m.free_sequence(1); });  // double free
  CHECK(m.allocator().num_free() == 4);
}

void test_step_metadata_errors() {
  CacheManager m(8, 4, 16, false);
  m.add_sequence(1, tokens_of(5));
  const StepLayout layout(2, 8, m.max_blocks_per_seq());
  std::vector<int32_t> buffer(layout.size, -7);
  const std::vector<int64_t> ids{1};
  const std::vector<int32_t> too_long{6}, all{5}, two{1, 1};
  EXPECT_THROW(std::invalid_argument, [&] { build_step_metadata(m, layout, ids, {}, 3, buffer.data()); });
  EXPECT_THROW(std::invalid_argument, [&] { build_step_metadata(m, layout, ids, too_long, 1, buffer.data()); });
  EXPECT_THROW(std::invalid_argument, [&] { build_step_metadata(m, layout, ids, two, 1, buffer.data()); });
  const StepLayout small(2, 4, m.max_blocks_per_seq());
  std::vector<int32_t> small_buffer(small.size);
  EXPECT_THROW(std::invalid_argument, [&] { build_step_metadata(m, small, ids, all, 1, small_buffer.data()); });
  const StepSizes s = build_step_metadata(m, layout, ids, all, 2, buffer.data());
  CHECK(s.num_tokens == 6 && s.max_query_len == 5 && s.max_context_len == 5);
  CHECK(buffer[layout.slot_mapping + 5] == -1);  // the padding row's token
}

constexpr int64_t kI64Max = std::numeric_limits<int64_t>::max();
constexpr int64_t kI64Min = std::numeric_limits<int64_t>::min();
constexpr int32_t kI32Max = std::numeric_limits<int32_t>::max();

// Counts at the edges of int64: refused, never wrapped into a small (or negative) count.
void test_counts_at_the_boundary() {
  CacheManager m(16, 4, 32, true);
  std::vector<BlockCopy> copies;
  m.add_sequence(1, tokens_of(3));
  const Snapshot before = snapshot(m);
  for (const int64_t n : {kI64Max, kI64Max - 3, kI64Max - 29, kI64Min, int64_t{-1}, int64_t{30}}) {
    EXPECT_THROW(std::invalid_argument, [&] { m.reserve(1, n, copies); });
    const std::vector<int64_t> one{1};
    EXPECT_THROW(std::invalid_argument, [&] { m.blocks_needed_to_append(one, n); });
    EXPECT_THROW(std::invalid_argument, [&] { m.blocks_needed_to_append({}, n == 30 ? 33 : n); });
  }
  CHECK(m.blocks_needed_to_append({}, 32) == 0);
  EXPECT_THROW(std::invalid_argument, [&] { m.can_allocate(-1); });
  EXPECT_THROW(std::invalid_argument, [&] { m.can_allocate(kI64Min); });
  CHECK(!m.can_allocate(kI64Max) && m.can_allocate(0) && m.can_allocate(m.allocator().num_free()));
  // Token ids are >= 0; -1 only where append_batch reserves a pending slot.
  const std::vector<int32_t> negative{4, -2}, lowest{std::numeric_limits<int32_t>::min()};
  EXPECT_THROW(std::invalid_argument, [&] { m.add_sequence(2, negative); });
  EXPECT_THROW(std::invalid_argument, [&] { m.blocks_needed_to_add(negative); });
  EXPECT_THROW(std::invalid_argument, [&] { m.append_tokens(1, lowest, copies); });
  const std::vector<int64_t> one{1};
  EXPECT_THROW(std::invalid_argument, [&] { m.append_batch(one, lowest, copies); });
  CHECK(copies.empty() && snapshot(m) == before);
  m.reserve(1, 29, copies);  // exactly to max_seq_len
  CHECK(m.sequence(1).num_tokens == 32);
  EXPECT_THROW(std::invalid_argument, [&] { m.reserve(1, 1, copies); });
  m.add_sequence(kI64Max, tokens_of(1));  // the int64 edges are ids like any other
  m.fork(kI64Max, kI64Min);
  CHECK(m.sequence(kI64Min).num_tokens == 1);
  check_invariants(m);

  const StepLayout layout(2, 8, m.max_blocks_per_seq());
  EXPECT_THROW(std::invalid_argument, [&] { (void)layout.used_size(-1); });
  EXPECT_THROW(std::invalid_argument, [&] { (void)layout.used_size(3); });
  CHECK(layout.used_size(2) == layout.size);
  std::vector<int32_t> buffer(layout.size);
  const std::vector<int64_t> three{1, kI64Max, kI64Min};
  EXPECT_THROW(std::invalid_argument, [&] { build_step_metadata(m, layout, three, {}, 2, buffer.data()); });
  const std::vector<int64_t> edge{kI64Max};
  const std::vector<int32_t> huge{kI32Max};
  EXPECT_THROW(std::invalid_argument, [&] { build_step_metadata(m, layout, edge, huge, 1, buffer.data()); });
  EXPECT_THROW(std::invalid_argument, [&] { build_step_metadata(m, layout, edge, {}, kI32Max, buffer.data()); });
}

// A count for the random runs: mostly small, sometimes at an edge where a sum would wrap.
int64_t random_count(std::mt19937& rng, int hi) {
  static constexpr int64_t kEdges[] = {-1, kI64Max, kI64Max - 3, kI64Min, kI32Max, int64_t{kI32Max} + 1};
  if (std::uniform_int_distribution<int>(0, 15)(rng) == 0) {
    return kEdges[std::uniform_int_distribution<int>(0, std::size(kEdges) - 1)(rng)];
  }
  return std::uniform_int_distribution<int>(-1, hi)(rng);
}

// Random operations on one manager; every call either succeeds or throws and changes nothing.
void random_run(uint32_t seed, int num_ops) {
  std::mt19937 rng(seed);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  const int32_t block_size = 1 << pick(0, 3);
  const int32_t num_blocks = pick(2, 24);
  const int64_t max_seq_len = pick(4, 48);
  CacheManager m(num_blocks, block_size, max_seq_len, pick(0, 1) == 1);
  const StepLayout layout(8, 8 * 48, m.max_blocks_per_seq());
  std::vector<int32_t> buffer(layout.size);
  std::vector<BlockCopy> copies;
  int64_t next_id = 0;
  // Few distinct tokens and a shared opening, so prefix hits and equal blocks are common.
  auto random_tokens = [&](int n) {
    std::vector<int32_t> t(n);
    const bool opening = pick(0, 1);
    for (int i = 0; i < n; ++i) t[i] = opening && i < 8 ? 7 : pick(0, 3);
    return t;
  };
  auto random_ids = [&](int max_n, bool allow_bad) {
    std::vector<int64_t> all = m.sequence_ids();
    std::shuffle(all.begin(), all.end(), rng);
    all.resize(std::min<size_t>(all.size(), pick(1, max_n)));
    if (allow_bad && pick(0, 15) == 0) all.push_back(pick(0, 1) ? -1 : all.empty() ? 0 : all[0]);
    return all;
  };
  for (int op = 0; op < num_ops; ++op) {
    const Snapshot before = snapshot(m);
    copies.clear();
    bool threw = false;
    try {
      const std::vector<int64_t> ids = random_ids(6, true);
      const int64_t some = ids.empty() ? -1 : ids[0];
      switch (pick(0, 10)) {
        case 0: case 1: m.add_sequence(next_id++, random_tokens(pick(0, static_cast<int>(max_seq_len) + 2))); break;
        case 2: m.append_tokens(some, random_tokens(pick(0, 9)), copies); break;
        case 3: m.reserve(some, random_count(rng, 9), copies); break;
        case 4: {
          std::vector<int32_t> toks = random_tokens(static_cast<int>(ids.size()));
          if (pick(0, 20) == 0) toks.push_back(1);
          m.append_batch(ids, toks, copies);
          break;
        }
        case 5: m.fork(some, pick(0, 9) == 0 ? some : next_id++); break;
        case 6: m.free_sequence(some, pick(0, 3) != 0); break;
        case 8: {
          std::vector<int32_t> toks = random_tokens(pick(0, 6));
          if (!toks.empty() && pick(0, 15) == 0) toks.back() = -1;
          m.name_reserved(some, toks);
          break;
        }
        case 9: if (pick(0, 3) == 0) m.drop_cached(); break;
        case 10: m.truncate(some, m.contains(some) ? pick(-1, static_cast<int>(m.sequence(some).num_tokens)) : 1); break;
        default: {
          std::vector<int32_t> lens;
          for (const int64_t id : ids) {
            const int64_t n = m.contains(id) ? m.sequence(id).num_tokens : 1;
            lens.push_back(pick(0, 20) == 0 ? 0 : pick(1, static_cast<int>(n)));
          }
          const int32_t batch = static_cast<int32_t>(ids.size());
          build_step_metadata(m, layout, ids, lens, pick(std::max(batch, 1), 9), buffer.data());
          const int64_t n = random_count(rng, 9);
          const int64_t needed = m.blocks_needed_to_append(ids, n);
          CHECK(n >= 0 && n <= max_seq_len && needed >= 0);
          CHECK(m.can_allocate(needed) == (needed <= m.allocator().num_free()));
        }
      }
    } catch (const CacheFull&) {
      threw = true;
      ++g_full;
    } catch (const std::invalid_argument&) {
      threw = true;
      ++g_refused;
    } catch (const UnknownSequence&) {
      threw = true;
      ++g_refused;
    }
    g_done += !threw;
    if (threw) CHECK(copies.empty() && snapshot(m) == before);
    for (const BlockCopy& c : copies) CHECK(c.src != c.dst && c.dst >= 0 && c.dst < num_blocks);
    check_invariants(m);
  }
  for (const int64_t id : m.sequence_ids()) m.free_sequence(id);
  CHECK(m.allocator().num_free() == num_blocks);
  for (int32_t b = 0; b < num_blocks; ++b) CHECK(m.allocator().ref_count(b) == 0);
}

}  // namespace

int main(int argc, char** argv) {
  // argv[1]: random runs (default 400); argv[2]: operations per run (default 200).
  const int runs = argc > 1 ? std::atoi(argv[1]) : 400;
  const int ops = argc > 2 ? std::atoi(argv[2]) : 200;
  test_constructor_refuses_bad_sizes();
  test_add_append_fork_free();
  test_errors_change_nothing();
  test_step_metadata_errors();
  test_counts_at_the_boundary();
  test_truncate();
  for (int seed = 0; seed < runs; ++seed) random_run(static_cast<uint32_t>(seed), ops);
  std::printf("test_cache_manager: %d random runs x %d operations (%d done, %d cache full, %d refused), "
              "%d checks passed\n", runs, ops, g_done, g_full, g_refused, g_checks);
  CHECK(g_done > 0 && g_full > 0 && g_refused > 0);
  return 0;
}
