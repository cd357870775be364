// CUDA launcher of peer_all_reduce_add_rms_norm (kernel: kernels/peer_all_reduce.cu), and the
// buffers it runs on: this rank's, allocated with cudaMalloc so it can be exported through a
// CUDA IPC handle, and each peer's, opened from the handle that peer sent.
#include <pybind11/pybind11.h>
#include <torch/extension.h>
#include <torch/library.h>

#include "cuda/peer_all_reduce.h"
#include "cuda/torch_utils.h"
#include "kernels/peer_all_reduce.h"
#include "kernels/peer_buffer_layout.h"
#include "peer_all_reduce_checks.h"

namespace pagedkv {

void peer_all_reduce_add_rms_norm_cuda(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight,
                                       double epsilon, at::Tensor& buffer, c10::IntArrayRef peer_buffers,
                                       int64_t rank, int64_t timeout_ms) {
  const size_t data_bytes = check_peer_all_reduce_args(input, residual, weight, epsilon, buffer,
                                                       peer_buffers, rank, timeout_ms);
  check_cuda(input, "input");
  const c10::cuda::CUDAGuard guard(input.device());
  kernels::PeerBuffers buffers{};
  for (size_t p = 0; p < peer_buffers.size(); ++p) buffers.base[p] = reinterpret_cast<char*>(peer_buffers[p]);
  const int64_t hidden = input.size(-1);
  C10_CUDA_CHECK(kernels::peer_all_reduce_add_rms_norm(
      input.data_ptr(), residual.data_ptr(), weight.const_data_ptr(), input.numel() / hidden,
      static_cast<int>(hidden), static_cast<float>(epsilon), kernel_dtype(input), buffers,
      static_cast<int>(rank), static_cast<int>(peer_buffers.size()), data_bytes,
      static_cast<uint64_t>(timeout_ms) * 1000000ull, c10::cuda::getCurrentCUDAStream()));
}

TORCH_LIBRARY_IMPL(pagedkv, CUDA, m) {
  m.impl("peer_all_reduce_add_rms_norm", &peer_all_reduce_add_rms_norm_cuda);
}

namespace {

// A fresh peer buffer of `nbytes` on `device` that other processes can open, and its IPC handle.
pybind11::tuple peer_buffer(int64_t nbytes, int64_t device) {
  TORCH_CHECK(nbytes > 0, "pagedkv: peer_buffer needs nbytes > 0, got ", nbytes);
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  void* ptr = nullptr;
  C10_CUDA_CHECK(cudaMalloc(&ptr, static_cast<size_t>(nbytes)));  // its own allocation: exportable
  // Epochs zeroed, slots empty (kernels/peer_buffer_layout.h).
  const size_t header = kernels::PeerBufferLayout::kDataOffset;
  TORCH_CHECK(static_cast<size_t>(nbytes) > header, "pagedkv: a peer buffer needs more than ", header, " bytes");
  C10_CUDA_CHECK(cudaMemset(ptr, 0, header));
  C10_CUDA_CHECK(cudaMemset(static_cast<char*>(ptr) + header, kernels::kPeerEmptyByte, nbytes - header));
  cudaIpcMemHandle_t handle;
  C10_CUDA_CHECK(cudaIpcGetMemHandle(&handle, ptr));
  C10_CUDA_CHECK(cudaDeviceSynchronize());  // zeroed before any peer can see it
  auto options = at::TensorOptions().dtype(at::kByte).device(at::kCUDA, static_cast<c10::DeviceIndex>(device));
  at::Tensor buffer = torch::from_blob(ptr, {nbytes}, [](void* p) { cudaFree(p); }, options);
  return pybind11::make_tuple(buffer, pybind11::bytes(reinterpret_cast<const char*>(&handle), sizeof(handle)));
}

// A peer's buffer of `nbytes`, opened on `device` from the handle that peer's peer_buffer gave.
at::Tensor open_peer_buffer(const pybind11::bytes& handle_bytes, int64_t nbytes, int64_t device) {
  const std::string raw = handle_bytes;
  TORCH_CHECK(raw.size() == sizeof(cudaIpcMemHandle_t), "pagedkv: an IPC handle has ",
              sizeof(cudaIpcMemHandle_t), " bytes, got ", raw.size());
  cudaIpcMemHandle_t handle;
  std::memcpy(&handle, raw.data(), sizeof(handle));
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  void* ptr = nullptr;
  C10_CUDA_CHECK(cudaIpcOpenMemHandle(&ptr, handle, cudaIpcMemLazyEnablePeerAccess));
  auto options = at::TensorOptions().dtype(at::kByte).device(at::kCUDA, static_cast<c10::DeviceIndex>(device));
  return torch::from_blob(ptr, {nbytes}, [](void* p) { cudaIpcCloseMemHandle(p); }, options);
}

}  // namespace

void register_peer_buffer_bindings(pybind11::module_& m) {
  m.def("peer_buffer", &peer_buffer, "A fresh peer buffer other processes can open: (tensor, IPC handle)");
  m.def("open_peer_buffer", &open_peer_buffer, "A peer's buffer, opened from its IPC handle");
}

}  // namespace pagedkv
