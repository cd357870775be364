// Whether a pointer allows 16-byte vector accesses: checked on the host by launchers and kernel
// entry points before they pick a vectorized path. Torch-free.
#pragma once
#include <cstdint>

namespace pagedkv {

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace pagedkv
