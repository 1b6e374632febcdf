// Fused select: one launch scores every page a (request, kv head) row holds from its one-byte key
// bounds (Quest, the group's query heads summed) and selects the row's top K pages, in place of the
// score kernel and FlashInfer's top-k (two launches and the gap between them at batch 1).
//
// A CTA scores 32 pages of one row (8 lanes a page, one 8- or 16-byte load of each bound per lane)
// into a float scratch row, and counts each score in the row's histogram of the top 11 bits of the
// scores' order-preserving keys (2048 bins in global memory, atomics in L2). The row's last CTA to
// finish (an arrival counter, threadfence reduction: no grid-wide wait, so no co-residency
// requirement and any grid size) scans that histogram for the bin holding the K-th largest, reads
// the row's scores once (those above the bin are in; the bin's own are kept in shared memory) and
// splits the bin by three 7-bit radix passes over its few keys. The selection is thus spread over
// the scoring CTAs but for the boundary bin; one CTA making every pass over the whole row (dropped
// before, 535a843) cost more than FlashInfer's top-k. Forced pages (sink and recent) score +inf,
// so they are always among the K; a row holding <= K pages selects them all without scoring. The
// K ids come out in no fixed order (the retrieve kernel sorts them), -1 past a row's pages, as
// FlashInfer's ragged top-k gives them.
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
constexpr int kTopBits = 11;                            // the scoring CTAs' histogram: a key's top bits
constexpr int kTopBins = 1 << kTopBits;                 // 2048 bins a row
constexpr int kRowCounters = kTopBins + 1;              // a row's histogram and its CTAs' arrival count
constexpr int kLowBits = 32 - kTopBits;                 // split by the last CTA: 3 passes of 7 bits
constexpr int kDigitBits = 7;
constexpr int kMaxCandidates = 1024;  // boundary-bin keys the last CTA keeps in shared memory
constexpr int kUnroll = 8;            // score loads in flight per thread in the last CTA's pass

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

// Radix passes (7-bit digits, bits kLowBits-1 down to 0) over keys key_at(0..count) with
// (key & mask) == prefix (the others take no part): emit(i) for the `remaining` largest of them.
template <typename KeyAt, typename Emit>
__device__ void split_bin(int count, KeyAt key_at, uint32_t prefix, uint32_t mask, int remaining, Emit emit) {
  constexpr int kBins = 1 << kDigitBits, kPerLane = kBins / 32;
  __shared__ int hist[kBins];
  __shared__ uint32_t s_prefix, s_mask;
  __shared__ int s_remaining, s_done, s_ties;
  const int tid = threadIdx.x, lane = tid & 31;
  if (tid == 0) s_prefix = prefix, s_mask = mask, s_remaining = remaining, s_done = 0, s_ties = 0;
  for (int shift = kLowBits - kDigitBits; shift >= 0; shift -= kDigitBits) {
    for (int i = tid; i < kBins; i += kThreads) hist[i] = 0;
    __syncthreads();
    const uint32_t p = s_prefix, m = s_mask;
    for (int i = tid; i < count; i += kThreads) {
      const uint32_t key = key_at(i);
      if ((key & m) == p) atomicAdd(&hist[(key >> shift) & (kBins - 1)], 1);
    }
    __syncthreads();
    if (tid < 32) {  // warp 0: the digit holding the remaining-th largest, digits high to low
      int c[kPerLane], local = 0;
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) local += c[j] = hist[kBins - 1 - (lane * kPerLane + j)];
      int inclusive = local;
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const int other = __shfl_up_sync(0xffffffffu, inclusive, off);
        if (lane >= off) inclusive += other;
      }
      int above = inclusive - local;
      const int rem = s_remaining;
      if (above < rem && inclusive >= rem) {  // exactly one lane
#pragma unroll
        for (int j = 0; j < kPerLane; ++j) {
          if (above + c[j] >= rem) {
            const uint32_t digit = kBins - 1 - static_cast<uint32_t>(lane * kPerLane + j);
            s_prefix = p | (digit << shift);
            s_mask = m | (static_cast<uint32_t>(kBins - 1) << shift);
            s_remaining = rem - above;
            s_done = c[j] == rem - above;  // the whole digit is taken: no need to split it
            break;
          }
          above += c[j];
        }
      }
    }
    __syncthreads();
    if (s_done) break;
  }
  // Keys above the prefix (in its digits) are in; of those equal to it, the first `rem` to come.
  const uint32_t p = s_prefix, m = s_mask;
  const int rem = s_remaining;
  for (int i = tid; i < count; i += kThreads) {
    const uint32_t key = key_at(i);
    if ((key & mask) != prefix) continue;
    if ((key & m) > p || ((key & m) == p && atomicAdd(&s_ties, 1) < rem)) emit(i);
  }
}

// The row's top k of scores[0, n) into out[0, k) (n > k), by the last CTA of the row, from the
// row's histogram of the keys' top bits (which it leaves zero for the next launch).
__device__ void select_top_k(const float* __restrict__ scores, int* __restrict__ row_hist, int n, int k,
                             int32_t* __restrict__ out) {
  constexpr int kBinsPerThread = kTopBins / kThreads;  // 8, bins high to low: thread 0 holds the highest
  __shared__ uint32_t cand_keys[kMaxCandidates];
  __shared__ int32_t cand_ids[kMaxCandidates];
  __shared__ int warp_sums[kThreads / 32];
  __shared__ int s_bin, s_above, s_taken, s_cands;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int count[kBinsPerThread], local = 0;
#pragma unroll
  for (int j = 0; j < kBinsPerThread; ++j) local += count[j] = __ldcg(row_hist + kTopBins - 1 - (tid * kBinsPerThread + j));
#pragma unroll
  for (int j = 0; j < kBinsPerThread; ++j) row_hist[kTopBins - 1 - (tid * kBinsPerThread + j)] = 0;
  int inclusive = local;  // a block-wide scan of the threads' counts, in thread order
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int other = __shfl_up_sync(0xffffffffu, inclusive, off);
    if (lane >= off) inclusive += other;
  }
  if (lane == 31) warp_sums[warp] = inclusive;
  if (tid == 0) s_taken = 0, s_cands = 0;
  __syncthreads();
  int above = inclusive - local;
  for (int w = 0; w < warp; ++w) above += warp_sums[w];
  if (above < k && above + local >= k) {  // exactly one thread: its bins hold the k-th largest
#pragma unroll
    for (int j = 0; j < kBinsPerThread; ++j) {
      if (above + count[j] >= k) {
        s_bin = kTopBins - 1 - (tid * kBinsPerThread + j);
        s_above = above;
        break;
      }
      above += count[j];
    }
  }
  __syncthreads();
  const uint32_t bin = s_bin;
  const int remaining = k - s_above;
  // One pass over the row: keys above the bin are in, the bin's own are candidates.
  for (int base = tid; base < n; base += kThreads * kUnroll) {
    float x[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) x[j] = base + j * kThreads < n ? __ldcg(scores + base + j * kThreads) : 0.f;
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int i = base + j * kThreads;
      if (i >= n) break;
      const uint32_t key = order_key(x[j]), top = key >> kLowBits;
      if (top > bin) {
        out[atomicAdd(&s_taken, 1)] = i;
      } else if (top == bin) {
        const int c = atomicAdd(&s_cands, 1);
        if (c < kMaxCandidates) cand_keys[c] = key, cand_ids[c] = i;
      }
    }
  }
  __syncthreads();
  const int cands = s_cands;
  const uint32_t prefix = bin << kLowBits, mask = ~0u << kLowBits;
  if (cands == remaining) {  // the whole bin is in
    for (int c = tid; c < cands; c += kThreads) out[atomicAdd(&s_taken, 1)] = cand_ids[c];
  } else if (cands <= kMaxCandidates) {
    split_bin(cands, [](int c) { return cand_keys[c]; }, prefix, mask, remaining,
              [out](int c) { out[atomicAdd(&s_taken, 1)] = cand_ids[c]; });
  } else {  // more keys share the bin than shared memory holds (near-equal scores): split it in L2
    split_bin(n, [scores](int i) { return order_key(__ldcg(scores + i)); }, prefix, mask, remaining,
              [out](int i) { out[atomicAdd(&s_taken, 1)] = i; });
  }
}

template <typename Q, typename Bound, int D, bool kInt8>
__global__ void __launch_bounds__(kThreads)
    fused_select_kernel(const Q* __restrict__ q, int group, const Bound* __restrict__ kmin,
                        const Bound* __restrict__ kmax, int64_t head_stride, const int8_t* __restrict__ bound_exp,
                        int64_t exp_head_stride, const int32_t* __restrict__ host_pages, int64_t host_pages_stride,
                        const int32_t* __restrict__ num_pages, int num_kv_heads, float* __restrict__ scores,
                        int64_t scores_stride, int32_t* __restrict__ counters, int32_t* __restrict__ out, int k,
                        int sink, int recent) {
  const int row = blockIdx.y, tile = blockIdx.x;
  const int b = row / num_kv_heads, h = row % num_kv_heads;
  const int n = num_pages[b];
  int32_t* out_row = out + static_cast<int64_t>(row) * k;
  int32_t* row_hist = counters + static_cast<int64_t>(row) * kRowCounters;  // then the arrival counter
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
    atomicAdd(row_hist + (order_key(acc) >> kLowBits), 1);
  }

  __shared__ int s_last;
  __threadfence();  // this CTA's scores and histogram counts are visible before its arrival counts
  __syncthreads();
  if (threadIdx.x == 0) {
    s_last = atomicAdd(row_hist + kTopBins, 1) == tiles - 1;
    if (s_last) row_hist[kTopBins] = 0;  // every CTA of the row has arrived: ready for the next launch
  }
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  select_top_k(scores + row * scores_stride, row_hist, n, k, out_row);
}

template <typename Q, typename Bound, int D, bool kInt8>
void launch(const at::Tensor& q, const at::Tensor& kmin, const at::Tensor& kmax, const at::Tensor& bound_exp,
            const at::Tensor& host_pages, const at::Tensor& num_pages, at::Tensor& scores, at::Tensor& counters,
            at::Tensor& out, int64_t sink, int64_t recent, cudaStream_t stream) {
  const int64_t batch = q.size(0), heads = q.size(1), group = q.size(2), rows = batch * heads;
  const int64_t max_pages = host_pages.size(1), k = out.size(2);
  const dim3 grid(static_cast<unsigned>((max_pages + kPagesPerCta - 1) / kPagesPerCta), static_cast<unsigned>(rows));
  fused_select_kernel<Q, Bound, D, kInt8><<<grid, kThreads, 0, stream>>>(
      reinterpret_cast<const Q*>(q.data_ptr()), static_cast<int>(group), reinterpret_cast<const Bound*>(kmin.data_ptr()),
      reinterpret_cast<const Bound*>(kmax.data_ptr()), kmin.stride(0),
      kInt8 ? bound_exp.data_ptr<int8_t>() : nullptr, kInt8 ? bound_exp.stride(0) : 0, host_pages.data_ptr<int32_t>(),
      host_pages.stride(0), num_pages.data_ptr<int32_t>(), static_cast<int>(heads), scores.data_ptr<float>(),
      scores.stride(0), counters.data_ptr<int32_t>(), out.data_ptr<int32_t>(), static_cast<int>(k),
      static_cast<int>(sink), static_cast<int>(recent));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename Q, typename Bound, bool kInt8>
void dispatch_dim(int64_t dim, const at::Tensor& q, const at::Tensor& kmin, const at::Tensor& kmax,
                  const at::Tensor& bound_exp, const at::Tensor& host_pages, const at::Tensor& num_pages,
                  at::Tensor& scores, at::Tensor& counters, at::Tensor& out, int64_t sink, int64_t recent,
                  cudaStream_t stream) {
  if (dim == 128) {
    launch<Q, Bound, 128, kInt8>(q, kmin, kmax, bound_exp, host_pages, num_pages, scores, counters, out, sink, recent,
                                 stream);
  } else {
    launch<Q, Bound, 64, kInt8>(q, kmin, kmax, bound_exp, host_pages, num_pages, scores, counters, out, sink, recent,
                                stream);
  }
}

}  // namespace

void fused_select(const at::Tensor& q, const at::Tensor& kmin, const at::Tensor& kmax,
                  const std::optional<at::Tensor>& bound_exp, const at::Tensor& host_pages,
                  const at::Tensor& num_pages, at::Tensor& scores, at::Tensor& counters, at::Tensor& out, int64_t sink,
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
  TORCH_CHECK_VALUE(counters.scalar_type() == at::kInt && counters.dim() == 2 && counters.size(0) >= batch * heads &&
                        counters.size(1) == kRowCounters && counters.is_contiguous(),
                    "counters must be contiguous int32 [>= B * Hkv, ", kRowCounters, "], zero before the first launch");
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
      dispatch_dim<c10::BFloat16, int8_t, true>(dim, q, kmin, kmax, exp, host_pages, num_pages, scores, counters, out,
                                                sink, recent, stream);
    } else {
      dispatch_dim<c10::BFloat16, c10::Float8_e4m3fn, false>(dim, q, kmin, kmax, exp, host_pages, num_pages, scores,
                                                             counters, out, sink, recent, stream);
    }
  } else {
    if (int8) {
      dispatch_dim<c10::Half, int8_t, true>(dim, q, kmin, kmax, exp, host_pages, num_pages, scores, counters, out,
                                            sink, recent, stream);
    } else {
      dispatch_dim<c10::Half, c10::Float8_e4m3fn, false>(dim, q, kmin, kmax, exp, host_pages, num_pages, scores,
                                                         counters, out, sink, recent, stream);
    }
  }
}

}  // namespace sparse_attention
