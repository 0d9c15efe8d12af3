// The sample family (metal/sample.metal): token selection with penalties, temperature, top-k, top-p, min-p and
// the request's Philox draw, on the device — the encoder, and MetalBackend's encode_select hook. Previous hop:
// GpuBackend::select_token (backends/gpu/gpu_backend.cpp; tests: csrc/bindings/kernels_sample.cpp); next hop:
// Encoder::dispatch.
#include <algorithm>
#include <stdexcept>
#include <string>

#include "metal_backend.h"

namespace lily::metal {

void encode_sample(Encoder& enc, View logits, int vocab, const SampleArgs& args, View seen, View counts, View token) {
  if (vocab <= 0 || args.vocab != vocab)
    throw std::invalid_argument("[sample] vocab " + std::to_string(vocab) + " vs SampleArgs.vocab " +
                                std::to_string(args.vocab));
  const uint64_t V = uint64_t(vocab);
  // One threadgroup: the selection is a chain of threadgroup-wide decisions (max, digit bins, the CDF
  // crossing) that would each need a dispatch if split over threadgroups.
  // LILY_SAMPLE_THREADS, or fewer whole simdgroups where the device allows fewer (the kernel strides by its size).
  const uint32_t threads = std::min<uint32_t>(LILY_SAMPLE_THREADS, enc.max_threads(KernelId::sample_token)) /
                           LILY_SIMD_WIDTH * LILY_SIMD_WIDTH;
  if (threads == 0) throw std::invalid_argument("[sample] the device allows less than one simdgroup for sample_token");
  enc.dispatch(KernelId::sample_token, Grid{1, 1, 1}, Grid{threads, 1, 1}, args,
               {{LILY_SAMPLE_LOGITS, logits.buffer, logits.offset, Access::read, V * 4},
                {LILY_SAMPLE_SEEN, seen.buffer, seen.offset, Access::read_write, V},
                {LILY_SAMPLE_COUNTS, counts.buffer, counts.offset, Access::read_write, V * 4},
                {LILY_SAMPLE_TOKEN, token.buffer, token.offset, Access::write, 4}});
}

// ---------------------------------------------------------------- MetalBackend's token selection hook (metal_backend.h)

void MetalBackend::encode_select(View logits, View token, const SamplingParams* sample, uint64_t draws, View seen,
                                 View counts) {
  if (!sample) return encode_argmax(enc(), logits, c_.vocab, token);
  encode_sample(enc(), logits, c_.vocab, sample_args(*sample, c_.vocab, draws), seen, counts, token);
}

}  // namespace lily::metal
