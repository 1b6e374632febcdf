// FlashD2H, CPU half (see flash_d2h.h). Each submitted job is split into strips of one
// (tensor, head, token range); the worker that picks a strip first waits on the job's CUDA event
// (the D2H copy into the staging buffer), then copies each row of head_dim elements to
// host[layer, head, slot / page_size, slot % page_size, :]. Rows of one strip land in
// consecutive host addresses when the slots of a page are consecutive, so the writes stream.
#include "flash_d2h.h"

#include <atomic>
#include <cstring>
#include <stdexcept>
#include <string>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#ifdef SPARSE_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace sparse_transfer {

struct ScatterJob {
  int64_t ticket = 0, device = -1;
  std::vector<int64_t> events;  // per src tensor
  std::vector<at::Tensor> keep;  // staging, host store and slots stay alive while queued (see finish)
  std::vector<const uint8_t*> src;
  std::vector<uint8_t*> dst;  // host[i][layer], as bytes
  const int64_t* slots = nullptr;
  int64_t num_heads = 0, row_bytes = 0, slots_per_head = 0;
  bool nontemporal = false;
  std::atomic<int64_t> remaining{0};
  std::mutex mu;  // guards ready and error
  std::vector<bool> ready;  // per src tensor: its event has completed
  std::exception_ptr error;
};

namespace {

constexpr int64_t kStripBytes = 128 << 10;  // bytes one task copies (load balance vs. queue overhead)

inline void copy_row(uint8_t* dst, const uint8_t* src, int64_t n, bool nontemporal) {
#if defined(__SSE2__)
  if (nontemporal) {  // n % 16 == 0 and dst 16-byte aligned (checked per job)
    auto* d = reinterpret_cast<__m128i*>(dst);
    auto* s = reinterpret_cast<const __m128i*>(src);
    const int64_t v = n >> 4;
    int64_t i = 0;
    for (; i + 4 <= v; i += 4) {
      const __m128i a = _mm_loadu_si128(s + i), b = _mm_loadu_si128(s + i + 1);
      const __m128i c = _mm_loadu_si128(s + i + 2), e = _mm_loadu_si128(s + i + 3);
      _mm_stream_si128(d + i, a);
      _mm_stream_si128(d + i + 1, b);
      _mm_stream_si128(d + i + 2, c);
      _mm_stream_si128(d + i + 3, e);
    }
    for (; i < v; ++i) _mm_stream_si128(d + i, _mm_loadu_si128(s + i));
    return;
  }
#endif
  std::memcpy(dst, src, static_cast<size_t>(n));
}

// Waits until src[tensor] has landed in the staging buffer. Several workers may wait on one event
// at once (allowed; with a blocking-sync event they sleep).
void wait_ready(ScatterJob& job, int64_t tensor) {
  {
    std::lock_guard<std::mutex> guard(job.mu);
    if (job.ready[tensor]) return;
  }
  if (const int64_t event = job.events[tensor]) {
#ifdef SPARSE_WITH_CUDA
    int current = -1;
    cudaError_t err = cudaGetDevice(&current);
    if (err == cudaSuccess && current != job.device) err = cudaSetDevice(static_cast<int>(job.device));
    if (err == cudaSuccess) err = cudaEventSynchronize(reinterpret_cast<cudaEvent_t>(event));
    if (err != cudaSuccess)
      throw std::runtime_error(std::string("FlashD2H: waiting for the staging copy failed: ") + cudaGetErrorString(err));
#else
    throw std::runtime_error("FlashD2H: a CUDA event was given but the extension was built without CUDA");
#endif
  }
  std::lock_guard<std::mutex> guard(job.mu);
  job.ready[tensor] = true;
}

}  // namespace

ScatterPool::ScatterPool(int64_t num_threads, bool nontemporal) : nontemporal_(nontemporal) {
  TORCH_CHECK_VALUE(num_threads >= 1 && num_threads <= 256, "num_threads must be in [1, 256], got ", num_threads);
  num_threads_ = num_threads;
  threads_.reserve(num_threads);
  try {
    for (int64_t i = 0; i < num_threads; ++i) threads_.emplace_back([this] { worker(); });
  } catch (...) {
    shutdown();  // joins the threads already started
    throw;
  }
}

ScatterPool::~ScatterPool() {
  try {
    shutdown();
  } catch (...) {
  }
}

int64_t ScatterPool::submit(std::vector<int64_t> events, int64_t device, std::vector<at::Tensor> src,
                            std::vector<at::Tensor> host, int64_t layer, at::Tensor token_slots, int64_t num_tokens) {
  TORCH_CHECK_VALUE(!src.empty() && src.size() == host.size() && src.size() == events.size(),
                    "need one host tensor and one event (0 = none) per staging tensor");
  TORCH_CHECK_VALUE(num_tokens >= 0, "num_tokens must be >= 0");
  TORCH_CHECK_VALUE(token_slots.device().is_cpu() && token_slots.scalar_type() == at::kLong &&
                        token_slots.is_contiguous() && token_slots.numel() >= num_tokens,
                    "token_slots must be a contiguous int64 CPU tensor with >= num_tokens entries");
  const at::Tensor& h0 = host[0];
  TORCH_CHECK_VALUE(h0.dim() == 5, "host store must be [layers, kv_heads, pages, page_size, head_dim]");
  TORCH_CHECK_VALUE(layer >= 0 && layer < h0.size(0), "layer ", layer, " out of range [0, ", h0.size(0), ")");
  auto job = std::make_shared<ScatterJob>();
  job->events = std::move(events);
  job->ready.assign(src.size(), false);
  job->device = device;
  job->num_heads = h0.size(1);
  job->row_bytes = h0.size(4) * static_cast<int64_t>(h0.element_size());
  job->slots_per_head = h0.size(2) * h0.size(3);
  job->slots = token_slots.data_ptr<int64_t>();
  job->nontemporal = nontemporal_ && job->row_bytes % 16 == 0;
  for (size_t i = 0; i < src.size(); ++i) {
    const at::Tensor &s = src[i], &h = host[i];
    TORCH_CHECK_VALUE(h.device().is_cpu() && h.is_contiguous() && h.sizes() == h0.sizes() &&
                          h.element_size() == h0.element_size(),
                      "host tensors must be contiguous CPU tensors of one shape and element size");
    TORCH_CHECK_VALUE(s.device().is_cpu() && s.is_contiguous() && s.dim() == 3 && s.size(0) >= num_tokens &&
                          s.size(1) == job->num_heads && s.size(2) == h0.size(4) &&
                          s.element_size() == h0.element_size(),
                      "staging tensor must be a contiguous CPU [>= num_tokens, kv_heads, head_dim] tensor with the "
                      "host store's element size, got ",
                      s.sizes());
    job->src.push_back(static_cast<const uint8_t*>(s.data_ptr()));
    uint8_t* base = static_cast<uint8_t*>(h.data_ptr());
    job->dst.push_back(base + layer * job->num_heads * job->slots_per_head * job->row_bytes);
    if (reinterpret_cast<uintptr_t>(base) % 16 != 0) job->nontemporal = false;
    job->keep.push_back(s);
    job->keep.push_back(h);
  }
  job->keep.push_back(token_slots);

  const int64_t strip = std::max<int64_t>(1, kStripBytes / std::max<int64_t>(1, job->row_bytes));
  std::vector<Task> tasks;
  for (int64_t i = 0; i < static_cast<int64_t>(src.size()); ++i)
    for (int64_t h = 0; h < job->num_heads; ++h)
      for (int64_t t0 = 0; t0 < num_tokens; t0 += strip)
        tasks.push_back({job, i, h, t0, std::min(num_tokens, t0 + strip)});
  job->remaining.store(static_cast<int64_t>(tasks.size()));
  std::vector<at::Tensor> released;
  {
    std::lock_guard<std::mutex> lock(mu_);
    released.swap(released_);
    TORCH_CHECK(!stopping_, "FlashD2H scatter pool is shut down");
    job->ticket = next_ticket_++;
    if (tasks.empty()) return job->ticket;
    outstanding_.insert(job->ticket);
    for (auto& t : tasks) queue_.push_back(std::move(t));
  }
  work_cv_.notify_all();
  return job->ticket;
}

void ScatterPool::run(const Task& task) {
  ScatterJob& job = *task.job;
  {
    std::lock_guard<std::mutex> guard(job.mu);
    if (job.error) return;  // an earlier strip of this job failed: skip the rest
  }
  wait_ready(job, task.tensor);
  const int64_t heads = job.num_heads, row = job.row_bytes, limit = job.slots_per_head;
  const uint8_t* src = job.src[task.tensor];
  uint8_t* dst = job.dst[task.tensor] + task.head * limit * row;
  for (int64_t t = task.t0; t < task.t1; ++t) {
    const int64_t s = job.slots[t];
    if (s < 0) continue;  // padding token
    if (s >= limit)
      throw std::invalid_argument("FlashD2H: token_slots[" + std::to_string(t) + "] = " + std::to_string(s) +
                                  " is past the host store (pages * page_size = " + std::to_string(limit) + ")");
    copy_row(dst + s * row, src + (t * heads + task.head) * row, row, job.nontemporal);
  }
#if defined(__SSE2__)
  if (job.nontemporal) _mm_sfence();  // streaming stores visible before the job is reported done
#endif
}

void ScatterPool::worker() {
  for (;;) {
    Task task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping and drained
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    try {
      run(task);
    } catch (...) {
      std::lock_guard<std::mutex> guard(task.job->mu);
      if (!task.job->error) task.job->error = std::current_exception();
    }
    if (task.job->remaining.fetch_sub(1) == 1) finish(*task.job);
  }
}

// The job's tensors are handed to a Python thread (the next submit or wait) to drop: dropping the
// last reference of a tensor that has a Python object takes the GIL, which a worker must never wait
// for (the pool's owner may hold it while joining the workers).
void ScatterPool::finish(ScatterJob& job) {
  std::exception_ptr error;
  {
    std::lock_guard<std::mutex> guard(job.mu);
    error = job.error;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    outstanding_.erase(job.ticket);
    if (error) errors_[job.ticket] = error;
    for (auto& t : job.keep) released_.push_back(std::move(t));
    job.keep.clear();
  }
  done_cv_.notify_all();
}

void ScatterPool::wait(int64_t ticket) {
  std::vector<at::Tensor> released;  // dropped after the lock (declared first: destroyed last)
  std::unique_lock<std::mutex> lock(mu_);
  TORCH_CHECK_VALUE(ticket < next_ticket_, "FlashD2H: ticket ", ticket, " was never issued");
  done_cv_.wait(lock, [&] { return outstanding_.empty() || *outstanding_.begin() > ticket; });
  released.swap(released_);
  auto end = errors_.upper_bound(ticket);
  if (errors_.begin() == end) return;
  std::exception_ptr error = errors_.begin()->second;
  errors_.erase(errors_.begin(), end);
  std::rethrow_exception(error);
}

int64_t ScatterPool::last_ticket() {
  std::lock_guard<std::mutex> lock(mu_);
  return next_ticket_ - 1;
}

void ScatterPool::synchronize() { wait(last_ticket()); }

void ScatterPool::shutdown() {
  std::lock_guard<std::mutex> join_guard(join_mu_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : threads_) t.join();
  threads_.clear();
}

}  // namespace sparse_transfer
