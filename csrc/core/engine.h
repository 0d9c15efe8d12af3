// The C++ engine: one model, one backend, sessions with their state, and the generation loop.
// Called from Python through bindings/engine.cpp; runs the schedule (schedule/schedule.h) chunk by chunk.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "../schedule/backend.h"
#include "weights.h"

namespace lily {

// A conversation's model state and the tokens it has consumed, in order.
struct Session {
  std::unique_ptr<State> state;
  std::vector<int32_t> tokens;
  int64_t prefilled = 0;  // tokens run through the prefill schedule (counter for callers and tests)
  int64_t decoded = 0;    // tokens run through the decode schedule
};

class Engine {
 public:
  Engine(std::shared_ptr<Model> model, std::unique_ptr<Backend> backend, int64_t max_context);

  const Model& model() const { return *model_; }
  Backend& backend() { return *backend_; }
  int64_t max_context() const { return max_context_; }

  std::unique_ptr<Session> new_session();
  std::unique_ptr<Session> clone_session(const Session& s);

  // Teacher-forced logits [n, V] of `tokens` continuing the session. Prompts run through the prefill
  // schedule in chunks of at most `chunk` rows (0 = the backend's limit); a single token runs the decode step.
  std::vector<float> logits(Session& s, const int32_t* tokens, int64_t n, int chunk = 0);

  // Feed `tokens` and return the logits of the last one only [V].
  std::vector<float> feed(Session& s, const int32_t* tokens, int64_t n, int chunk = 0);

  // Greedy generation: feeds the prompt, then decodes until a stop id or max_tokens. on_token returns
  // false to stop early.
  std::vector<int32_t> generate_greedy(Session& s, const int32_t* prompt, int64_t n, int64_t max_tokens,
                                       const std::vector<int32_t>& stop_ids,
                                       const std::function<bool(int32_t)>& on_token = nullptr, int chunk = 0);

 private:
  void check_context(const Session& s, int64_t n) const;
  int chunk_rows(int chunk) const;

  std::shared_ptr<Model> model_;
  std::unique_ptr<Backend> backend_;
  int64_t max_context_;
};

}  // namespace lily
