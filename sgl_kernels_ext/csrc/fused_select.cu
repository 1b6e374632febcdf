// Fused select: one launch scores every page a (request, kv head) row holds from its one-byte key
// bounds (Quest, the group's query heads summed) and selects the row's top K pages, in place of the
// score kernel and FlashInfer's top-k (two launches and the gap between them at batch 1).
//
// A CTA scores 32 pages of one row (8 lanes a page, one 8- or 16-byte load of each bound per lane)
// into a float scratch row. The row's last CTA to finish (an arrival counter, threadfence
// reduction: no grid-wide wait, so no co-residency requirement and any grid size) takes the row's
// top K with a radix select: four 8-bit digit passes over the scores' order-preserving keys (held in
// shared memory up to 8192 pages a row), each a shared-memory histogram and one warp's suffix scan.
// Forced pages (sink and recent) score +inf, so they are always among the K; a row holding <= K
// pages selects them all without scoring. The K ids come out in no fixed order (the retrieve
// kernel sorts them), -1 past a row's pages, as FlashInfer's ragged top-k gives them.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Float8_e4m3fn.h>

#include <cstdint>
#include <type_traits>

#include "attention_ops.h"

namespace sparse_attention {
namespace {

constexpr int kThreads = 256;
constexpr int kPagesPerCta = 32;
constexpr int kLanesPerPage = kThreads / kPagesPerCta;  // 8 consecutive lanes of a warp
constexpr int kSmemKeys = 8192;  // a row of up to 8192 pages (256K tokens) selects from shared memory
constexpr int kUnroll = 8;       // loads in flight per thread while the keys come in

__device__ __forceinline__ uint32_t order_key(float x) {  // larger float, larger key (-inf < finite < +inf)
  const uint32_t u = __float_as_uint(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float bound_value(int8_t x) { return static_cast<float>(x); }
__device__ __forceinline__ float bound_value(c10::Float8_e4m3fn x) { return static_cast<float>(x); }

// kDims one-byte bounds in one load (8 or 16 bytes; the caller checks the alignment).
template <int kDims>
struct BoundVec {
  using Raw = typename std::conditional<kDims == 16, uint4, uint2>::type;
  union {
    Raw raw;
    uint8_t bytes[kDims];
  };
};

// The row's top k of scores[0, n) into out[0, k) (n > k), by the last CTA of the row.
__device__ void radix_top_k(const float* __restrict__ scores, int n, int k, int32_t* __restrict__ out) {
  __shared__ uint32_t keys[kSmemKeys];
  __shared__ int hist[256];
  __shared__ uint32_t s_prefix, s_mask;
  __shared__ int s_remaining, s_done, s_taken, s_ties;
  const int tid = threadIdx.x, lane = tid & 31;
  const bool in_smem = n <= kSmemKeys;
  if (in_smem) {  // kUnroll loads issued before the first store: one L2 round trip per kUnroll keys
    for (int base = tid; base < n; base += kThreads * kUnroll) {
      float x[kUnroll];
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) x[j] = base + j * kThreads < n ? __ldcg(scores + base + j * kThreads) : 0.f;
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) {
        if (base + j * kThreads < n) keys[base + j * kThreads] = order_key(x[j]);
      }
    }
  }
  if (tid == 0) {
    s_prefix = 0, s_mask = 0, s_remaining = k, s_done = 0, s_taken = 0, s_ties = 0;
  }
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = tid; i < 256; i += kThreads) hist[i] = 0;
    __syncthreads();
    const uint32_t prefix = s_prefix, mask = s_mask;
#pragma unroll 4
    for (int base = 0; base < n; base += kThreads) {  // whole warps each round: match_any below
      const int i = base + tid;
      uint32_t bin = 256;  // none
      if (i < n) {
        const uint32_t key = in_smem ? keys[i] : order_key(__ldcg(scores + i));
        if ((key & mask) == prefix) bin = (key >> shift) & 255u;
      }
      // Scores of one magnitude share their top digits: one atomic per distinct bin per warp.
      const unsigned peers = __match_any_sync(0xffffffffu, bin);
      if (bin < 256 && lane == __ffs(peers) - 1) atomicAdd(&hist[bin], __popc(peers));
    }
    __syncthreads();
    if (tid < 32) {  // warp 0: the digit holding the remaining-th largest, bins high to low
      int count[8], local = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) local += count[j] = hist[255 - (lane * 8 + j)];
      int inclusive = local;
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const int other = __shfl_up_sync(0xffffffffu, inclusive, off);
        if (lane >= off) inclusive += other;
      }
      int above = inclusive - local;
      const int remaining = s_remaining;
      if (above < remaining && inclusive >= remaining) {  // exactly one lane
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          if (above + count[j] >= remaining) {
            const uint32_t digit = 255u - static_cast<uint32_t>(lane * 8 + j);
            s_prefix = prefix | (digit << shift);
            s_mask = mask | (255u << shift);
            s_remaining = remaining - above;
            s_done = count[j] == remaining - above;  // the whole bin is taken: no need to split it
            break;
          }
          above += count[j];
        }
      }
    }
    __syncthreads();
    if (s_done) break;
  }
  // Keys above the prefix (in its digits) are in; of those equal to it, the first `remaining` to come.
  const uint32_t prefix = s_prefix, mask = s_mask;
  const int remaining = s_remaining;
  for (int i = tid; i < n; i += kThreads) {
    const uint32_t key = (in_smem ? keys[i] : order_key(__ldcg(scores + i))) & mask;
    if (key > prefix || (key == prefix && atomicAdd(&s_ties, 1) < remaining)) out[atomicAdd(&s_taken, 1)] = i;
  }
}

template <typename Q, typename Bound, int D, bool kInt8>
__global__ void __launch_bounds__(kThreads)
    fused_select_kernel(const Q* __restrict__ q, int group, const Bound* __restrict__ kmin,
                        const Bound* __restrict__ kmax, int64_t head_stride, const int8_t* __restrict__ bound_exp,
                        int64_t exp_head_stride, const int32_t* __restrict__ host_pages, int64_t host_pages_stride,
                        const int32_t* __restrict__ num_pages, int num_kv_heads, float* __restrict__ scores,
                        int64_t scores_stride, int32_t* __restrict__ arrivals, int32_t* __restrict__ out, int k,
                        int sink, int recent) {
  const int row = blockIdx.y, tile = blockIdx.x;
  const int b = row / num_kv_heads, h = row % num_kv_heads;
  const int n = num_pages[b];
  int32_t* out_row = out + static_cast<int64_t>(row) * k;
  if (n <= k) {  // every page is selected (a short request, a CUDA graph's padding row)
    if (tile == 0) {
      for (int j = threadIdx.x; j < k; j += kThreads) out_row[j] = j < n ? j : -1;
    }
    return;
  }
  const int tiles = (n + kPagesPerCta - 1) / kPagesPerCta;
  if (tile >= tiles) return;  // the grid covers the longest row of the step

  // This lane's share of its page's bounds, loaded first: they do not wait for the query.
  constexpr int kDims = D / kLanesPerPage;
  const int sub = threadIdx.x % kLanesPerPage, p = tile * kPagesPerCta + threadIdx.x / kLanesPerPage;
  BoundVec<kDims> hi, lo;
  int64_t page = 0;
  int exp = 0;
  if (p < n) {
    page = host_pages[b * host_pages_stride + p];
    const int64_t at = h * head_stride + page * D + sub * kDims;
    hi.raw = __ldg(reinterpret_cast<const typename BoundVec<kDims>::Raw*>(kmax + at));
    lo.raw = __ldg(reinterpret_cast<const typename BoundVec<kDims>::Raw*>(kmin + at));
    if constexpr (kInt8) exp = bound_exp[h * exp_head_stride + page];
  }

  // Summed over the group, q_g . c + |q_g| . r is linear in the query (as in scoring.py):
  // hi . u + lo . v with u = (qs + qa) / 2, v = (qs - qa) / 2.
  __shared__ float u_s[D], v_s[D];
  for (int d = threadIdx.x; d < D; d += kThreads) {
    float qs = 0.f, qa = 0.f;
#pragma unroll 8
    for (int g = 0; g < group; ++g) {
      const float x = static_cast<float>(q[(static_cast<int64_t>(row) * group + g) * D + d]);
      qs += x;
      qa += fabsf(x);
    }
    u_s[d] = 0.5f * (qs + qa);
    v_s[d] = 0.5f * (qs - qa);
  }
  __syncthreads();

  float acc = 0.f;
  if (p < n) {
#pragma unroll
    for (int j = 0; j < kDims; ++j) {
      const int d = sub * kDims + j;
      acc += bound_value(reinterpret_cast<const Bound&>(hi.bytes[j])) * u_s[d] +
             bound_value(reinterpret_cast<const Bound&>(lo.bytes[j])) * v_s[d];
    }
  }
#pragma unroll
  for (int off = kLanesPerPage / 2; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (sub == 0 && p < n) {
    if constexpr (kInt8) {  // levels times the page's 2**e, exactly (summaries.dequantize_bounds)
      acc *= __int_as_float((exp + 127) << 23);
    }
    if (p < sink || p >= n - recent) acc = __int_as_float(0x7f800000);  // +inf: forced
    scores[row * scores_stride + p] = acc;
  }

  __shared__ int s_last;
  __threadfence();  // this CTA's scores are visible before its arrival counts
  __syncthreads();
  if (threadIdx.x == 0) {
    s_last = atomicAdd(arrivals + row, 1) == tiles - 1;
    if (s_last) arrivals[row] = 0;  // every CTA of the row has arrived: ready for the next launch
  }
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  radix_top_k(scores + row * scores_stride, n, k, out_row);
}

template <typename Q, typename Bound, int D, bool kInt8>
void launch(const at::Tensor& q, const at::Tensor& kmin, const at::Tensor& kmax, const at::Tensor& bound_exp,
            const at::Tensor& host_pages, const at::Tensor& num_pages, at::Tensor& scores, at::Tensor& arrivals,
            at::Tensor& out, int64_t sink, int64_t recent, cudaStream_t stream) {
  const int64_t batch = q.size(0), heads = q.size(1), group = q.size(2), rows = batch * heads;
  const int64_t max_pages = host_pages.size(1), k = out.size(2);
  const dim3 grid(static_cast<unsigned>((max_pages + kPagesPerCta - 1) / kPagesPerCta), static_cast<unsigned>(rows));
  fused_select_kernel<Q, Bound, D, kInt8><<<grid, kThreads, 0, stream>>>(
      reinterpret_cast<const Q*>(q.data_ptr()), static_cast<int>(group), reinterpret_cast<const Bound*>(kmin.data_ptr()),
      reinterpret_cast<const Bound*>(kmax.data_ptr()), kmin.stride(0),
      kInt8 ? bound_exp.data_ptr<int8_t>() : nullptr, kInt8 ? bound_exp.stride(0) : 0, host_pages.data_ptr<int32_t>(),
      host_pages.stride(0), num_pages.data_ptr<int32_t>(), static_cast<int>(heads), scores.data_ptr<float>(),
      scores.stride(0), arrivals.data_ptr<int32_t>(), out.data_ptr<int32_t>(), static_cast<int>(k),
      static_cast<int>(sink), static_cast<int>(recent));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename Q, typename Bound, bool kInt8>
void dispatch_dim(int64_t dim, const at::Tensor& q, const at::Tensor& kmin, const at::Tensor& kmax,
                  const at::Tensor& bound_exp, const at::Tensor& host_pages, const at::Tensor& num_pages,
                  at::Tensor& scores, at::Tensor& arrivals, at::Tensor& out, int64_t sink, int64_t recent,
                  cudaStream_t stream) {
  if (dim == 128) {
    launch<Q, Bound, 128, kInt8>(q, kmin, kmax, bound_exp, host_pages, num_pages, scores, arrivals, out, sink, recent,
                                 stream);
  } else {
    launch<Q, Bound, 64, kInt8>(q, kmin, kmax, bound_exp, host_pages, num_pages, scores, arrivals, out, sink, recent,
                                stream);
  }
}

}  // namespace

void fused_select(const at::Tensor& q, const at::Tensor& kmin, const at::Tensor& kmax,
                  const std::optional<at::Tensor>& bound_exp, const at::Tensor& host_pages,
                  const at::Tensor& num_pages, at::Tensor& scores, at::Tensor& arrivals, at::Tensor& out, int64_t sink,
                  int64_t recent) {
  TORCH_CHECK_VALUE(q.is_cuda() && q.dim() == 4 && q.is_contiguous(), "q must be a contiguous CUDA [B, Hkv, G, D]");
  TORCH_CHECK_VALUE(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf, "q must be bf16 or fp16");
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(3);
  TORCH_CHECK_VALUE(dim == 64 || dim == 128, "head_dim must be 64 or 128, got ", dim);
  TORCH_CHECK_VALUE(kmin.dim() == 3 && kmax.sizes() == kmin.sizes() && kmin.strides() == kmax.strides() &&
                        kmin.size(0) == heads && kmin.size(2) == dim && kmin.stride(2) == 1 &&
                        kmin.stride(1) == dim && kmin.scalar_type() == kmax.scalar_type(),
                    "kmin/kmax must be [Hkv, pages, D] with contiguous (page, D) rows, got ", kmin.sizes());
  const bool int8 = kmin.scalar_type() == at::kChar;
  TORCH_CHECK_VALUE(int8 || kmin.scalar_type() == at::kFloat8_e4m3fn, "bounds must be int8 levels or fp8 e4m3, got ",
                    kmin.scalar_type());
  TORCH_CHECK_VALUE(int8 == bound_exp.has_value(), "bound_exp goes with int8 bounds, and only with them");
  const int64_t lane_bytes = dim / kLanesPerPage;
  for (auto* t : {&kmin, &kmax}) {
    TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(t->data_ptr()) % lane_bytes == 0 && t->stride(0) % lane_bytes == 0,
                      "bounds must be ", lane_bytes, "-byte aligned");
  }
  if (int8) {
    const auto& e = *bound_exp;
    TORCH_CHECK_VALUE(e.scalar_type() == at::kChar && e.dim() == 2 && e.size(0) == heads && e.stride(1) == 1 &&
                          e.size(1) >= kmin.size(1),
                      "bound_exp must be int8 [Hkv, pages]");
  }
  TORCH_CHECK_VALUE(host_pages.scalar_type() == at::kInt && host_pages.dim() == 2 && host_pages.size(0) == batch &&
                        host_pages.stride(1) == 1,
                    "host_pages must be int32 [B, N] with contiguous rows");
  TORCH_CHECK_VALUE(num_pages.scalar_type() == at::kInt && num_pages.numel() == batch && num_pages.is_contiguous(),
                    "num_pages must be int32 [B]");
  TORCH_CHECK_VALUE(scores.scalar_type() == at::kFloat && scores.dim() == 2 && scores.size(0) >= batch * heads &&
                        scores.size(1) >= host_pages.size(1) && scores.stride(1) == 1,
                    "scores must be float32 [>= B * Hkv, >= N]");
  TORCH_CHECK_VALUE(arrivals.scalar_type() == at::kInt && arrivals.numel() >= batch * heads && arrivals.is_contiguous(),
                    "arrivals must be int32 [>= B * Hkv], zero before the first launch");
  TORCH_CHECK_VALUE(out.scalar_type() == at::kInt && out.dim() == 3 && out.size(0) == batch && out.size(1) == heads &&
                        out.is_contiguous() && out.size(2) > 0,
                    "out must be contiguous int32 [B, Hkv, K]");
  TORCH_CHECK_VALUE(host_pages.size(1) <= static_cast<int64_t>(INT32_MAX) && batch * heads <= 65535,
                    "too many pages or rows for one launch");
  if (batch == 0) return;
  const c10::cuda::CUDAGuard guard(q.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor none;
  const at::Tensor& exp = int8 ? *bound_exp : none;
  if (q.scalar_type() == at::kBFloat16) {
    if (int8) {
      dispatch_dim<c10::BFloat16, int8_t, true>(dim, q, kmin, kmax, exp, host_pages, num_pages, scores, arrivals, out,
                                                sink, recent, stream);
    } else {
      dispatch_dim<c10::BFloat16, c10::Float8_e4m3fn, false>(dim, q, kmin, kmax, exp, host_pages, num_pages, scores,
                                                             arrivals, out, sink, recent, stream);
    }
  } else {
    if (int8) {
      dispatch_dim<c10::Half, int8_t, true>(dim, q, kmin, kmax, exp, host_pages, num_pages, scores, arrivals, out,
                                            sink, recent, stream);
    } else {
      dispatch_dim<c10::Half, c10::Float8_e4m3fn, false>(dim, q, kmin, kmax, exp, host_pages, num_pages, scores,
                                                         arrivals, out, sink, recent, stream);
    }
  }
}

}  // namespace sparse_attention
