// Token selection next to the logits: penalties, temperature, top-k, top-p, min-p, a seeded counter-based
// RNG, and the logprobs of the chosen token. Runs on the host's copy of one logits row for now; the same
// parameters and order of operations are what the device sampler (metal/sample.metal) reproduces in fp32.
//
// Order of operations (vLLM / Hugging Face):
//   1. repetition_penalty (HF semantics) over every distinct token of prompt + generated:
//        l > 0 ? l / p : l · p
//   2. frequency_penalty and presence_penalty (OpenAI semantics) over the generated tokens only:
//        l -= frequency · count(t) + presence · [count(t) > 0]
//   3. temperature == 0: greedy, the first maximum of the penalised logits (steps 4-7 skipped).
//   4. temperature: l / T
//   5. top_k (> 0): keep the tokens whose logit is >= the k-th largest (ties at the boundary kept).
//   6. top_p (< 1): sort the survivors by probability (descending, ties by id), keep the shortest prefix whose
//      cumulative probability reaches top_p (a token is kept when the mass before it is < top_p).
//   7. min_p (> 0): keep the tokens whose probability is >= min_p · the largest probability (of the
//      renormalised survivors, which is the same as l >= l_max + log(min_p)).
//   8. draw u ~ U[0, 1) from the request's generator and invert the CDF of the survivors (ascending id order).
//
// Logprobs are those of the model's raw distribution (log_softmax of the unprocessed logits), like vLLM's
// default: what the model believed, not what the sampler's truncated distribution made of it.
//
// The generator: Philox4x32-10 keyed by the 64-bit seed, its counter the number of draws so far; one draw
// per sampled token, so the same seed and logits give the same tokens on every platform.
#pragma once
#include <cstdint>
#include <unordered_map>
#include <utility>
#include <vector>

namespace lily {

struct SamplingParams {
  float temperature = 1.f;  // 0: greedy
  int top_k = 0;            // 0: off
  float top_p = 1.f;        // 1: off
  float min_p = 0.f;        // 0: off
  float repetition_penalty = 1.f;
  float presence_penalty = 0.f;
  float frequency_penalty = 0.f;
  uint64_t seed = 0;
  int top_logprobs = 0;     // alternatives reported per token (the chosen token's logprob is always computed when > 0 or logprobs)
  bool logprobs = false;

  bool greedy() const { return temperature <= 0.f; }
  bool penalised() const { return repetition_penalty != 1.f || presence_penalty != 0.f || frequency_penalty != 0.f; }
  void validate(int vocab) const;  // throws std::invalid_argument naming the bad parameter
};

// Philox4x32-10 (Salmon et al., 2011): a counter-based generator; block(counter) is a pure function of
// (key, counter), so a generator's state is just its counter.
struct Philox {
  uint64_t key = 0, counter = 0;
  // A uniform double in [0, 1) with 53 random bits; advances the counter.
  double uniform();
  static void block(uint64_t key, uint64_t counter, uint32_t out[4]);
};

struct TokenChoice {
  int32_t token = -1;
  float logprob = 0.f;                          // raw log_softmax of the chosen token (when asked)
  std::vector<std::pair<int32_t, float>> top;  // top_logprobs alternatives, most likely first
};

class Sampler {
 public:
  // `context`: the tokens the repetition penalty sees before generation starts (the whole prompt).
  Sampler(const SamplingParams& p, int vocab, const int32_t* context = nullptr, int64_t n = 0);

  const SamplingParams& params() const { return p_; }
  // Penalties, temperature, filters and a draw over one logits row [vocab]; `logits` is not modified.
  TokenChoice sample(const float* logits);
  // The logprob fields of `c` for a token chosen elsewhere (the device's greedy argmax).
  void fill_logprobs(const float* logits, TokenChoice& c) const;
  // Record a generated token (penalty counts).
  void accept(int32_t token);

  // The processed distribution the draw uses (after step 7), as probabilities [vocab]; for tests.
  std::vector<float> probabilities(const float* logits) const;
  uint64_t draws() const { return rng_.counter; }
  // The penalty tables, where a device sampler starts its own copy: seen [vocab] (0/1) and the counts of
  // generated tokens.
  const std::vector<uint8_t>& seen() const { return seen_; }
  const std::unordered_map<int32_t, int32_t>& counts() const { return counts_; }

 private:
  void penalise(float* l) const;
  // Indices of the survivors of steps 4-7 and their probabilities (normalised), ascending by id.
  void filter(const float* penalised, std::vector<int32_t>& ids, std::vector<double>& probs) const;

  SamplingParams p_;
  int vocab_;
  std::vector<uint8_t> seen_;                    // prompt + generated, for the repetition penalty
  std::unordered_map<int32_t, int32_t> counts_;  // generated only
  Philox rng_;
  std::vector<float> work_;
};

}  // namespace lily
