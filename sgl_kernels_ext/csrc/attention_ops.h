// Device-side attention ops (sparse_attention_cuda extension): stream-ordered on the current stream,
// no host synchronization, no allocation, so CUDA graphs capture them.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

namespace sparse_attention {

// Quest scores of each (request b, kv head h) row's first num_pages[b] pages (host page
// host_pages[b, j] of kmin/kmax [Hkv, pages, D], one-byte bounds: int8 levels times 2**bound_exp,
// or fp8 e4m3), the G query heads q[b, h] summed, pages [0, sink) and [n - recent, n) forced; then
// out[b, h] = the ids of the row's top K (K = out.size(2)) in no fixed order, -1 past a row holding
// fewer than K pages. scores [>= B * Hkv, >= N] float32 is scratch; counters [>= B * Hkv, 2049] int32
// (each row's histogram of its scores' top bits and its CTAs' arrival count) must be zero before the
// first launch and is zero again after each.
void fused_select(const at::Tensor& q, const at::Tensor& kmin, const at::Tensor& kmax,
                  const std::optional<at::Tensor>& bound_exp, const at::Tensor& host_pages,
                  const at::Tensor& num_pages, at::Tensor& scores, at::Tensor& counters, at::Tensor& out, int64_t sink,
                  int64_t recent);

}  // namespace sparse_attention
