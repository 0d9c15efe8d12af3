// GpuBackend (gpu_backend.h): the session state, token slots, command buffers in flight and counters that
// every GPU backend shares. Previous hop: csrc/schedule/schedule.cpp calls the Backend ops; the model's ops
// are the derived backend's (backends/metal: MetalBackend, each op in its family's file), which records them
// through recording().
// One command buffer per prefill chunk or decode step; no CPU wait inside one (counters: cpu_waits_in_step).
#include "gpu_backend.h"

#include <algorithm>
#include <atomic>
#include <stdexcept>
#include <tuple>

namespace lily::gpu {

// KV cache growth: whole blocks of rows, at least doubling, so growth copies stay O(context) in total.
constexpr int64_t kKvBlock = 256;

// Attention layers: K and V [n_kv, capacity, d] bf16 (Role::kv); GDN layers: conv and recurrent state f32
// (Role::state) in two copies: a chunk or step reads copy `cur` and writes the other, then `cur` flips, so
// the state before the last decode step survives it and rollback() is a flip back (the KV row that step
// wrote is simply overwritten later). Null where the layer is the other kind.
struct GpuBackend::GpuState final : State {
  const uint64_t serial = next_serial();
  std::vector<std::shared_ptr<Buffer>> k, v, conv[2], rec[2];
  int cur = 0;
  bool undoable = false;    // the last command buffer on this state was a decode step rollback() may undo
  bool undo_flips = false;  // ... and it wrote the other GDN copies
  // KV growth recorded by reserve() and encoded at the head of the next command buffer: copy the rows
  // [0, rows) of every KV head from `from` (capacity from_cap) into `to` (the new buffer, already in k / v).
  struct Growth { std::shared_ptr<Buffer> from; Buffer* to; int64_t from_cap, to_cap, rows; };
  std::vector<Growth> growth;
  static uint64_t next_serial() {
    static std::atomic<uint64_t> n{0};
    return ++n;
  }
};

GpuBackend::GpuBackend(const Model& model, std::unique_ptr<Device> device, int max_rows, bool pipeline,
                       ActFormat act_format)
    : m_(model), c_(model.config()), dev_(std::move(device)), rows_(max_rows), pipeline_(pipeline) {
  if (max_rows <= 0) throw std::invalid_argument(tag() + " max_rows must be positive");
  uint64_t weight_bytes = 0, kv_row_bytes = 0;  // what the GPU will hold: weights, KV bytes per position
  for (const auto& f : model.files()) weight_bytes += f->size();
  for (int i = 0; i < c_.layers; ++i)
    if (c_.is_attention(i)) kv_row_bytes += 2ull * c_.n_kv * c_.head_dim * 2;
  dev_->plan_memory(weight_bytes, kv_row_bytes * uint64_t(c_.max_position), uint64_t(c_.max_position));
  for (int a = 0; a < int(Act::count); ++a) {
    if (a == int(Act::logits)) continue;
    const int elem = a == int(Act::x) || act_format == ActFormat::f32 ? 4 : 2;
    act_[a] = dev_->alloc(uint64_t(rows_) * act_width(c_, Act(a)) * elem, Role::activations, act_name(Act(a)));
  }
  for (auto& row : row_logits_) row = dev_->alloc(uint64_t(c_.vocab) * 4, Role::io, "logits.row");
  for (auto& slot : tokens_) slot = dev_->alloc(4, Role::io, "token");
  for (auto& ids : host_ids_) ids = dev_->alloc(uint64_t(rows_) * 4, Role::io, "tokens.host");
  prev_ = dev_->counters();
}

// ---------------------------------------------------------------- session state

std::unique_ptr<State> GpuBackend::new_state() {
  auto s = std::make_unique<GpuState>();
  const int L = c_.layers;
  s->k.resize(L), s->v.resize(L);
  for (int copy = 0; copy < 2; ++copy) {
    s->conv[copy].resize(L), s->rec[copy].resize(L);
    for (int i = 0; i < L; ++i) {
      if (c_.is_attention(i)) continue;
      s->conv[copy][i] = zeroed(uint64_t(c_.conv_kernel - 1) * c_.conv_dim() * 4, Role::state, "gdn.conv");
      s->rec[copy][i] = zeroed(uint64_t(c_.lin_nv) * c_.lin_dk * c_.lin_dv * 4, Role::state, "gdn.rec");
    }
  }
  return s;
}

// Grows every attention layer's K/V to hold `tokens` rows, keeping rows [0, pos) of each KV head. No CPU
// wait: the new buffers are allocated now (zeroed by the Device; nothing on the GPU uses them yet) and
// the copies are encode_copy_rows dispatches at the head of the next command buffer (begin()), ordered after
// the command buffer in flight, which may still write the old buffers (kept alive until then).
void GpuBackend::reserve(State& st, int64_t tokens) {
  auto& s = static_cast<GpuState&>(st);
  if (tokens <= s.capacity) return;
  const int64_t cap = std::max((tokens + kKvBlock - 1) / kKvBlock * kKvBlock, 2 * s.capacity);
  const uint64_t d2 = uint64_t(c_.head_dim) * 2;
  for (int i = 0; i < c_.layers; ++i) {
    if (!c_.is_attention(i)) continue;
    for (auto* cache : {&s.k[i], &s.v[i]}) {
      auto grown = zeroed(uint64_t(c_.n_kv) * cap * d2, Role::kv, "kv." + std::to_string(i));
      if (*cache && s.pos > 0) {
        // A growth still pending (two reserves before a begin) copies from its own source.
        auto pending = std::find_if(s.growth.begin(), s.growth.end(), [&](const auto& g) { return g.to == cache->get(); });
        if (pending != s.growth.end()) {
          pending->to = grown.get(), pending->to_cap = cap;
        } else {
          s.growth.push_back({*cache, grown.get(), s.capacity, cap, s.pos});
        }
      }
      *cache = std::move(grown);
    }
  }
  s.capacity = cap;
}

// Encodes the pending growth copies of s (reserve()) into the command buffer being recorded.
void GpuBackend::encode_growth(GpuState& s) {
  const uint64_t d2 = uint64_t(c_.head_dim) * 2;
  for (const auto& g : s.growth)
    encode_copy_rows({g.from.get()}, {g.to}, c_.n_kv, uint64_t(g.rows) * d2, uint64_t(g.from_cap) * d2,
                     uint64_t(g.to_cap) * d2);
  for (auto& g : s.growth) retire(std::move(g.from));  // alive until its command buffer is done
  s.growth.clear();
}

// For CPU reads of a state outside the schedule (clone, export): run its pending copies now.
void GpuBackend::flush_growth(GpuState& s) {
  if (s.growth.empty()) return;
  if (cb_) throw std::logic_error(tag() + " state read while a command buffer is being recorded");
  finish();
  cb_ = dev_->new_command_buffer();
  encode_growth(s);
  cb_->commit();
  cb_->wait();
  cb_.reset();
  retired_recording_.clear();
  total_[int(Phase::prefill)].add(since_last_account());  // outside any step; KV growth belongs to prefill
}

// A clone (a fork, a request's undo point, a turn's snapshot) copies only what the state holds: each KV head's
// rows below pos (not the capacity above it, which the next steps write) and the GDN copy `cur` (a step reads it
// and writes the other whole, and a new state has no step to undo). At 4K on the real model that is ~147 MB of
// a state's ~294 MB.
std::unique_ptr<State> GpuBackend::clone_state(const State& st) {
  const auto& s = static_cast<const GpuState&>(st);
  flush_growth(const_cast<GpuState&>(s));
  finish();
  auto c = std::make_unique<GpuState>();
  c->pos = s.pos, c->capacity = s.capacity, c->cur = s.cur;
  const uint64_t row = uint64_t(c_.head_dim) * 2;
  auto like = [&](const std::shared_ptr<Buffer>& b) { return b ? dev_->alloc(b->size, b->role, b->label) : nullptr; };
  for (int i = 0; i < c_.layers; ++i) {
    c->k.push_back(like(s.k[i])), c->v.push_back(like(s.v[i]));
    for (int j = 0; j < 2; ++j) c->conv[j].push_back(like(s.conv[j][i])), c->rec[j].push_back(like(s.rec[j][i]));
    if (c_.is_attention(i)) {
      for (auto [to, from] : {std::pair{c->k[i].get(), s.k[i].get()}, std::pair{c->v[i].get(), s.v[i].get()}})
        for (int h = 0; h < c_.n_kv; ++h) {
          const uint64_t at = uint64_t(h) * s.capacity * row;
          dev_->copy({to, at}, {from, at}, uint64_t(s.pos) * row);
        }
    } else {
      for (auto [to, from] : {std::pair{c->conv[s.cur][i].get(), s.conv[s.cur][i].get()},
                              std::pair{c->rec[s.cur][i].get(), s.rec[s.cur][i].get()}})
        dev_->copy({to}, {from}, from->size);
    }
  }
  return c;
}

void GpuBackend::bind(State* s) { s_ = static_cast<GpuState*>(s); }

// Session files: the state's buffers read through the Device once the GPU is done. KV in the device's bf16
// [n_kv, rows in use, d]; conv and recurrent state f32, as the reference backend names them.
std::vector<StateTensor> GpuBackend::export_state(const State& st) {
  auto& s = const_cast<GpuState&>(static_cast<const GpuState&>(st));
  flush_growth(s);
  finish();
  std::vector<StateTensor> out;
  const uint64_t row = uint64_t(c_.head_dim) * 2;
  for (int i = 0; i < c_.layers; ++i) {
    const std::string p = "layers." + std::to_string(i) + ".";
    if (c_.is_attention(i)) {
      for (auto [nm, buf] : {std::pair{"k", s.k[i].get()}, std::pair{"v", s.v[i].get()}}) {
        StateTensor t{p + nm, "bf16", {c_.n_kv, s.pos, c_.head_dim}, std::vector<uint8_t>(uint64_t(c_.n_kv) * s.pos * row)};
        for (int h = 0; h < c_.n_kv && s.pos; ++h)
          dev_->read({buf, uint64_t(h) * s.capacity * row}, t.data.data() + uint64_t(h) * s.pos * row,
                     uint64_t(s.pos) * row);
        out.push_back(std::move(t));
      }
    } else {
      for (auto [nm, buf, shape] : {std::tuple{"conv", s.conv[s.cur][i].get(), std::vector<int64_t>{c_.conv_kernel - 1, c_.conv_dim()}},
                                    std::tuple{"rec", s.rec[s.cur][i].get(), std::vector<int64_t>{c_.lin_nv, c_.lin_dk, c_.lin_dv}}}) {
        StateTensor t{p + nm, "f32", shape, std::vector<uint8_t>(buf->size)};
        dev_->read({buf}, t.data.data(), buf->size);
        out.push_back(std::move(t));
      }
    }
  }
  return out;
}

void GpuBackend::import_state(State& st, int64_t pos, const std::vector<StateTensor>& tensors) {
  auto& s = static_cast<GpuState&>(st);
  if (pos < 0) throw std::invalid_argument(tag() + " import_state: negative position");
  auto find = [&](const std::string& name, const char* dtype, std::vector<int64_t> shape, uint64_t bytes) -> const StateTensor& {
    for (const auto& t : tensors)
      if (t.name == name) {
        if (t.dtype != dtype || t.shape != shape || t.data.size() != bytes)
          throw std::invalid_argument(tag() + " state tensor '" + name + "' has the wrong dtype, shape or size (expected " +
                                      dtype + ")");
        return t;
      }
    throw std::invalid_argument(tag() + " state tensor '" + name + "' is missing");
  };
  finish();
  s.pos = 0;  // nothing to keep: the growth below copies no rows
  reserve(s, std::max<int64_t>(pos, 1));
  const uint64_t row = uint64_t(c_.head_dim) * 2;
  for (int i = 0; i < c_.layers; ++i) {
    const std::string p = "layers." + std::to_string(i) + ".";
    if (c_.is_attention(i)) {
      for (auto [nm, buf] : {std::pair{"k", s.k[i].get()}, std::pair{"v", s.v[i].get()}}) {
        const auto& t = find(p + nm, "bf16", {c_.n_kv, pos, c_.head_dim}, uint64_t(c_.n_kv) * pos * row);
        for (int h = 0; h < c_.n_kv && pos; ++h)
          dev_->write({buf, uint64_t(h) * s.capacity * row}, t.data.data() + uint64_t(h) * pos * row,
                      uint64_t(pos) * row);
      }
    } else {
      const auto& cv = find(p + "conv", "f32", {c_.conv_kernel - 1, c_.conv_dim()}, s.conv[s.cur][i]->size);
      const auto& rc = find(p + "rec", "f32", {c_.lin_nv, c_.lin_dk, c_.lin_dv}, s.rec[s.cur][i]->size);
      dev_->write({s.conv[s.cur][i].get()}, cv.data.data(), cv.data.size());
      dev_->write({s.rec[s.cur][i].get()}, rc.data.data(), rc.data.size());
    }
  }
  s.pos = pos;
  s.undoable = false;
}

// ---------------------------------------------------------------- submission

void GpuBackend::begin(Phase phase, const Fusions& fusions) {
  if (cb_) throw std::logic_error(tag() + " begin() while a command buffer is being recorded");
  cb_ = dev_->new_command_buffer();
  phase_ = phase;
  fusions_ = fusions;
  gdn_written_ = false;
  // The other token slot: the one the previous step selected into is this step's input.
  slot_ ^= 1;
  if (s_) encode_growth(*s_);
}

void GpuBackend::commit() {
  if (!cb_) throw std::logic_error(tag() + " commit() without begin()");
  // At most kMaxInFlight command buffers queued (the pipelined decode needs two): a long prompt's chunks
  // would otherwise all be queued at once, each holding its ids and retired buffers.
  if (inflight_.size() >= kMaxInFlight) wait_until(inflight_.front().seq);
  cb_->commit();
  inflight_.push_back({std::move(cb_), ++committed_, std::move(retired_recording_), phase_});
  retired_recording_.clear();
  for (auto& u : unread_)
    if (!u.seq) u.seq = committed_;
  if (s_) {
    if (gdn_written_) s_->cur ^= 1;
    s_->undoable = phase_ == Phase::decode;
    s_->undo_flips = gdn_written_;
  }
  const int p = int(phase_);
  last_[p] = since_last_account();
  last_[p].cpu_waits_in_step = in_step_waits_;
  total_[p].add(last_[p]);
  in_step_waits_ = 0;
}

void GpuBackend::wait_mid_step() {
  cb_->commit();
  cb_->wait();
  ++in_step_waits_;
  cb_ = dev_->new_command_buffer();
}

// Undoes the last decode step on st, which may still be in flight: its GDN states went to the other copy,
// its KV row lies past the position, its token will not be read.
void GpuBackend::rollback(State& st) {
  auto& s = static_cast<GpuState&>(st);
  if (!s.undoable || s.pos < 1) throw std::logic_error(tag() + " rollback(): the state's last step was not a decode step");
  if (cb_) throw std::logic_error(tag() + " rollback() while a command buffer is being recorded");
  if (s.undo_flips) s.cur ^= 1;
  s.pos -= 1;
  s.undoable = false;
  slot_ ^= 1;  // its input slot is the next step's again
  if (!unread_.empty() && unread_.back().seq == committed_) {
    unread_.pop_back();
    if (!params_.greedy()) --draws_;
  }
}

void GpuBackend::read_logits(float* out, int rows) {
  if (!last_logits_ || rows > logit_rows_)
    throw std::out_of_range(tag() + " read_logits: " + std::to_string(rows) + " rows, computed " + std::to_string(logit_rows_));
  finish();
  dev_->read({last_logits_}, out, uint64_t(rows) * c_.vocab * 4);
}

// Waits for the command buffers committed up to `seq`: CPU waits, each counted for the phase of the command
// buffer waited for. A wait that leaves nothing queued is a drained wait: the GPU idles until the CPU commits.
void GpuBackend::wait_until(uint64_t seq) {
  while (!inflight_.empty() && inflight_.front().seq <= seq) {
    const Phase p = inflight_.front().phase;
    inflight_.front().cb->wait();
    inflight_.pop_front();
    Counters d = since_last_account();
    d.cpu_waits_drained = inflight_.empty() ? 1 : 0;
    last_[int(p)].add(d);
    total_[int(p)].add(d);
  }
}

void GpuBackend::finish() { wait_until(committed_); }

Counters GpuBackend::since_last_account() {
  const Counters now = dev_->counters();
  const Counters d = now.since(prev_);
  prev_ = now;
  return d;
}

// ---------------------------------------------------------------- tokens

// Prompt tokens travel in a ring of kMaxInFlight + 1 buffers, one per command buffer: the CPU writes the
// recording one's ids while those in flight may still read theirs.
void GpuBackend::embed(const int32_t* tokens, int T) {
  check_rows(T, "embed");
  for (int t = 0; t < T; ++t)
    if (tokens[t] < 0 || tokens[t] >= c_.vocab)
      throw std::out_of_range("[embed] token id " + std::to_string(tokens[t]) + " outside the vocabulary [0, " +
                              std::to_string(c_.vocab) + ")");
  if (phase_ == Phase::decode && T == 1 && records_steps_once()) {
    dev_->write({tokens_[slot_].get()}, tokens, 4);
    embed_selected();
    return;
  }
  Buffer* ids = host_ids_[(committed_ + 1) % host_ids_.size()].get();
  dev_->write({ids}, tokens, uint64_t(T) * 4);
  encode_embed({ids}, T);
}

void GpuBackend::embed_selected() {
  encode_embed({tokens_[slot_].get()}, 1);
}

// Selection writes token slot slot_ ^ 1, which the next step's begin() makes its input. A step's token and
// logits row stay readable until the step after next records (read_token comes before that).
void GpuBackend::select_begin(const Sampler& sampler) {
  params_ = sampler.params();
  draws_ = sampler.draws();
  plain_greedy_ = params_.greedy() && !params_.penalised();
  if (plain_greedy_) return;
  wait_until(tables_used_by_);  // an earlier generation's last step may still read or write the tables
  if (!seen_) {
    seen_ = dev_->alloc(uint64_t(c_.vocab), Role::io, "sample.seen");
    counts_ = dev_->alloc(uint64_t(c_.vocab) * 4, Role::io, "sample.counts");
  }
  dev_->write({seen_.get()}, sampler.seen().data(), uint64_t(c_.vocab));
  std::vector<int32_t> counts(size_t(c_.vocab), 0);
  for (const auto& [token, n] : sampler.counts()) counts[size_t(token)] = n;
  dev_->write({counts_.get()}, counts.data(), counts.size() * 4);
}

void GpuBackend::select_token() {
  if (logit_rows_ != 1) throw std::logic_error(tag() + " select_token() needs a one-row lm_head first");
  encode_select({last_logits_}, {tokens_[slot_ ^ 1].get()}, plain_greedy_ ? nullptr : &params_, draws_,
                {seen_.get()}, {counts_.get()});
  if (!plain_greedy_) tables_used_by_ = committed_ + 1;  // the command buffer being recorded
  if (!params_.greedy()) ++draws_;
  unread_.push_back({0, slot_ ^ 1, last_logits_});
}

int32_t GpuBackend::read_token(float* logits) {
  if (unread_.empty()) throw std::logic_error(tag() + " read_token(): no selected token left to read");
  if (cb_ && !unread_.front().seq) throw std::logic_error(tag() + " read_token() of the step being recorded");
  const Unread u = unread_.front();
  unread_.pop_front();
  wait_until(u.seq);
  if (logits) dev_->read({u.logits}, logits, uint64_t(c_.vocab) * 4);
  int32_t token = 0;
  dev_->read({tokens_[u.slot].get()}, &token, 4);
  return token;
}

// ---------------------------------------------------------------- for the ops

Encoder& GpuBackend::recording() {
  if (!cb_) throw std::logic_error(tag() + " op recorded outside begin()/commit()");
  return cb_->encoder();
}

View GpuBackend::logits_rows(int rows) {
  check_rows(rows, "lm_head");
  if (rows == 1) {
    last_logits_ = row_logits_[slot_ ^ 1].get();
  } else {
    if (rows > logit_capacity_) grow_logits(rows);
    last_logits_ = act_[int(Act::logits)].get();
  }
  logit_rows_ = rows;
  return {last_logits_, 0};
}

void GpuBackend::grow_logits(int rows) {
  finish();
  act_[int(Act::logits)] = dev_->alloc(uint64_t(rows) * c_.vocab * 4, Role::io, "logits");
  logit_capacity_ = rows;
}

GdnStates GpuBackend::gdn_states(int layer) {
  gdn_written_ = true;
  const int a = s_->cur, b = a ^ 1;
  return {{s_->conv[a][layer].get()}, {s_->rec[a][layer].get()}, {s_->conv[b][layer].get()}, {s_->rec[b][layer].get()}};
}

View GpuBackend::k_cache(int layer) const { return {s_->k[layer].get()}; }
View GpuBackend::v_cache(int layer) const { return {s_->v[layer].get()}; }
int64_t GpuBackend::kv_capacity() const { return s_->capacity; }
uint64_t GpuBackend::state_serial() const { return s_ ? s_->serial : 0; }
int64_t GpuBackend::position() const { return s_ ? s_->pos : 0; }
int GpuBackend::gdn_copy() const { return s_ ? s_->cur : 0; }

std::string GpuBackend::tag() const { return std::string("[").append(name()).append("]"); }

void GpuBackend::check_rows(int T, const char* op) const {
  if (T < 1 || T > rows_)
    throw std::out_of_range(std::string("[") + op + "] " + std::to_string(T) + " rows, chunk limit is " + std::to_string(rows_));
}

std::shared_ptr<Buffer> GpuBackend::zeroed(uint64_t bytes, Role role, const std::string& label) {
  auto b = dev_->alloc(bytes, role, label);
  dev_->zero({b.get()}, bytes);
  return b;
}

}  // namespace lily::gpu
