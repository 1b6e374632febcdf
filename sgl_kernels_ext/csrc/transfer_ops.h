// Device-side transfer ops (sparse_transfer_cuda extension). Host KV store views are CUDA tensors
// aliasing pinned host memory (cuda_view_of_host in host_ops.cpp); every op is stream-ordered on
// the current stream, allocates nothing and never synchronizes with the host.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace sparse_transfer {

// FlashH2D: gpu_k/v[dst_slots[i]] = host_k/v.view(-1, page_size, head_dim)[src_blocks[i]] for every
// i with 0 <= dst_slots[i] < num_slots and 0 <= src_blocks[i] < num_host_blocks; one launch.
void flash_h2d(const at::Tensor& host_k, const at::Tensor& host_v, const at::Tensor& gpu_k, const at::Tensor& gpu_v,
               const at::Tensor& src_blocks, const at::Tensor& dst_slots);

// Direct-write save: host_k/v[layer, h, s / page_size, s % page_size] = k/v[t, h] for s = token_slots[t],
// 0 <= s < pages * page_size, written by a persistent kernel of `num_ctas` CTAs. Returns the grid size.
int64_t direct_d2h(const at::Tensor& k, const at::Tensor& v, const at::Tensor& host_k, const at::Tensor& host_v,
                   int64_t layer, const at::Tensor& token_slots, int64_t num_ctas);

// Baseline: one cudaMemcpyAsync per block (src/dst any device; indices int64 CPU tensors).
void copy_blocks_memcpy(const at::Tensor& src, const at::Tensor& dst, const at::Tensor& src_blocks,
                        const at::Tensor& dst_blocks, int64_t block_bytes);

// Shared argument checks.
// a and b: contiguous CUDA tensors with `dims` dims and one shape, element size and device.
inline void check_cuda_pair(const at::Tensor& a, const at::Tensor& b, int64_t dims, const char* what) {
  TORCH_CHECK_VALUE(a.is_cuda() && a.dim() == dims && a.is_contiguous() && b.is_contiguous() &&
                        b.sizes() == a.sizes() && b.device() == a.device() && b.element_size() == a.element_size(),
                    what, " must be contiguous CUDA tensors of one shape and element size, got ", a.sizes(), " and ",
                    b.sizes());
}

inline void check_aligned16(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name, " must be 16-byte aligned");
}

template <typename F>
void dispatch_index(const at::Tensor& t, const char* name, F&& f) {
  switch (t.scalar_type()) {
    case at::kInt:
      f(int32_t{});
      break;
    case at::kLong:
      f(int64_t{});
      break;
    default:
      TORCH_CHECK_VALUE(false, name, " must be int32 or int64, got ", t.scalar_type());
  }
}

}  // namespace sparse_transfer
