// Python bindings of the device-side attention ops.
#include <torch/extension.h>

#include "attention_ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("fused_select", &sparse_attention::fused_select, py::arg("q"), py::arg("kmin"), py::arg("kmax"),
        py::arg("bound_exp"), py::arg("host_pages"), py::arg("num_pages"), py::arg("scores"), py::arg("counters"),
        py::arg("out"), py::arg("sink"), py::arg("recent"));
}
