// SampleArgs (metal/lily_args.h) from a request's SamplingParams: what every device sampler (metal/sample.metal,
// backends/cuda/sample.cuh) reads, filled in one place for the Metal encoder, the CUDA backend and their tests.
#pragma once
#include <cstdint>

#include "../../core/sampling.h"
#include "lily_args.h"

namespace lily::gpu {

// SampleArgs for one step of a request: its SamplingParams (validated) and the Philox counter = the draws so
// far (sampling.h: one draw per non-greedy token, so the counter of step n is the number of earlier
// non-greedy steps).
SampleArgs sample_args(const SamplingParams& p, int vocab, uint64_t counter);

}  // namespace lily::gpu
