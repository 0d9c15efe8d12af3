// GpuBackend: what every GPU backend shares above its Device (device.h) — the session state on the device
// (KV cache grown on the device, the GDN states in two copies for rollback), the activation buffers, token
// slots and device-side token selection bookkeeping, prompt ids in a ring, the command buffers in flight
// (pipelined decode), and the counters per phase. A GPU backend (backends/metal, backends/cuda) derives from
// it and implements the model's ops (backend.h) with its kernels, plus the three hooks below.
// docs/design.md shows how a backend plugs in.
//
// Device formats: x f32 [T, H]; logits f32 [rows, V]; every other activation bf16 (ActFormat::bf16, Metal) or
// f32 (ActFormat::f32, CUDA); KV cache bf16 [n_kv, capacity, d] per attention layer; GDN conv state f32
// [k_c - 1, C], recurrent state f32 [n_v, d_k, d_v] per linear layer; tokens int32. Widths are act_width
// (backend.h). The CPU reaches buffers through the Device (write / read / copy / zero), reading only after
// the GPU is done with them.
#pragma once
#include <array>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "../../schedule/backend.h"
#include "device.h"

namespace lily::gpu {

// A GDN layer's states as one op reads and writes them: the state before (conv_in, rec_in) and the twins the
// state after goes to (conv_out, rec_out), so the state before the last decode step survives it.
struct GdnStates {
  View conv_in, rec_in, conv_out, rec_out;
};

// The activations other than x and logits: bf16 (Metal's kernels), or f32 (CUDA's).
enum class ActFormat : uint8_t { bf16, f32 };

class GpuBackend : public Backend {
 public:
  // What the device spent on the last prefill chunk / decode step (cumulative = every one since creation).
  Counters counters(Phase phase, bool cumulative) const { return cumulative ? total_[int(phase)] : last_[int(phase)]; }
  Device& device() { return *dev_; }
  // The device memory the backend and its states allocated, by role (Engine.memory()).
  Memory memory() const { return dev_->memory(); }
  void reset_peak_memory() { dev_->reset_peak_memory(); }
  virtual const char* kernel_label(KernelIndex kernel) const = 0;  // the name of a kernel of Counters

  std::string name() const override { return dev_->name(); }
  int max_rows() const override { return rows_; }

  std::unique_ptr<State> new_state() override;
  void reserve(State& s, int64_t tokens) override;
  std::unique_ptr<State> clone_state(const State& s) override;
  void bind(State* s) override;
  std::vector<StateTensor> export_state(const State& s) override;
  void import_state(State& s, int64_t pos, const std::vector<StateTensor>& tensors) override;

  void embed(const int32_t* tokens, int T) override;
  void embed_selected() override;
  void select_begin(const Sampler& sampler) override;
  void select_token() override;
  int32_t read_token(float* logits) override;

  bool pipelines() const override { return pipeline_; }
  int gdn_state_copies() const override { return 2; }
  void rollback(State& s) override;

  void begin(Phase phase, const Fusions& fusions) override;
  void commit() override;
  void read_logits(float* out, int rows) override;

 protected:
  // `max_rows`: rows one prefill chunk may have (activation buffers are sized for it). `pipeline`: commit()
  // returns before the GPU is done, and decode runs with two command buffers in flight (pipelines()).
  GpuBackend(const Model& model, std::unique_ptr<Device> device, int max_rows, bool pipeline,
             ActFormat act_format = ActFormat::bf16);

  // ---- the hooks a GPU backend implements with its kernels
  // x rows [0, T) ← the embedding rows of the int32 ids in `ids`.
  virtual void encode_embed(View ids, int T) = 0;
  // dst[r, :row_bytes] ← src[r, :row_bytes] for r < rows at byte strides (KV growth; multiples of 16 bytes).
  virtual void encode_copy_rows(View src, View dst, int rows, uint64_t row_bytes, uint64_t src_stride,
                                uint64_t dst_stride) = 0;
  // token ← the selection from logits [V] (sampling.h semantics): the first maximum when `sample` is null
  // (plain greedy), else sample's parameters with Philox counter `draws`, reading and updating the penalty
  // tables seen uint8 [V] and counts int32 [V].
  virtual void encode_select(View logits, View token, const SamplingParams* sample, uint64_t draws, View seen,
                             View counts) = 0;
  // Whether decode steps are recorded once and replayed (CUDA graphs): then a decode step's host token goes
  // into its input token slot, which the step embeds from as it does a selected token, so every step reads the
  // same buffers. The Device must order its writes with the work before them (a stream's copies), as the
  // previous step may still be selecting into that slot.
  virtual bool records_steps_once() const { return false; }

  // ---- for the ops
  Encoder& recording();  // the encoder of the command buffer being recorded (throws outside begin/commit)
  View view(Act a) const { return {act_[int(a)].get(), 0}; }
  // Where lm_head's `rows` rows go: one row (a decode step, a prompt's last row) to the logits row of the
  // token slot the step selects into, so a pipelined step's row stays readable while the next step writes
  // the other; more rows to the logits activation (grown on first use: [max_rows, V] f32 is large).
  View logits_rows(int rows);
  GdnStates gdn_states(int layer);  // this chunk or step reads copy `cur` and writes the other
  View k_cache(int layer) const;
  View v_cache(int layer) const;
  int64_t kv_capacity() const;
  // What a step reads and writes besides the activations, for a backend that records a step once and replays
  // it (CUDA graphs): the bound state (serial: distinct for every state ever made, as an address is not), the
  // GDN copy it reads, the token slot it embeds from (token_in) and the one it selects into with its logits
  // row (token_out, the row logits_rows(1) gives), the penalty tables (null until a penalised generation) and
  // whether the generation selects by plain greedy.
  uint64_t state_serial() const;
  int64_t position() const;  // the bound state's
  int gdn_copy() const;
  int token_slot() const { return slot_; }
  View token_in() const { return {tokens_[slot_].get()}; }
  View token_out() const { return {tokens_[slot_ ^ 1].get()}; }
  View row_logits_out() const { return {row_logits_[slot_ ^ 1].get()}; }
  View penalty_seen() const { return {seen_.get()}; }
  View penalty_counts() const { return {counts_.get()}; }
  bool plain_greedy() const { return plain_greedy_; }
  void check_rows(int T, const char* op) const;
  // Keeps a buffer alive until the command buffer being recorded completes (it may read it).
  void retire(std::shared_ptr<Buffer> b) { retired_recording_.push_back(std::move(b)); }
  // Commits what was recorded, waits for it (an in-step CPU wait, counted) and records on in a new command
  // buffer: for ablations that read a result on the CPU in the middle of a step.
  void wait_mid_step();
  std::shared_ptr<Buffer> zeroed(uint64_t bytes, Role role, const std::string& label);
  Phase phase() const { return phase_; }
  const Fusions& fusions() const { return fusions_; }
  std::string tag() const;  // message prefix: "[" + name() + "]"

  const Model& m_;
  const ModelConfig& c_;

 private:
  struct GpuState;
  void encode_growth(GpuState& s);
  void flush_growth(GpuState& s);
  void grow_logits(int rows);
  void wait_until(uint64_t seq);
  void finish();
  Counters since_last_account();

  static constexpr size_t kMaxInFlight = 2;
  std::unique_ptr<Device> dev_;
  int rows_;
  bool pipeline_;
  std::shared_ptr<Buffer> act_[int(Act::count)];
  // Token selection: two slots (a step's input and the token it selects), each with its logits row; the
  // device sampler's penalty tables (seen u8 [V], counts i32 [V]) and the generation's parameters.
  std::shared_ptr<Buffer> tokens_[2], row_logits_[2], seen_, counts_;
  std::array<std::shared_ptr<Buffer>, kMaxInFlight + 1> host_ids_;  // prompt / host token ids, by command buffer
  SamplingParams params_;
  uint64_t draws_ = 0;
  bool plain_greedy_ = true;
  // The last command buffer (by seq) whose selection reads or writes the penalty tables: select_begin waits for
  // it alone before rewriting them, not for prefill chunks still in flight.
  uint64_t tables_used_by_ = 0;
  struct Unread {
    uint64_t seq;  // the command buffer that selects it (0: being recorded)
    int slot;
    Buffer* logits;
  };
  std::deque<Unread> unread_;  // selected tokens not read yet, oldest first
  uint64_t in_step_waits_ = 0;  // CPU waits while this step was being recorded
  // Buffers only the command buffer being recorded uses (old KV buffers that growth copies read, prompt ids):
  // kept alive until it completes (Metal retains what a command buffer binds too).
  std::vector<std::shared_ptr<Buffer>> retired_recording_;
  struct InFlight {
    std::unique_ptr<CommandBuffer> cb;
    uint64_t seq;
    std::vector<std::shared_ptr<Buffer>> retired;
    Phase phase;
  };
  std::deque<InFlight> inflight_;  // committed, not waited for, oldest first
  uint64_t committed_ = 0;
  int slot_ = 0, logit_rows_ = 0, logit_capacity_ = 0;
  Buffer* last_logits_ = nullptr;  // what the last lm_head wrote
  GpuState* s_ = nullptr;
  std::unique_ptr<CommandBuffer> cb_;
  Phase phase_ = Phase::prefill;  // of the chunk or step being recorded (begin())
  Fusions fusions_;               // ... and its fusions
  bool gdn_written_ = false;
  Counters prev_, last_[2], total_[2];
};

}  // namespace lily::gpu
