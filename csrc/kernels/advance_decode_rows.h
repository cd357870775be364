// Torch-free launcher of advance_decode_rows: one decode step on for a batch whose rows have all
// their cache blocks reserved up front (generate()), in one launch. In PyTorch ops the same
// update is ~15 elementwise kernels of ~1 us each, a few % of a small model's step.
#pragma once
#include <cuda_runtime_api.h>

#include "kernels/advance_decode_rows_rule.h"

namespace pagedkv::kernels {

cudaError_t advance_decode_rows(const DecodeRows& rows, cudaStream_t stream);

}  // namespace pagedkv::kernels
