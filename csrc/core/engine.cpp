#include "engine.h"

#include <algorithm>
#include <optional>
#include <stdexcept>
#include <string>

#include "../schedule/schedule.h"

namespace lily {

Engine::Engine(std::shared_ptr<Model> model, std::unique_ptr<Backend> backend, int64_t max_context, Fusions fusions)
    : model_(std::move(model)), backend_(std::move(backend)), max_context_(max_context), fusions_(fusions) {
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
    schedule::decode_step(*backend_, *model_, fusions_, *s.state, tokens);
    backend_->read_logits(out.data(), 1);
    s.decoded += 1;
  } else {
    for (int64_t i = 0; i < n; i += rows) {
      const int T = int(std::min<int64_t>(rows, n - i));
      schedule::prefill_chunk(*backend_, *model_, fusions_, *s.state, tokens + i, T, schedule::Logits::all);
      backend_->read_logits(out.data() + size_t(i) * V, T);
    }
    s.prefilled += n;
  }
  s.tokens.insert(s.tokens.end(), tokens, tokens + n);
  return out;
}

void Engine::prefill(Session& s, const int32_t* tokens, int64_t n, int chunk, bool select, const CancelFlag* cancel,
                     bool logits) {
  const int rows = chunk_rows(chunk);
  for (int64_t i = 0; i < n; i += rows) {
    if (cancel && cancel->is_set()) {
      s.tokens.insert(s.tokens.end(), tokens, tokens + i);
      s.prefilled += i;
      throw Cancelled("[engine] cancelled after " + std::to_string(i) + " of " + std::to_string(n) + " prompt tokens");
    }
    const int T = int(std::min<int64_t>(rows, n - i));
    const bool last = i + T == n;
    schedule::prefill_chunk(*backend_, *model_, fusions_, *s.state, tokens + i, T,
                            last && logits ? schedule::Logits::last : schedule::Logits::none, last && select);
  }
  s.tokens.insert(s.tokens.end(), tokens, tokens + n);
  s.prefilled += n;
}

std::vector<float> Engine::feed(Session& s, const int32_t* tokens, int64_t n, int chunk, const CancelFlag* cancel,
                                bool logits) {
  if (n <= 0) throw std::invalid_argument("[engine] nothing to feed");
  check_context(s, n);
  check_tokens(tokens, n, model_->config().vocab);
  if (n == 1) {
    schedule::decode_step(*backend_, *model_, fusions_, *s.state, tokens);
    s.decoded += 1;
    s.tokens.push_back(tokens[0]);
  } else {
    prefill(s, tokens, n, chunk, false, cancel, logits);
  }
  std::vector<float> out;
  if (logits) {
    out.resize(size_t(model_->config().vocab));
    backend_->read_logits(out.data(), 1);
  }
  return out;
}

int64_t Engine::state_bytes(const Session& s) const {
  const ModelConfig& c = model_->config();
  int64_t bytes = 0;
  for (int i = 0; i < c.layers; ++i)
    bytes += c.is_attention(i) ? 2 * int64_t(c.n_kv) * s.state->capacity * c.head_dim * 4
                               : (int64_t(c.conv_kernel - 1) * c.conv_dim() + int64_t(c.lin_nv) * c.lin_dk * c.lin_dv) * 4 *
                                     backend_->gdn_state_copies();
  return bytes;
}

std::vector<StateTensor> Engine::export_session(const Session& s) { return backend_->export_state(*s.state); }

std::unique_ptr<Session> Engine::import_session(const std::vector<StateTensor>& tensors, const std::vector<int32_t>& tokens) {
  if (int64_t(tokens.size()) > max_context_)
    throw std::length_error("[engine] the saved session holds " + std::to_string(tokens.size()) +
                            " tokens, more than max_context " + std::to_string(max_context_));
  check_tokens(tokens.data(), int64_t(tokens.size()), model_->config().vocab);
  auto s = new_session();
  backend_->import_state(*s->state, int64_t(tokens.size()), tensors);
  s->tokens = tokens;
  return s;
}

// ---------------------------------------------------------------------------------------------- generation

static std::vector<int32_t> joined(const std::vector<int32_t>& a, const int32_t* b, int64_t n) {
  std::vector<int32_t> v(a);
  if (n > 0) v.insert(v.end(), b, b + n);
  return v;
}

Generation::Generation(Engine& e, Session& s, const int32_t* prompt, int64_t n, GenerateOptions o,
                       const float* first_logits)
    : e_(e), s_(s), prompt_(prompt, prompt + std::max<int64_t>(n, 0)), o_(std::move(o)),
      sampler_(o_.sampling, e.model().config().vocab, joined(s.tokens, prompt, n).data(), int64_t(s.tokens.size()) + n) {
  const int V = e.model().config().vocab;
  if (n < 0) throw std::invalid_argument("[engine] negative prompt length");
  if (n == 0 && !first_logits) throw std::invalid_argument("[engine] empty prompt");
  e.check_context(s, n);
  check_tokens(prompt, n, V);
  e.chunk_rows(o_.chunk);
  if (first_logits) first_logits_.assign(first_logits, first_logits + V);
  logits_.resize(size_t(V));
  pipelined_ = e.backend().pipelines();
  // k generated tokens feed k - 1 of them: the context bounds the count.
  max_tokens_ = std::min<int64_t>(o_.max_tokens, e.max_context() - s.state->pos - n + 1);
  if (max_tokens_ <= 0) finish_ = "length";
}

Generation::~Generation() {
  try {
    close();
  } catch (...) {
    // A destructor cannot report it; close() only throws when the backend fails, which the next call shows.
  }
}

void Generation::feed(const int32_t* host_token) {
  schedule::decode_step(*e_.backend_, *e_.model_, e_.fusions_, *s_.state, host_token, true);
  s_.decoded += 1;
}

void Generation::close() {
  if (ahead_) {
    e_.backend_->rollback(*s_.state);
    s_.decoded -= 1;
    s_.tokens.pop_back();
    ahead_ = false;
  }
  if (!finish_) finish_ = "cancelled";
}

TokenChoice Generation::next() {
  if (finish_) throw std::logic_error("[engine] generation already finished");
  Backend& b = *e_.backend_;
  const Model& m = *e_.model_;
  const bool want_logprobs = o_.sampling.logprobs || o_.sampling.top_logprobs > 0;
  // 1. The step that selects this token is committed (or the token is chosen on the host).
  std::optional<TokenChoice> host;
  if (!started_) {
    started_ = true;
    const int64_t n = int64_t(prompt_.size());
    if (n == 0) {
      host = sampler_.sample(first_logits_.data());
      sampler_.accept(host->token);
    }
    b.select_begin(sampler_);
    if (n == 1) {
      schedule::decode_step(b, m, e_.fusions_, *s_.state, prompt_.data(), true);
      s_.decoded += 1;
      s_.tokens.push_back(prompt_[0]);
    } else if (n > 1) {
      try {
        e_.prefill(s_, prompt_.data(), n, o_.chunk, true, o_.cancel.get());
      } catch (const Cancelled&) {
        finish_ = "cancelled";
        throw;
      }
    }
  } else if (!ahead_) {
    feed(last_on_host_ ? &last_ : nullptr);
    s_.tokens.push_back(last_);
  }
  // 2. Pipelining: the step feeding this token goes in before the CPU waits for the token.
  ahead_ = pipelined_ && generated_ + 1 < max_tokens_;
  if (ahead_) feed(host ? &host->token : nullptr);
  // 3. The token.
  TokenChoice c;
  if (host) {
    c = *host;
  } else {
    c.token = b.read_token(want_logprobs ? logits_.data() : nullptr);
    if (want_logprobs) sampler_.fill_logprobs(logits_.data(), c);
  }
  if (ahead_) s_.tokens.push_back(c.token);
  last_on_host_ = host.has_value();
  last_ = c.token;
  ++generated_;
  if (std::find(o_.stop_ids.begin(), o_.stop_ids.end(), c.token) != o_.stop_ids.end()) finish_ = "stop";
  else if (generated_ >= max_tokens_) finish_ = "length";
  if (finish_) close();
  return c;
}

}  // namespace lily
