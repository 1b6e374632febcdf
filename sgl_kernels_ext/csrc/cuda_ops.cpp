// Python bindings of the device-side transfer ops, plus the per-block cudaMemcpyAsync baseline.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include "transfer_ops.h"

namespace sparse_transfer {

void copy_blocks_memcpy(const at::Tensor& src, const at::Tensor& dst, const at::Tensor& src_blocks,
                        const at::Tensor& dst_blocks, int64_t block_bytes) {
  TORCH_CHECK_VALUE(src.is_contiguous() && dst.is_contiguous(), "src/dst must be contiguous");
  TORCH_CHECK_VALUE(src_blocks.device().is_cpu() && dst_blocks.device().is_cpu() &&
                        src_blocks.scalar_type() == at::kLong && dst_blocks.scalar_type() == at::kLong &&
                        src_blocks.is_contiguous() && dst_blocks.is_contiguous() &&
                        src_blocks.numel() == dst_blocks.numel(),
                    "src_blocks/dst_blocks must be contiguous int64 CPU tensors of one length");
  TORCH_CHECK_VALUE(block_bytes > 0, "block_bytes must be positive");
  const int64_t src_n = src.numel() * src.element_size() / block_bytes;
  const int64_t dst_n = dst.numel() * dst.element_size() / block_bytes;
  const auto* s = static_cast<const char*>(src.data_ptr());
  auto* d = static_cast<char*>(dst.data_ptr());
  const int64_t* si = src_blocks.data_ptr<int64_t>();
  const int64_t* di = dst_blocks.data_ptr<int64_t>();
  TORCH_CHECK_VALUE(src.is_cuda() || dst.is_cuda(), "src or dst must be a CUDA tensor");
  const c10::cuda::CUDAGuard guard(src.is_cuda() ? src.device() : dst.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  for (int64_t i = 0; i < src_blocks.numel(); ++i) {
    TORCH_CHECK_VALUE(si[i] >= 0 && si[i] < src_n && di[i] >= 0 && di[i] < dst_n, "block index out of range at ", i);
    C10_CUDA_CHECK(cudaMemcpyAsync(d + di[i] * block_bytes, s + si[i] * block_bytes, block_bytes, cudaMemcpyDefault,
                                   stream));
  }
}

}  // namespace sparse_transfer

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("flash_h2d", &sparse_transfer::flash_h2d, py::arg("host_k"), py::arg("host_v"), py::arg("gpu_k"),
        py::arg("gpu_v"), py::arg("src_blocks"), py::arg("dst_slots"));
  m.def("direct_d2h", &sparse_transfer::direct_d2h, py::arg("k"), py::arg("v"), py::arg("host_k"), py::arg("host_v"),
        py::arg("layer"), py::arg("token_slots"), py::arg("num_ctas"));
  m.def("copy_blocks_memcpy", &sparse_transfer::copy_blocks_memcpy, py::arg("src"), py::arg("dst"),
        py::arg("src_blocks"), py::arg("dst_blocks"), py::arg("block_bytes"));
}
