// What the CPU and CUDA samplers must compute identically, so the same (seed, offset) draws the
// same token on both: the order key of a logit, the counter-based uniform, the fixed-point token
// weights and the inverse-CDF target. Plain C++ that nvcc and the host compiler both take.
#pragma once
#include <cstdint>
#include <cstring>

#include "kernels/host_device.h"

namespace pagedkv::sampling {

// Token weights are exp((logit - max) / T) <= 1 times 2^40, truncated to integers: their sums are
// exact and independent of summation order (deterministic selection and draw), and fit in 64 bits
// for vocab < 2^23. A token below 2^-40 of the top token's probability gets weight 0.
constexpr float kWeightScale = 1099511627776.0f;  // 2^40

PAGEDKV_HD uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return bits;
#endif
}

// An unsigned key with the order of torch.argmax over floats: NaN above everything, -0 == +0.
PAGEDKV_HD uint32_t order_key(float x) {
  uint32_t bits = float_bits(x);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0xffffffffu;
  if (bits == 0x80000000u) bits = 0;
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

constexpr uint32_t kKeyNegInf = 0x007fffffu;  // order_key(-inf)
constexpr uint32_t kKeyPosInf = 0xff800000u;  // order_key(+inf)
constexpr uint32_t kKeyNaN = 0xffffffffu;

// Whether a row whose largest order key is max_key has a distribution to sample: its max is
// finite. A NaN anywhere is the max; an inf max or a row of -inf has no softmax either (HF's
// multinomial raises for them), so a sampled row gets the invalid token -1 instead.
PAGEDKV_HD bool drawable(uint32_t max_key) { return max_key > kKeyNegInf && max_key < kKeyPosInf; }
constexpr int64_t kInvalidToken = -1;

// splitmix64's finalizer: a bijection of 64-bit words with full avalanche.
PAGEDKV_HD uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// The uniform in [0, 1) (53 bits) that a row with this seed draws at this offset. It depends on
// nothing else (not the row's batch slot), and touches no generator state.
PAGEDKV_HD double uniform(int64_t seed, int64_t offset) {
  const uint64_t stream = mix64(static_cast<uint64_t>(seed) ^ 0x5851f42d4c957f2dull);
  const uint64_t h = mix64(stream + static_cast<uint64_t>(offset) * 0x9e3779b97f4a7c15ull);
  return static_cast<double>(h >> 11) * 0x1p-53;
}

// The inverse-CDF target in [0, total): the token drawn is the first whose running weight
// (in index order, over the kept tokens) exceeds it.
PAGEDKV_HD uint64_t draw_target(uint64_t total, double u) {
  const uint64_t t = static_cast<uint64_t>(static_cast<double>(total) * u);
  return t < total ? t : total - 1;
}

// top-p keeps the tokens above the largest threshold whose cumulative weight reaches this.
PAGEDKV_HD double top_p_target(float top_p, uint64_t total) {
  const double t = static_cast<double>(top_p) * static_cast<double>(total);
  return t > 1.0 ? t : 1.0;  // top_p <= 0 keeps the top token(s)
}

}  // namespace pagedkv::sampling
