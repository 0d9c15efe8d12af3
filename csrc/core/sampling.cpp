// Sampling (sampling.h): the order of operations and the semantics of each parameter are documented there.
#include "sampling.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>

namespace lily {

void SamplingParams::validate(int vocab) const {
  auto bad = [](const std::string& what) { throw std::invalid_argument("[sampling] " + what); };
  if (!(temperature >= 0.f) || !std::isfinite(temperature)) bad("temperature must be a finite number >= 0, got " + std::to_string(temperature));
  if (top_k < 0) bad("top_k must be >= 0 (0 disables it), got " + std::to_string(top_k));
  if (!(top_p > 0.f && top_p <= 1.f)) bad("top_p must be in (0, 1], got " + std::to_string(top_p));
  if (!(min_p >= 0.f && min_p <= 1.f)) bad("min_p must be in [0, 1], got " + std::to_string(min_p));
  if (!(repetition_penalty > 0.f) || !std::isfinite(repetition_penalty))
    bad("repetition_penalty must be > 0 (1 disables it), got " + std::to_string(repetition_penalty));
  if (!std::isfinite(presence_penalty) || !std::isfinite(frequency_penalty)) bad("presence/frequency penalties must be finite");
  if (top_logprobs < 0 || top_logprobs > vocab) bad("top_logprobs must be in [0, vocab], got " + std::to_string(top_logprobs));
}

// ---------------------------------------------------------------------------------------------- Philox

void Philox::block(uint64_t key, uint64_t counter, uint32_t out[4]) {
  constexpr uint32_t M0 = 0xD2511F53u, M1 = 0xCD9E8D57u, W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
  uint32_t c0 = uint32_t(counter), c1 = uint32_t(counter >> 32), c2 = 0, c3 = 0;
  uint32_t k0 = uint32_t(key), k1 = uint32_t(key >> 32);
  for (int r = 0; r < 10; ++r) {
    const uint64_t p0 = uint64_t(M0) * c0, p1 = uint64_t(M1) * c2;
    const uint32_t n0 = uint32_t(p1 >> 32) ^ c1 ^ k0, n1 = uint32_t(p1);
    const uint32_t n2 = uint32_t(p0 >> 32) ^ c3 ^ k1, n3 = uint32_t(p0);
    c0 = n0, c1 = n1, c2 = n2, c3 = n3;
    k0 += W0, k1 += W1;
  }
  out[0] = c0, out[1] = c1, out[2] = c2, out[3] = c3;
}

double Philox::uniform() {
  uint32_t b[4];
  block(key, counter++, b);
  const uint64_t bits = (uint64_t(b[0]) << 32 | b[1]) >> 11;  // 53 bits
  return double(bits) * (1.0 / 9007199254740992.0);
}

// ---------------------------------------------------------------------------------------------- Sampler

Sampler::Sampler(const SamplingParams& p, int vocab, const int32_t* context, int64_t n) : p_(p), vocab_(vocab) {
  p_.validate(vocab);
  rng_.key = p.seed;
  seen_.assign(size_t(vocab), 0);
  for (int64_t i = 0; i < n; ++i)
    if (context[i] >= 0 && context[i] < vocab) seen_[size_t(context[i])] = 1;
  work_.resize(size_t(vocab));
}

void Sampler::accept(int32_t token) {
  if (token < 0 || token >= vocab_) return;
  seen_[size_t(token)] = 1;
  ++counts_[token];
}

void Sampler::penalise(float* l) const {
  if (p_.repetition_penalty != 1.f) {
    const float r = p_.repetition_penalty;
    for (int i = 0; i < vocab_; ++i)
      if (seen_[size_t(i)]) l[i] = l[i] > 0.f ? l[i] / r : l[i] * r;
  }
  if (p_.presence_penalty != 0.f || p_.frequency_penalty != 0.f)
    for (const auto& [t, n] : counts_) l[t] -= p_.frequency_penalty * float(n) + p_.presence_penalty;
}

void Sampler::filter(const float* pen, std::vector<int32_t>& ids, std::vector<double>& probs) const {
  const int V = vocab_;
  const double inv_t = 1.0 / double(p_.temperature);
  // top_k: the k-th largest logit is the threshold (temperature > 0 preserves the order).
  float thr = -std::numeric_limits<float>::infinity();
  if (p_.top_k > 0 && p_.top_k < V) {
    std::vector<float> copy(pen, pen + V);
    std::nth_element(copy.begin(), copy.begin() + (p_.top_k - 1), copy.end(), std::greater<float>());
    thr = copy[size_t(p_.top_k - 1)];
  }
  ids.clear();
  float mx = -std::numeric_limits<float>::infinity();
  for (int i = 0; i < V; ++i)
    if (pen[i] >= thr && pen[i] > -std::numeric_limits<float>::infinity()) {
      ids.push_back(i);
      mx = std::max(mx, pen[i]);
    }
  if (ids.empty()) throw std::runtime_error("[sampling] every logit is -inf or NaN");
  probs.resize(ids.size());
  double sum = 0.0;
  for (size_t j = 0; j < ids.size(); ++j) sum += (probs[j] = std::exp((double(pen[ids[j]]) - double(mx)) * inv_t));
  for (auto& q : probs) q /= sum;
  std::vector<uint8_t> keep(ids.size(), 1);
  if (p_.top_p < 1.f) {
    std::vector<uint32_t> order(ids.size());
    std::iota(order.begin(), order.end(), 0u);
    auto by_prob = [&](uint32_t a, uint32_t b) { return probs[a] > probs[b] || (probs[a] == probs[b] && a < b); };
    // Most of the mass sits in a few tokens: sort a head first and the rest only when the head falls short.
    size_t head = std::min<size_t>(order.size(), 1024), cut = order.size();
    for (;;) {
      std::partial_sort(order.begin(), order.begin() + head, order.end(), by_prob);
      double cum = 0.0;
      size_t j = 0;
      for (; j < head && cum < double(p_.top_p); ++j) cum += probs[order[j]];
      if (cum >= double(p_.top_p) || head == order.size()) { cut = j; break; }
      head = order.size();
    }
    std::fill(keep.begin(), keep.end(), 0);
    for (size_t j = 0; j < std::max<size_t>(cut, 1); ++j) keep[order[j]] = 1;
  }
  if (p_.min_p > 0.f) {
    double pmax = 0.0;
    for (size_t j = 0; j < ids.size(); ++j)
      if (keep[j]) pmax = std::max(pmax, probs[j]);
    const double floor = double(p_.min_p) * pmax;
    for (size_t j = 0; j < ids.size(); ++j)
      if (keep[j] && probs[j] < floor) keep[j] = 0;
  }
  size_t w = 0;
  double kept = 0.0;
  for (size_t j = 0; j < ids.size(); ++j)
    if (keep[j]) ids[w] = ids[j], probs[w] = probs[j], kept += probs[j], ++w;
  ids.resize(w), probs.resize(w);
  for (auto& q : probs) q /= kept;
}

static int32_t first_max(const float* l, int V) { return int32_t(std::max_element(l, l + V) - l); }

void Sampler::fill_logprobs(const float* logits, TokenChoice& c) const {
  if (!p_.logprobs && p_.top_logprobs == 0) return;
  const int V = vocab_;
  const float mx = logits[first_max(logits, V)];
  double sum = 0.0;
  for (int i = 0; i < V; ++i) sum += std::exp(double(logits[i]) - double(mx));
  const double lse = double(mx) + std::log(sum);
  c.logprob = float(double(logits[c.token]) - lse);
  c.top.clear();
  if (p_.top_logprobs > 0) {
    std::vector<int32_t> order(static_cast<size_t>(V));
    std::iota(order.begin(), order.end(), 0);
    const int k = p_.top_logprobs;
    std::partial_sort(order.begin(), order.begin() + k, order.end(),
                      [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); });
    for (int j = 0; j < k; ++j) c.top.emplace_back(order[j], float(double(logits[order[j]]) - lse));
  }
}

TokenChoice Sampler::sample(const float* logits) {
  std::copy(logits, logits + vocab_, work_.begin());
  penalise(work_.data());
  TokenChoice c;
  if (p_.greedy()) {
    c.token = first_max(work_.data(), vocab_);
  } else {
    std::vector<int32_t> ids;
    std::vector<double> probs;
    filter(work_.data(), ids, probs);
    const double u = rng_.uniform();
    double cum = 0.0;
    c.token = ids.back();
    for (size_t j = 0; j < ids.size(); ++j)
      if ((cum += probs[j]) > u) { c.token = ids[j]; break; }
  }
  fill_logprobs(logits, c);
  return c;
}

std::vector<float> Sampler::probabilities(const float* logits) const {
  std::vector<float> l(logits, logits + vocab_), out(size_t(vocab_), 0.f);
  penalise(l.data());
  if (p_.greedy()) {
    out[size_t(first_max(l.data(), vocab_))] = 1.f;
    return out;
  }
  std::vector<int32_t> ids;
  std::vector<double> probs;
  filter(l.data(), ids, probs);
  for (size_t j = 0; j < ids.size(); ++j) out[size_t(ids[j])] = float(probs[j]);
  return out;
}

}  // namespace lily
