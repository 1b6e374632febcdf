// FlashH2D: one kernel launch loads a list of (layer, head, page) KV blocks from pinned host memory
// into GPU page-cache slots by dereferencing host memory through UVA (SparseServe §3.2.1, Spin §5.5).
// One warp copies one block (K and V blocks are separate work items of the same launch); each lane
// keeps kUnroll 16-byte loads in flight. Padding entries (dst_slot < 0) are skipped, so a CUDA graph
// can capture the launch with a fixed-length miss list.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include "transfer_ops.h"

namespace sparse_transfer {
namespace {

constexpr int kWarps = 8;   // warps per CTA
constexpr int kUnroll = 8;  // 16-byte loads in flight per lane: one warp moves 4 KiB per round trip

template <typename SrcIdx, typename DstIdx>
__global__ void __launch_bounds__(kWarps * 32)
    flash_h2d_kernel(const int4* __restrict__ host_k, const int4* __restrict__ host_v, int4* __restrict__ gpu_k,
                     int4* __restrict__ gpu_v, const SrcIdx* __restrict__ src_blocks,
                     const DstIdx* __restrict__ dst_slots, int64_t n, int block_vecs, int64_t num_host_blocks,
                     int64_t num_slots) {
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (item >= 2 * n) return;
  const bool is_v = item >= n;  // items [0, n) copy K, [n, 2n) copy V
  const int64_t i = is_v ? item - n : item;
  const int64_t dst = static_cast<int64_t>(dst_slots[i]);
  const int64_t src = static_cast<int64_t>(src_blocks[i]);
  if (dst < 0 || dst >= num_slots || src < 0 || src >= num_host_blocks) return;  // padding / invalid
  const int4* s = (is_v ? host_v : host_k) + src * block_vecs;
  int4* d = (is_v ? gpu_v : gpu_k) + dst * block_vecs;
  const int lane = threadIdx.x & 31;
  int base = 0;
  // Whole rounds of 32 * kUnroll vectors (4 KiB) carry no predicates: with eight per-load
  // predicates ptxas (7 predicate registers) moved two loads behind the first store's wait.
  for (; base + 32 * kUnroll <= block_vecs; base += 32 * kUnroll) {
    int4 r[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) r[u] = __ldg(s + base + u * 32 + lane);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) d[base + u * 32 + lane] = r[u];
  }
  if (base < block_vecs) {  // tail of a block that is not a multiple of 4 KiB
    int4 r[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int j = base + u * 32 + lane;
      if (j < block_vecs) r[u] = __ldg(s + j);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int j = base + u * 32 + lane;
      if (j < block_vecs) d[j] = r[u];
    }
  }
}

}  // namespace

void flash_h2d(const at::Tensor& host_k, const at::Tensor& host_v, const at::Tensor& gpu_k, const at::Tensor& gpu_v,
               const at::Tensor& src_blocks, const at::Tensor& dst_slots) {
  check_cuda_pair(gpu_k, gpu_v, 3, "gpu_k/gpu_v [num_slots, page_size, head_dim]");
  check_cuda_pair(host_k, host_v, 5, "host_k/host_v (UVA views) [layers, kv_heads, pages, page_size, head_dim]");
  TORCH_CHECK_VALUE(host_k.size(3) == gpu_k.size(1) && host_k.size(4) == gpu_k.size(2),
                    "host and GPU blocks differ: ", host_k.sizes(), " vs ", gpu_k.sizes());
  const int64_t esize = gpu_k.element_size();
  TORCH_CHECK_VALUE(host_k.element_size() == esize, "host and GPU tensors must have one element size");
  const int64_t block_bytes = gpu_k.size(1) * gpu_k.size(2) * esize;
  TORCH_CHECK_VALUE(block_bytes % 16 == 0 && block_bytes / 16 <= INT32_MAX,
                    "block bytes (page_size * head_dim * element size) must be a multiple of 16, got ", block_bytes);
  for (auto* t : {&host_k, &host_v, &gpu_k, &gpu_v}) check_aligned16(*t, "KV tensor data");
  TORCH_CHECK_VALUE(src_blocks.is_cuda() && dst_slots.is_cuda() && src_blocks.device() == gpu_k.device() &&
                        dst_slots.device() == gpu_k.device() && src_blocks.is_contiguous() &&
                        dst_slots.is_contiguous() && src_blocks.numel() == dst_slots.numel(),
                    "src_blocks/dst_slots must be contiguous tensors of one length on the GPU cache's device");
  const int64_t n = src_blocks.numel();
  if (n == 0 || gpu_k.numel() == 0) return;
  const int block_vecs = static_cast<int>(block_bytes / 16);
  const int64_t num_host_blocks = host_k.numel() * esize / block_bytes;
  const int64_t grid = (2 * n + kWarps - 1) / kWarps;
  TORCH_CHECK_VALUE(grid <= INT32_MAX, "too many blocks in one FlashH2D call: ", n);

  const c10::cuda::CUDAGuard guard(gpu_k.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_index(src_blocks, "src_blocks", [&](auto src_t) {
    dispatch_index(dst_slots, "dst_slots", [&](auto dst_t) {
      using S = decltype(src_t);
      using D = decltype(dst_t);
      flash_h2d_kernel<S, D><<<static_cast<unsigned>(grid), kWarps * 32, 0, stream>>>(
          static_cast<const int4*>(host_k.data_ptr()), static_cast<const int4*>(host_v.data_ptr()),
          static_cast<int4*>(gpu_k.data_ptr()), static_cast<int4*>(gpu_v.data_ptr()), src_blocks.data_ptr<S>(),
          dst_slots.data_ptr<D>(), n, block_vecs, num_host_blocks, gpu_k.size(0));
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace sparse_transfer
