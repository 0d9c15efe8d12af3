// sample_args.h.
#include "sample_args.h"

namespace lily::gpu {

static_assert(sizeof(SampleArgs) == 48);

SampleArgs sample_args(const SamplingParams& p, int vocab, uint64_t counter) {
  p.validate(vocab);
  return SampleArgs{.vocab = vocab,
                    .top_k = p.top_k,
                    .temperature = p.temperature,
                    .top_p = p.top_p,
                    .min_p = p.min_p,
                    .repetition_penalty = p.repetition_penalty,
                    .presence_penalty = p.presence_penalty,
                    .frequency_penalty = p.frequency_penalty,
                    .seed_lo = uint32_t(p.seed),
                    .seed_hi = uint32_t(p.seed >> 32),
                    .counter_lo = uint32_t(counter),
                    .counter_hi = uint32_t(counter >> 32)};
}

}  // namespace lily::gpu
