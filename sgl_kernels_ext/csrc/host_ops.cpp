// Host-side extension: the FlashD2H scatter pool plus pinned-memory helpers. Plain C++ (no nvcc);
// with SPARSE_WITH_CUDA it links the CUDA runtime for events, cudaHostAlloc and UVA views.
#include <torch/extension.h>

#include "flash_d2h.h"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>
#include <utility>
#include <vector>

#ifdef SPARSE_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>
#endif

namespace sparse_transfer {

// Exactly `nbytes` of page-locked host memory (torch's pinned allocator rounds up to a power of
// two, which for a 40 GiB store would pin 64 GiB), freed with cudaFreeHost with the tensor.
at::Tensor alloc_pinned(int64_t nbytes) {
  TORCH_CHECK_VALUE(nbytes > 0, "alloc_pinned: nbytes must be positive, got ", nbytes);
#ifdef SPARSE_WITH_CUDA
  void* ptr = nullptr;
  const cudaError_t err = cudaHostAlloc(&ptr, static_cast<size_t>(nbytes), cudaHostAllocPortable);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    TORCH_CHECK(false, "cudaHostAlloc(", nbytes, " bytes) failed: ", cudaGetErrorString(err));
  }
  return at::from_blob(ptr, {nbytes}, [](void* p) { (void)cudaFreeHost(p); },
                       at::TensorOptions().dtype(at::kByte).device(at::kCPU));
#else
  TORCH_CHECK(false, "alloc_pinned: this build has no CUDA");
#endif
}

// `nbytes` of page-locked host memory, faulted in by several threads and then registered with CUDA
// in one call: an anonymous mapping (transparent huge pages asked for) cut into `chunks` (offset,
// size) pairs that the caller planned (in order, covering [0, nbytes)), each zero-filled by one of
// `num_threads` threads, then one cudaHostRegister over the whole range. Faulting pages in is what
// one thread does slowly (and what cudaHostAlloc does on one thread); registering pages already
// present is fast. One registration, not one per chunk: a cudaMemcpy that spans two registrations
// fails ("invalid argument"), and callers treat the result as one pinned tensor. Its device address
// must equal its host address (unified addressing), as alloc_pinned's does; otherwise, or on any
// failure, everything is undone and the call raises. The tensor's deleter unregisters and unmaps.
at::Tensor alloc_pinned_parallel(int64_t nbytes, const std::vector<std::pair<int64_t, int64_t>>& chunks,
                                 int64_t num_threads) {
  TORCH_CHECK_VALUE(nbytes > 0, "alloc_pinned_parallel: nbytes must be positive, got ", nbytes);
  int64_t covered = 0;
  for (const auto& [offset, size] : chunks) {
    TORCH_CHECK_VALUE(offset == covered && size > 0, "alloc_pinned_parallel: chunks must tile [0, nbytes) in order");
    covered += size;
  }
  TORCH_CHECK_VALUE(covered == nbytes, "alloc_pinned_parallel: chunks cover ", covered, " of ", nbytes, " bytes");
#ifdef SPARSE_WITH_CUDA
  const auto length = static_cast<size_t>(nbytes);
  void* base = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK(base != MAP_FAILED, "alloc_pinned_parallel: mmap(", nbytes, " bytes) failed");
  (void)madvise(base, length, MADV_HUGEPAGE);  // fewer pages to fault and lock; a hint
  auto* bytes = static_cast<char*>(base);
  std::atomic<size_t> next{0};
  auto toucher = [&]() {
    for (size_t i = next++; i < chunks.size(); i = next++)
      std::memset(bytes + chunks[i].first, 0, static_cast<size_t>(chunks[i].second));
  };
  std::vector<std::thread> threads;
  for (int64_t t = 0; t < std::max<int64_t>(1, num_threads); ++t) threads.emplace_back(toucher);
  for (auto& thread : threads) thread.join();
  c10::cuda::CUDAGuard guard(c10::cuda::current_device());
  cudaError_t err = cudaHostRegister(base, length, cudaHostRegisterPortable | cudaHostRegisterMapped);
  void* dptr = nullptr;
  if (err == cudaSuccess) {
    err = cudaHostGetDevicePointer(&dptr, base, 0);
    if (err != cudaSuccess || dptr != base) (void)cudaHostUnregister(base);
  }
  if (err != cudaSuccess || dptr != base) {
    (void)cudaGetLastError();
    munmap(base, length);
    TORCH_CHECK(err == cudaSuccess, "cudaHostRegister(", nbytes, " bytes) failed: ", cudaGetErrorString(err));
    TORCH_CHECK(false, "alloc_pinned_parallel: registered memory has a device address other than its host "
                "address (no unified addressing); use alloc_pinned");
  }
  return at::from_blob(base, {nbytes}, [length](void* p) {
    (void)cudaHostUnregister(p);
    (void)cudaGetLastError();
    munmap(p, length);
  }, at::TensorOptions().dtype(at::kByte).device(at::kCPU));
#else
  TORCH_CHECK(false, "alloc_pinned_parallel: this build has no CUDA");
#endif
}

// A CUDA tensor aliasing a pinned CPU tensor through unified virtual addressing: kernels that
// read or write it move bytes over PCIe. It keeps the CPU tensor alive. Call it outside CUDA-graph
// capture (it calls cudaHostGetDevicePointer); the view itself is fine to use inside a graph.
at::Tensor cuda_view_of_host(const at::Tensor& host, int64_t device) {
  TORCH_CHECK_VALUE(host.device().is_cpu(), "cuda_view_of_host: expected a CPU tensor");
#ifdef SPARSE_WITH_CUDA
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  auto* base = static_cast<char*>(host.storage().mutable_data());
  void* dbase = nullptr;
  const cudaError_t err = cudaHostGetDevicePointer(&dbase, base, 0);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    TORCH_CHECK_VALUE(false, "tensor is not in pinned (page-locked) host memory: cudaHostGetDevicePointer: ",
                      cudaGetErrorString(err));
  }
  const auto offset = static_cast<char*>(host.data_ptr()) - base;
  return at::from_blob(static_cast<char*>(dbase) + offset, host.sizes(), host.strides(), [keep = host](void*) {},
                       host.options().device(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device))));
#else
  TORCH_CHECK(false, "cuda_view_of_host: this build has no CUDA");
#endif
}

}  // namespace sparse_transfer

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  using sparse_transfer::ScatterPool;
  using release = py::call_guard<py::gil_scoped_release>;
  py::class_<ScatterPool>(m, "ScatterPool")
      .def(py::init<int64_t, bool>(), py::arg("num_threads"), py::arg("nontemporal") = true)
      .def("submit", &ScatterPool::submit, py::arg("events"), py::arg("device"), py::arg("src"), py::arg("host"),
           py::arg("layer"), py::arg("token_slots"), py::arg("num_tokens"), release())
      .def("wait", &ScatterPool::wait, py::arg("ticket"), release())
      .def("synchronize", &ScatterPool::synchronize, release())
      .def("shutdown", &ScatterPool::shutdown, release())
      .def_property_readonly("num_threads", &ScatterPool::num_threads)
      .def_property_readonly("last_ticket", &ScatterPool::last_ticket);
  m.def("alloc_pinned", &sparse_transfer::alloc_pinned, py::arg("nbytes"));
  m.def("alloc_pinned_parallel", &sparse_transfer::alloc_pinned_parallel, py::arg("nbytes"), py::arg("chunks"),
        py::arg("num_threads"), release());
  m.def("cuda_view_of_host", &sparse_transfer::cuda_view_of_host, py::arg("host"), py::arg("device"));
#ifdef SPARSE_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
}
