#include "engine.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "../schedule/schedule.h"

namespace lily {

Engine::Engine(std::shared_ptr<Model> model, std::unique_ptr<Backend> backend, int64_t max_context)
    : model_(std::move(model)), backend_(std::move(backend)), max_context_(max_context) {
  if (max_context_ <= 0) throw std::invalid_argument("[engine] max_context must be positive");
}

std::unique_ptr<Session> Engine::new_session() {
  auto s = std::make_unique<Session>();
  s->state = backend_->new_state();
  return s;
}

std::unique_ptr<Session> Engine::clone_session(const Session& src) {
  auto s = std::make_unique<Session>();
  s->state = backend_->clone_state(*src.state);
  s->tokens = src.tokens;
  s->prefilled = src.prefilled;
  s->decoded = src.decoded;
  return s;
}

void Engine::check_context(const Session& s, int64_t n) const {
  if (n < 0) throw std::invalid_argument("[engine] negative token count");
  if (s.state->pos + n > max_context_)
    throw std::length_error("[engine] context limit exceeded: " + std::to_string(s.state->pos) + " cached + " +
                            std::to_string(n) + " new tokens > max_context " + std::to_string(max_context_));
}

int Engine::chunk_rows(int chunk) const {
  const int limit = backend_->max_rows();
  if (chunk < 0) throw std::invalid_argument("[engine] chunk size must be positive");
  return chunk == 0 ? limit : std::min(chunk, limit);
}

static void check_tokens(const int32_t* tokens, int64_t n, int vocab) {
  for (int64_t i = 0; i < n; ++i)
    if (tokens[i] < 0 || tokens[i] >= vocab)
      throw std::out_of_range("[engine] token id " + std::to_string(tokens[i]) + " at position " + std::to_string(i) +
                              " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
}

std::vector<float> Engine::logits(Session& s, const int32_t* tokens, int64_t n, int chunk) {
  check_context(s, n);
  check_tokens(tokens, n, model_->config().vocab);
  const int V = model_->config().vocab, rows = chunk_rows(chunk);
  std::vector<float> out(size_t(n) * V);
  if (n == 1) {
    schedule::decode_step(*backend_, *model_, *s.state, tokens);
    backend_->read_logits(out.data(), 1);
    s.decoded += 1;
  } else {
    for (int64_t i = 0; i < n; i += rows) {
      const int T = int(std::min<int64_t>(rows, n - i));
      schedule::prefill_chunk(*backend_, *model_, *s.state, tokens + i, T, schedule::Logits::all);
      backend_->read_logits(out.data() + size_t(i) * V, T);
    }
    s.prefilled += n;
  }
  s.tokens.insert(s.tokens.end(), tokens, tokens + n);
  return out;
}

std::vector<float> Engine::feed(Session& s, const int32_t* tokens, int64_t n, int chunk) {
  if (n <= 0) throw std::invalid_argument("[engine] nothing to feed");
  check_context(s, n);
  check_tokens(tokens, n, model_->config().vocab);
  const int V = model_->config().vocab, rows = chunk_rows(chunk);
  std::vector<float> out(V);
  if (n == 1) {
    schedule::decode_step(*backend_, *model_, *s.state, tokens);
    s.decoded += 1;
  } else {
    for (int64_t i = 0; i < n; i += rows) {
      const int T = int(std::min<int64_t>(rows, n - i));
      const bool last = i + T == n;
      schedule::prefill_chunk(*backend_, *model_, *s.state, tokens + i, T,
                              last ? schedule::Logits::last : schedule::Logits::none);
    }
    s.prefilled += n;
  }
  backend_->read_logits(out.data(), 1);
  s.tokens.insert(s.tokens.end(), tokens, tokens + n);
  return out;
}

std::vector<int32_t> Engine::generate_greedy(Session& s, const int32_t* prompt, int64_t n, int64_t max_tokens,
                                             const std::vector<int32_t>& stop_ids,
                                             const std::function<bool(int32_t)>& on_token, int chunk) {
  if (n <= 0) throw std::invalid_argument("[engine] empty prompt");
  check_context(s, n + max_tokens);
  check_tokens(prompt, n, model_->config().vocab);
  std::vector<int32_t> out;
  if (max_tokens <= 0) return out;
  // The prompt, whose last chunk (or single decode step) also selects the first token on the device.
  const int rows = chunk_rows(chunk);
  if (n == 1) {
    schedule::decode_step(*backend_, *model_, *s.state, prompt, true);
    s.decoded += 1;
  } else {
    for (int64_t i = 0; i < n; i += rows) {
      const int T = int(std::min<int64_t>(rows, n - i));
      const bool last = i + T == n;
      schedule::prefill_chunk(*backend_, *model_, *s.state, prompt + i, T,
                              last ? schedule::Logits::last : schedule::Logits::none, last);
    }
    s.prefilled += n;
  }
  s.tokens.insert(s.tokens.end(), prompt, prompt + n);
  // Each step embeds the token the previous one selected on the device; the CPU reads it only to
  // report it and to check stop conditions.
  for (int64_t i = 0;; ++i) {
    const int32_t tok = backend_->read_token();
    out.push_back(tok);
    const bool stop = std::find(stop_ids.begin(), stop_ids.end(), tok) != stop_ids.end();
    if ((on_token && !on_token(tok)) || stop || i + 1 == max_tokens) break;
    schedule::decode_step(*backend_, *model_, *s.state, nullptr, true);
    s.decoded += 1;
    s.tokens.push_back(tok);
  }
  return out;
}

}  // namespace lily
