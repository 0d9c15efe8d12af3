// The C++ engine: one model, one backend, sessions with their state, and the generation loop.
// Called from Python through bindings/engine.cpp; runs the schedule (schedule/schedule.h) chunk by chunk.
#pragma once
#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <memory>
#include <vector>

#include "../schedule/backend.h"
#include "sampling.h"
#include "weights.h"

namespace lily {

// A conversation's model state and the tokens it has consumed, in order.
struct Session {
  std::unique_ptr<State> state;
  std::vector<int32_t> tokens;
  int64_t prefilled = 0;  // tokens run through the prefill schedule (counter for callers and tests)
  int64_t decoded = 0;    // tokens run through the decode schedule
};

// Set from any thread (a server noticing that its client went away) to stop a prompt between two prefill
// chunks: the engine then throws Cancelled, the session holding the chunks already run.
struct CancelFlag {
  std::atomic<bool> flag{false};
  void set() { flag.store(true); }
  bool is_set() const { return flag.load(); }
};
struct Cancelled : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct GenerateOptions {
  int64_t max_tokens = 64;
  std::vector<int32_t> stop_ids;  // generation ends after emitting one of these
  SamplingParams sampling;
  int chunk = 0;                  // prefill chunk rows (0 = the backend's limit)
  std::shared_ptr<const CancelFlag> cancel;  // checked before every prefill chunk
};

class Engine;

// One request's generation loop, advanced a token at a time so that callers can stream, and stop between
// any two tokens (Python's Engine.stream drives it through the bindings). The first next() runs the prompt (prefill chunks, or
// one decode step for a single token); each later one runs one decode step for the previous token. The last
// token returned is never fed: the session then holds the prompt and every generated token but the last.
//
// Token selection happens on the device (Backend::select_token, sampling.h semantics): the last prefill chunk
// or decode step ends by selecting the next token into the input slot the next step embeds from, so the
// token never visits the CPU between steps; the host reads the id (and the logits row when logprobs are
// asked) only to stream it and check stops. Only a token chosen from `first_logits` is picked on the host.
//
// Pipelining (backends whose Backend::pipelines() is true): next() commits the step that feeds the token it is about
// to return before waiting for that token, so the GPU always has the following step queued while the CPU
// reads, streams and checks stops. When the token ends the generation (a stop id, or close() from a caller
// that stops early), that step is undone (Backend::rollback) and the session is as if it never ran.
class Generation {
 public:
  // `prompt` may be empty when `first_logits` [V] (the logits after the session's last token, kept by a
  // snapshot) is given; the first token is then chosen from it. The repetition penalty sees the session's
  // tokens plus the prompt.
  Generation(Engine& e, Session& s, const int32_t* prompt, int64_t n, GenerateOptions o,
             const float* first_logits = nullptr);
  ~Generation();

  bool done() const { return finish_ != nullptr; }
  // "stop" (a stop id), "length", or "cancelled" (close() before the end)
  const char* finish_reason() const { return finish_ ? finish_ : ""; }
  TokenChoice next();  // throws std::logic_error once done
  // Ends the generation between two tokens, undoing a step committed ahead. Idempotent; the destructor calls it.
  void close();
  int64_t generated() const { return generated_; }
  int64_t max_tokens() const { return max_tokens_; }
  bool pipelined() const { return pipelined_; }

 private:
  void feed(const int32_t* host_token);  // a decode step for the latest token (from the device slot when null)

  Engine& e_;
  Session& s_;
  std::vector<int32_t> prompt_;
  std::vector<float> first_logits_, logits_;
  GenerateOptions o_;
  Sampler sampler_;  // chooses from first_logits, computes logprobs, and seeds the device's tables
  bool started_ = false, pipelined_ = false;
  bool ahead_ = false;           // the step feeding the latest token is committed
  bool last_on_host_ = false;    // the latest token was chosen on the host (so it is fed by value)
  int32_t last_ = -1;
  int64_t generated_ = 0, max_tokens_ = 0;
  const char* finish_ = nullptr;
};

class Engine {
 public:
  // `fusions`: the decode fusions the schedule uses (backend.h; all on by default, off for matched ablations).
  Engine(std::shared_ptr<Model> model, std::unique_ptr<Backend> backend, int64_t max_context, Fusions fusions = {});

  const Model& model() const { return *model_; }
  Backend& backend() { return *backend_; }
  int64_t max_context() const { return max_context_; }
  const Fusions& fusions() const { return fusions_; }

  std::unique_ptr<Session> new_session();
  std::unique_ptr<Session> clone_session(const Session& s);
  // Upper bound of a session state's host/device bytes (KV capacity and the GDN state copies at 4 bytes an element).
  int64_t state_bytes(const Session& s) const;
  // Session state as named host arrays (Backend::export_state) and a new session from them.
  std::vector<StateTensor> export_session(const Session& s);
  std::unique_ptr<Session> import_session(const std::vector<StateTensor>& tensors, const std::vector<int32_t>& tokens);

  // Teacher-forced logits [n, V] of `tokens` continuing the session. Prompts run through the prefill
  // schedule in chunks of at most `chunk` rows (0 = the backend's limit); a single token runs the decode step.
  std::vector<float> logits(Session& s, const int32_t* tokens, int64_t n, int chunk = 0);

  // Feed `tokens` and return the logits of the last one only [V]. `cancel`: checked before every chunk. Without
  // `logits` nothing is read back (an empty result) and nothing waits for the device but the in-flight cap, so a
  // caller feeding a prompt chunk by chunk (the Python API, for its progress callback) keeps the GPU busy.
  std::vector<float> feed(Session& s, const int32_t* tokens, int64_t n, int chunk = 0, const CancelFlag* cancel = nullptr,
                          bool logits = true);

 private:
  friend class Generation;
  void check_context(const Session& s, int64_t n) const;
  // Runs tokens [0, n) of a prompt through the prefill schedule in chunks (the last one with the logits of its
  // last row when `logits`, selecting the next token on the device when `select`); throws Cancelled between chunks.
  void prefill(Session& s, const int32_t* tokens, int64_t n, int chunk, bool select, const CancelFlag* cancel,
               bool logits = true);
  int chunk_rows(int chunk) const;

  std::shared_ptr<Model> model_;
  std::unique_ptr<Backend> backend_;
  int64_t max_context_;
  Fusions fusions_;
};

}  // namespace lily
