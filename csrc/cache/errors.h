// The cache manager's failures, as std exceptions so the core stays torch- and pybind-free.
// The bindings turn CacheFull into pagedkv.CacheFull (a RuntimeError: it can succeed later, once
// other sequences free blocks), UnknownSequence into KeyError, std::invalid_argument into
// ValueError (the call can never succeed as made).
#pragma once
#include <stdexcept>
#include <string>

namespace pagedkv {

struct CacheFull : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct UnknownSequence : std::out_of_range {
  explicit UnknownSequence(long long seq_id)
      : std::out_of_range("pagedkv: sequence " + std::to_string(seq_id) +
                          " is not in the cache (never added, or already freed)") {}
};

}  // namespace pagedkv
