// Shared between the stand-in's two sources: device memory is host memory, so any device tensor has a zero-copy
// CPU alias.
#pragma once
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

namespace standin {

// A CPU tensor over the same memory as `tensor` (itself if it already is on the CPU). `tensor` must outlive it.
at::Tensor host_alias(const at::Tensor& tensor);

// Adds the `neuron` process-group backend's bindings to the extension module.
void bind_distributed(pybind11::module& m);

}  // namespace standin
