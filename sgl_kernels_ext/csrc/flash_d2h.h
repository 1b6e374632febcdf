// FlashD2H, CPU half: a pool of native threads that scatters staged (token, head) rows into the
// host KV store [num_layers, num_kv_heads, num_pages, page_size, head_dim] once the device-to-host
// copy that filled the staging buffer has finished (a CUDA event, waited on by the workers).
#pragma once

#include <ATen/ATen.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

namespace sparse_transfer {

struct ScatterJob;

class ScatterPool {
 public:
  ScatterPool(int64_t num_threads, bool nontemporal);
  ~ScatterPool();
  ScatterPool(const ScatterPool&) = delete;
  ScatterPool& operator=(const ScatterPool&) = delete;

  // Queues the scatter of rows [0, num_tokens) of each src[i] ([>= num_tokens, H, D], CPU) into
  // host[i][layer] at token_slots (int64 CPU, slot = page * page_size + offset; slot < 0 skipped).
  // events[i]: a cudaEvent_t (as an integer; 0 = none) on `device` that the workers wait on before
  // reading src[i] and token_slots (one per src tensor, so K's scatter overlaps V's copy).
  // Returns a ticket; tickets grow by one per call.
  int64_t submit(std::vector<int64_t> events, int64_t device, std::vector<at::Tensor> src,
                 std::vector<at::Tensor> host, int64_t layer, at::Tensor token_slots, int64_t num_tokens);
  // Blocks until `ticket` and every earlier ticket are done; rethrows the first error among them.
  void wait(int64_t ticket);
  void synchronize();  // wait(last ticket)
  void shutdown();     // drains the queue, joins the threads; idempotent
  int64_t num_threads() const { return num_threads_; }
  int64_t last_ticket();

 private:
  struct Task {
    std::shared_ptr<ScatterJob> job;
    int64_t tensor, head, t0, t1;
  };
  void worker();
  void run(const Task& task);
  void finish(ScatterJob& job);

  const bool nontemporal_;
  int64_t num_threads_ = 0;
  std::vector<std::thread> threads_;
  std::mutex mu_, join_mu_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<Task> queue_;
  std::set<int64_t> outstanding_;
  std::map<int64_t, std::exception_ptr> errors_;
  std::vector<at::Tensor> released_;  // tensors of finished jobs, dropped by the next submit/wait
  int64_t next_ticket_ = 1;
  bool stopping_ = false;
};

}  // namespace sparse_transfer
