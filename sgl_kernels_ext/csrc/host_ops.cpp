// Host-side extension: the FlashD2H scatter pool plus pinned-memory helpers. Plain C++ (no nvcc);
// with SPARSE_WITH_CUDA it links the CUDA runtime for events, cudaHostAlloc and UVA views.
#include <torch/extension.h>

#include "flash_d2h.h"

#ifdef SPARSE_WITH_CUDA
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
  m.def("cuda_view_of_host", &sparse_transfer::cuda_view_of_host, py::arg("host"), py::arg("device"));
#ifdef SPARSE_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
}
