// Torch-free launchers of lookup_propose and lookup_accept: the two ends of a prompt-lookup round
// of generate()'s fixed batch kept on the device (propose, verification forward, greedy tokens,
// accept), so the host only replays rounds and reads a done flag now and then. Both allocate
// nothing and never sync: they run inside CUDA graphs.
#pragma once
#include <cuda_runtime_api.h>

#include "kernels/lookup_round_rule.h"

namespace pagedkv::kernels {

// One thread block per row: the block's threads scan the row's start positions together.
cudaError_t lookup_propose(const LookupPropose& args, cudaStream_t stream);

// One thread per row (a row's work is at most width <= ~33 tokens).
cudaError_t lookup_accept(const LookupAccept& args, cudaStream_t stream);

}  // namespace pagedkv::kernels
