// The CUDA backend: the schedule's ops as CUDA kernels on one NVIDIA GPU (built for sm_90a when nvcc is
// present, LILY_HAVE_CUDA). Weights are copied to the device once; activations and the GDN state are fp32,
// the KV cache bf16; prefill GEMMs run on the tensor cores (bf16 operands, fp32 accumulation, weights
// dequantised tile by tile); a decode step is captured once as a CUDA graph and replayed. A gpu::GpuBackend
// (cuda_backend.cu) over a CudaDevice (device.h). Plain C++ so the bindings include it without nvcc.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "../../schedule/backend.h"

namespace lily::cuda {

// Why the CUDA backend cannot run here (not built with CUDA, no device), or "" when it can.
std::string unavailable_reason();

// pipeline: two decode steps in flight (Backend::pipelines; false drives one step at a time, for comparisons).
std::unique_ptr<Backend> make_cuda_backend(const Model& model, int max_rows, bool pipeline = true);

// The device sampler (sample.cuh) alone, for tests (csrc/bindings/kernels_sample.cpp): for each row r of
// logits f32 [rows, vocab], `steps` selections one after another, each reading the seen uint8 / counts int32
// [rows, vocab] row and the Philox counter counters[r] as the one before left them (as a generation's decode
// steps do). tokens: int32 [rows, steps]; seen, counts and counters are updated in place; logits_after
// [rows, vocab] receives the logits as the device left them.
void sample_rows(const float* logits, uint8_t* seen, int32_t* counts, uint64_t* counters, int rows, int vocab,
                 int steps, const SamplingParams& params, int32_t* tokens, float* logits_after);

}  // namespace lily::cuda
