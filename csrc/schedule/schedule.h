// The model's schedule, written once for every backend: one prefill chunk and one decode
// step, both in schedule.cpp. Called by the generation loop in core/engine.cpp; calls the ops of backend.h.
#pragma once
#include "backend.h"

namespace lily::schedule {

// Which rows of a chunk need logits: none (an inner chunk of a long prompt), the last, or all (teacher forcing).
enum class Logits : uint8_t { none, last, all };

// Runs T <= backend.max_rows() prompt tokens at positions [state.pos, state.pos + T) and advances state.pos.
// Returns the number of logits rows produced (0, 1 or T). select: also select the next token on the
// device (needs want == last). A chunk of one row is a prefill chunk like any other.
int prefill_chunk(Backend& b, const Model& m, const Fusions& f, State& s, const int32_t* tokens, int T, Logits want,
                  bool select = false);

// One token at position state.pos — `token`, or when null the token the previous step selected on the
// device — producing one logits row (and, with select, the next token); advances state.pos.
void decode_step(Backend& b, const Model& m, const Fusions& f, State& s, const int32_t* token, bool select = false);

}  // namespace lily::schedule
