// Direct-write save (the alternative to FlashD2H's staged copy + CPU scatter): a persistent kernel
// writes each (token, head) row of the new K/V straight into pinned host memory through UVA. It
// competes with the model for SMs (SparseServe §3.2.2 measured 1.28x prefill time), so its grid is
// explicit: `num_ctas` CTAs, at most one per SM, is what the benchmark reports as SMs taken.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include "transfer_ops.h"

namespace sparse_transfer {
namespace {

constexpr int kWarps = 8;        // warps per CTA
constexpr int kUnroll = 4;       // 16-byte loads in flight per lane
constexpr int kStripTokens = 32;  // tokens of one (tensor, head) a warp writes as one work item

// Work item = (tensor, head, strip of kStripTokens tokens): the warp's stores walk consecutive host
// addresses while the tokens' slots are consecutive within a page. (__launch_bounds__ minBlocks 1:
// without it ptxas held the kernel to 48 registers and spilled.)
template <typename SlotIdx>
__global__ void __launch_bounds__(kWarps * 32, 1)
    direct_d2h_kernel(const int4* __restrict__ k, const int4* __restrict__ v, int4* __restrict__ host_k,
                      int4* __restrict__ host_v, const SlotIdx* __restrict__ slots, int64_t num_tokens, int num_heads,
                      int row_vecs, int64_t layer_rows, int64_t slots_per_head) {
  const int lane = threadIdx.x & 31;
  const int strips = static_cast<int>((num_tokens + kStripTokens - 1) / kStripTokens);
  const int items = 2 * num_heads * strips;  // < 2^30, checked by the host
  for (int item = blockIdx.x * kWarps + (threadIdx.x >> 5); item < items; item += gridDim.x * kWarps) {
    const int tensor_head = item / strips;  // [0, 2 * num_heads)
    const int64_t t0 = static_cast<int64_t>(item - tensor_head * strips) * kStripTokens;
    const bool is_v = tensor_head >= num_heads;
    const int head = is_v ? tensor_head - num_heads : tensor_head;
    const int nvec = static_cast<int>(num_tokens - t0 < kStripTokens ? num_tokens - t0 : kStripTokens) * row_vecs;
    const int4* src = is_v ? v : k;
    int4* dst = (is_v ? host_v : host_k) + (layer_rows + head * slots_per_head) * row_vecs;
    for (int base = 0; base < nvec; base += 32 * kUnroll) {
      int4 r[kUnroll];
      int64_t off[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int j = base + u * 32 + lane;
        off[u] = -1;
        if (j < nvec) {
          const int tt = j / row_vecs, c = j - tt * row_vecs;
          const int64_t t = t0 + tt;
          const int64_t s = static_cast<int64_t>(slots[t]);
          if (s >= 0 && s < slots_per_head) {
            r[u] = src[(t * num_heads + head) * row_vecs + c];
            off[u] = s * row_vecs + c;
          }
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (off[u] >= 0) dst[off[u]] = r[u];
    }
  }
}

}  // namespace

int64_t direct_d2h(const at::Tensor& k, const at::Tensor& v, const at::Tensor& host_k, const at::Tensor& host_v,
                   int64_t layer, const at::Tensor& token_slots, int64_t num_ctas) {
  check_cuda_pair(host_k, host_v, 5, "host_k/host_v (UVA views) [layers, kv_heads, pages, page_size, head_dim]");
  check_cuda_pair(k, v, 3, "k/v [num_tokens, kv_heads, head_dim]");
  TORCH_CHECK_VALUE(k.size(1) == host_k.size(1) && k.size(2) == host_k.size(4),
                    "k/v heads/head_dim differ from the host store: ", k.sizes(), " vs ", host_k.sizes());
  const int64_t esize = k.element_size();
  TORCH_CHECK_VALUE(host_k.element_size() == esize, "k/v and host store must have one element size");
  const int64_t row_bytes = k.size(2) * esize;
  TORCH_CHECK_VALUE(row_bytes % 16 == 0, "head_dim * element size must be a multiple of 16, got ", row_bytes);
  for (auto* t : {&k, &v, &host_k, &host_v}) check_aligned16(*t, "KV tensor data");
  TORCH_CHECK_VALUE(layer >= 0 && layer < host_k.size(0), "layer ", layer, " out of range [0, ", host_k.size(0), ")");
  TORCH_CHECK_VALUE(token_slots.is_cuda() && token_slots.device() == k.device() && token_slots.is_contiguous() &&
                        token_slots.numel() == k.size(0),
                    "token_slots must be a contiguous CUDA tensor with one entry per token");
  TORCH_CHECK_VALUE(num_ctas >= 1, "num_ctas must be >= 1");
  const int64_t num_tokens = k.size(0), heads = k.size(1);
  if (num_tokens == 0) return 0;
  const int64_t slots_per_head = host_k.size(2) * host_k.size(3);
  const int64_t items = 2 * heads * ((num_tokens + kStripTokens - 1) / kStripTokens);
  TORCH_CHECK_VALUE(items < (int64_t{1} << 30), "too many tokens in one direct_d2h call: ", num_tokens);
  const int64_t grid = std::min<int64_t>(num_ctas, (items + kWarps - 1) / kWarps);

  const c10::cuda::CUDAGuard guard(k.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_index(token_slots, "token_slots", [&](auto slot_t) {
    using S = decltype(slot_t);
    direct_d2h_kernel<S><<<static_cast<unsigned>(grid), kWarps * 32, 0, stream>>>(
        static_cast<const int4*>(k.data_ptr()), static_cast<const int4*>(v.data_ptr()),
        static_cast<int4*>(host_k.data_ptr()), static_cast<int4*>(host_v.data_ptr()), token_slots.data_ptr<S>(),
        num_tokens, static_cast<int>(heads), static_cast<int>(row_bytes / 16), layer * heads * slots_per_head,
        slots_per_head);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return grid;
}

}  // namespace sparse_transfer
