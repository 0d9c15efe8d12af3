// The CUDA backend: the schedule's ops as CUDA kernels on one NVIDIA GPU (built for sm_90a when nvcc is
// present, LILY_HAVE_CUDA). Weights are copied to the device once; activations and the GDN state are fp32,
// the KV cache bf16; prefill GEMMs run on the tensor cores (bf16 operands, fp32 accumulation, weights
// dequantised tile by tile); a decode step is captured once as a CUDA graph and replayed.
// Plain C++ so the bindings include it without nvcc.
#pragma once
#include <memory>
#include <string>

#include "../../schedule/backend.h"

namespace lily::cuda {

// Why the CUDA backend cannot run here (not built with CUDA, no device), or "" when it can.
std::string unavailable_reason();

std::unique_ptr<Backend> make_cuda_backend(const Model& model, int max_rows);

}  // namespace lily::cuda
