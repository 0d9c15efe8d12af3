// The CUDA backend (cuda_backend.h): buffers, submission and the ops of schedule/backend.h over the kernels
// of kernels.cuh, on one stream.
//
// Decode graphs: every kernel that depends on the position reads it from pos_dev_ (set before each step) and
// the step's input token from a token slot, so one decode step's launches are the same every step. The first
// decode step of a (state, KV capacity, fusions, selection kernel, GDN copy, token slot) is captured as a CUDA
// graph; later steps replay it, the ops only checking that the schedule calls the same sequence. Token
// selection into the token slot is part of the graph: the first maximum (argmax_kernel) for plain greedy, else
// sample.cuh (penalties, sampling), which reads the generation's parameters, draw counter and penalty tables
// from device memory (select_begin uploads them, the kernel advances the counter and the tables). Which of the
// two is the one thing about selection a graph key must say; every sampled generation on a state replays the
// same graphs, and no token visits the host between steps.
//
// Two steps in flight (pipelines()): each submission reads the token slot and GDN state copy the one before
// wrote and writes the other ones, with its logits in a row of their own; its token also lands in pinned host
// memory, and an event says when. So the engine commits step n + 1 before it reads step n's token (read_token
// waits for that event only), and rollback() undoes step n + 1 by flipping back: its KV row lies past the
// position and is overwritten later. The parities make two graphs of a steady generation.
#include "cuda_backend.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <stdexcept>
#include <type_traits>
#include <unordered_map>

#include "attention_decode.cuh"
#include "flash_attention.cuh"
#include "gdn_chunked.cuh"
#include "gemm.cuh"
#include "kernels.cuh"
#include "sample.cuh"
#include "../gpu/device.h"
#include "../gpu/sample_args.h"

namespace lily::cuda {
namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("[cuda] ") + what + ": " + cudaGetErrorString(e));
}
#define CK(call) check((call), #call)

template <class T>
T* device_alloc(size_t n) {
  void* p = nullptr;
  if (n) CK(cudaMalloc(&p, n * sizeof(T)));
  return static_cast<T*>(p);
}

// The device memory a backend and its states hold, by role, in the ledger gpu/device.h keeps for Metal's
// buffers too (Engine.memory()): their cudaMallocs go through alloc, their cudaFrees through release.
class DeviceMemory {
 public:
  template <class T>
  T* alloc(size_t n, gpu::Role role) {
    T* p = device_alloc<T>(n);
    if (p) {
      std::lock_guard<std::mutex> lock(mu_);
      held_[p] = {role, n * sizeof(T)};
      ledger_.add(role, n * sizeof(T));
    }
    return p;
  }
  void release(void* p) {
    if (!p) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      const auto it = held_.find(p);
      if (it != held_.end()) ledger_.release(it->second.first, it->second.second), held_.erase(it);
    }
    cudaFree(p);
  }
  gpu::MemoryLedger& ledger() { return ledger_; }

 private:
  std::mutex mu_;
  std::unordered_map<void*, std::pair<gpu::Role, uint64_t>> held_;
  gpu::MemoryLedger ledger_;
};

int param_dtype(DType t, const std::string& name) {
  switch (t) {
    case DType::f32: return kF32;
    case DType::bf16: return kBF16;
    case DType::f16: return kF16;
    case DType::u32: break;
  }
  throw std::invalid_argument("[cuda] tensor " + name + ": integer dtype where a float one is needed");
}

struct CudaState final : State {
  // Distinct for every state ever made: what a decode graph is keyed by (a freed state's address comes back).
  const uint64_t serial = next_serial();
  std::vector<__nv_bfloat16*> k, v;     // attention layers: [n_kv, capacity, d]
  std::vector<float*> conv[2], rec[2];  // GDN layers, two copies: [k_c - 1, C], [n_v, d_k, d_v]
  int cur = 0;                          // the copy holding the state at pos; a submission writes the other
  bool undoable = false;                // the last submission on it was a decode step (rollback)
  std::shared_ptr<DeviceMemory> mem;    // where its buffers come from (the backend's: a state may outlive it)
  explicit CudaState(std::shared_ptr<DeviceMemory> m) : mem(std::move(m)) {}
  static uint64_t next_serial() {
    static uint64_t n = 0;
    return ++n;
  }
  ~CudaState() override {
    for (auto* vec : {&k, &v})
      for (auto* p : *vec) mem->release(p);
    for (int c = 0; c < 2; ++c)
      for (auto* vec : {&conv[c], &rec[c]})
        for (auto* p : *vec) mem->release(p);
  }
};

class CudaBackend final : public Backend, public gpu::MemoryReport {
 public:
  CudaBackend(const Model& m, int max_rows, bool pipeline)
      : m_(m), c_(m.config()), rows_(max_rows), pipeline_(pipeline) {
    if (max_rows <= 0) throw std::invalid_argument("[cuda] max_rows must be positive");
    const std::string why = unavailable_reason();
    if (!why.empty()) throw std::runtime_error("[cuda] " + why);
    check_geometry();
    CK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    int device = 0;
    CK(cudaGetDevice(&device));
    CK(cudaDeviceGetAttribute(&sms_, cudaDevAttrMultiProcessorCount, device));
    const char* per_sm = std::getenv("LILY_CUDA_DECODE_BLOCKS_PER_SM");
    slots_ = decode_slots(sms_, per_sm && *per_sm ? std::atoi(per_sm) : kDecodeBlocksPerSm);
    CK(allow_decode_smem());
    CK(allow_attention_decode_smem());
    const auto experts = by_cols(c_.hidden, [](auto U) { return moe_decode_kernel<decltype(U)::value>; });
    if (!moe_decode_fits(experts, slots_, sms_))
      throw std::runtime_error("[cuda] the experts' decode kernel: " + std::to_string(slots_) +
                               " blocks do not fit this GPU at once (LILY_CUDA_DECODE_BLOCKS_PER_SM=1: one an SM)");
    decode_order_ = &DecodeOrder::of(device);
    upload_weights();
    for (int a = 0; a < int(Act::count); ++a) {
      width_[a] = act_width(c_, Act(a));
      if (a != int(Act::logits)) act_[a] = scratch<float>(size_t(rows_) * width_[a]);  // logits_ instead
    }
    grow_logits(1);
    const int K = c_.top_k, E = c_.experts, TK = rows_ * K, H = c_.hidden, I = c_.moe_inter;
    imax_ = std::max(I, c_.shared_inter);
    qbuf_ = scratch<float>(size_t(rows_) * c_.n_q * c_.head_dim);
    conv_out_ = scratch<float>(size_t(rows_) * c_.conv_dim());
    gdn_packs_ = scratch<float>(size_t((rows_ + kGdnChunk - 1) / kGdnChunk) * c_.lin_nv *
                                gdn_pack_floats(c_.lin_dk, c_.lin_dv));
    attn_part_ = scratch<float>(attention_part_floats(c_.n_q, c_.head_dim));
    router_ = scratch<float>(size_t(rows_) * E);
    shared_logit_ = scratch<float>(rows_);
    route_ids_ = scratch<int32_t>(TK);
    route_w_ = scratch<float>(TK);
    counts_ = scratch<int>(E);
    offsets_ = scratch<int>(E);
    perm_ = scratch<int>(TK);
    inv_ = scratch<int>(TK);
    g_ = scratch<float>(size_t(TK) * imax_);
    u_ = scratch<float>(size_t(TK) * imax_);
    hbuf_ = scratch<float>(size_t(TK) * imax_);
    ybuf_ = scratch<float>(size_t(TK) * H);
    sy_ = scratch<float>(size_t(rows_) * H);
    tokens_ = mem_->alloc<int32_t>(rows_, gpu::Role::io);
    tok_slots_ = mem_->alloc<int32_t>(2, gpu::Role::io);
    CK(cudaHostAlloc(reinterpret_cast<void**>(&host_tok_), 2 * sizeof(int32_t), cudaHostAllocDefault));
    for (cudaEvent_t& e : done_) CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    argmax_slot_ = scratch<ArgmaxSlot>(1);
    CK(cudaMemset(argmax_slot_, 0, sizeof(ArgmaxSlot)));
    moe_counts_ = scratch<unsigned>(kMoeCounts);
    CK(cudaMemset(moe_counts_, 0, kMoeCounts * sizeof(unsigned)));
    pos_dev_ = scratch<int64_t>(1);
    sample_args_dev_ = mem_->alloc<SampleArgs>(1, gpu::Role::io);
    seen_dev_ = mem_->alloc<uint8_t>(c_.vocab, gpu::Role::io);
    counts_dev_ = mem_->alloc<int32_t>(c_.vocab, gpu::Role::io);
  }

  ~CudaBackend() override {
    drop_graphs();
    cudaStreamSynchronize(stream_);
    mem_->release(arena_);
    for (float* p : act_) mem_->release(p);
    for (float* p : logits_) mem_->release(p);
    for (cudaEvent_t e : done_) cudaEventDestroy(e);
    cudaFreeHost(host_tok_);
    for (void* p : std::initializer_list<void*>{qbuf_, conv_out_, gdn_packs_, attn_part_, router_, shared_logit_,
                                                route_ids_, route_w_, counts_, offsets_, perm_, inv_, g_, u_, hbuf_,
                                                ybuf_, sy_, tokens_, tok_slots_, pos_dev_, argmax_slot_, sample_args_dev_,
                                                seen_dev_, counts_dev_, moe_counts_})
      mem_->release(p);
    cudaStreamDestroy(stream_);
  }

  std::string name() const override { return "cuda"; }
  int max_rows() const override { return rows_; }
  gpu::Memory memory() const override { return mem_->ledger().memory(); }
  void reset_peak_memory() override { mem_->ledger().reset_peak(); }

  // ---------------------------------------------------------------- state

  std::unique_ptr<State> new_state() override {
    auto s = std::make_unique<CudaState>(mem_);
    s->k.assign(c_.layers, nullptr);
    s->v.assign(c_.layers, nullptr);
    for (int c = 0; c < 2; ++c) {
      s->conv[c].assign(c_.layers, nullptr);
      s->rec[c].assign(c_.layers, nullptr);
      for (int i = 0; i < c_.layers; ++i) {
        if (c_.is_attention(i)) continue;
        s->conv[c][i] = mem_->alloc<float>(conv_size(), gpu::Role::state);
        s->rec[c][i] = mem_->alloc<float>(rec_size(), gpu::Role::state);
        CK(cudaMemsetAsync(s->conv[c][i], 0, conv_size() * 4, stream_));
        CK(cudaMemsetAsync(s->rec[c][i], 0, rec_size() * 4, stream_));
      }
    }
    CK(cudaStreamSynchronize(stream_));
    return s;
  }

  // The KV cache grows in steps of 1024 rows (each growth re-captures the decode graph), heads copied over.
  void reserve(State& st, int64_t tokens) override {
    auto& s = static_cast<CudaState&>(st);
    if (tokens <= s.capacity) return;
    const int64_t cap = (tokens + 1023) / 1024 * 1024, d = c_.head_dim;
    for (int i = 0; i < c_.layers; ++i) {
      if (!c_.is_attention(i)) continue;
      for (auto* cache : {&s.k[i], &s.v[i]}) {
        __nv_bfloat16* grown = mem_->alloc<__nv_bfloat16>(size_t(c_.n_kv) * cap * d, gpu::Role::kv);
        if (s.capacity && s.pos)
          CK(cudaMemcpy2DAsync(grown, cap * d * 2, *cache, s.capacity * d * 2, s.pos * d * 2, c_.n_kv,
                               cudaMemcpyDeviceToDevice, stream_));
        CK(cudaStreamSynchronize(stream_));
        mem_->release(*cache);
        *cache = grown;
      }
    }
    s.capacity = cap;
  }

  std::unique_ptr<State> clone_state(const State& st) override {
    const auto& s = static_cast<const CudaState&>(st);
    auto out = std::unique_ptr<CudaState>(static_cast<CudaState*>(new_state().release()));
    reserve(*out, s.capacity);
    const int64_t d = c_.head_dim;
    for (int i = 0; i < c_.layers; ++i) {
      if (c_.is_attention(i)) {
        for (auto [dst, src] : {std::pair{out->k[i], s.k[i]}, std::pair{out->v[i], s.v[i]}})
          CK(cudaMemcpyAsync(dst, src, size_t(c_.n_kv) * s.capacity * d * 2, cudaMemcpyDeviceToDevice, stream_));
      } else {
        CK(cudaMemcpyAsync(out->conv[0][i], s.conv[s.cur][i], conv_size() * 4, cudaMemcpyDeviceToDevice, stream_));
        CK(cudaMemcpyAsync(out->rec[0][i], s.rec[s.cur][i], rec_size() * 4, cudaMemcpyDeviceToDevice, stream_));
      }
    }
    CK(cudaStreamSynchronize(stream_));
    out->pos = s.pos;
    return out;
  }

  void bind(State* s) override { s_ = static_cast<CudaState*>(s); }

  // Session files: KV rows [0, pos) of each head in bf16 (as held), conv and recurrent state in f32.
  std::vector<StateTensor> export_state(const State& st) override {
    const auto& s = static_cast<const CudaState&>(st);
    CK(cudaStreamSynchronize(stream_));
    std::vector<StateTensor> out;
    const int64_t d = c_.head_dim;
    for (int i = 0; i < c_.layers; ++i) {
      const std::string p = "layers." + std::to_string(i) + ".";
      if (c_.is_attention(i)) {
        for (auto [nm, cache] : {std::pair{"k", s.k[i]}, std::pair{"v", s.v[i]}}) {
          StateTensor t{p + nm, "bf16", {c_.n_kv, s.pos, d}, std::vector<uint8_t>(size_t(c_.n_kv) * s.pos * d * 2)};
          if (s.pos)
            CK(cudaMemcpy2D(t.data.data(), s.pos * d * 2, cache, s.capacity * d * 2, s.pos * d * 2, c_.n_kv,
                            cudaMemcpyDeviceToHost));
          out.push_back(std::move(t));
        }
      } else {
        StateTensor cv{p + "conv", "f32", {c_.conv_kernel - 1, c_.conv_dim()}, std::vector<uint8_t>(conv_size() * 4)};
        StateTensor rc{p + "rec", "f32", {c_.lin_nv, c_.lin_dk, c_.lin_dv}, std::vector<uint8_t>(rec_size() * 4)};
        CK(cudaMemcpy(cv.data.data(), s.conv[s.cur][i], cv.data.size(), cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(rc.data.data(), s.rec[s.cur][i], rc.data.size(), cudaMemcpyDeviceToHost));
        out.push_back(std::move(cv));
        out.push_back(std::move(rc));
      }
    }
    return out;
  }

  void import_state(State& st, int64_t pos, const std::vector<StateTensor>& tensors) override {
    auto& s = static_cast<CudaState&>(st);
    if (pos < 0) throw std::invalid_argument("[cuda] import_state: negative position");
    auto find = [&](const std::string& name, const char* dtype, std::vector<int64_t> shape,
                    size_t elem) -> const StateTensor& {
      for (const auto& t : tensors)
        if (t.name == name) {
          size_t n = 1;
          for (auto x : shape) n *= size_t(x);
          if (t.dtype != dtype || t.shape != shape || t.data.size() != n * elem)
            throw std::invalid_argument("[cuda] state tensor '" + name + "' has the wrong dtype, shape or size (want " +
                                        dtype + ")");
          return t;
        }
      throw std::invalid_argument("[cuda] state tensor '" + name + "' is missing");
    };
    s.pos = 0;
    reserve(s, std::max<int64_t>(pos, 1));
    const int64_t d = c_.head_dim;
    for (int i = 0; i < c_.layers; ++i) {
      const std::string p = "layers." + std::to_string(i) + ".";
      if (c_.is_attention(i)) {
        for (auto [nm, cache] : {std::pair{"k", s.k[i]}, std::pair{"v", s.v[i]}}) {
          const auto& t = find(p + nm, "bf16", {c_.n_kv, pos, d}, 2);
          if (pos)
            CK(cudaMemcpy2D(cache, s.capacity * d * 2, t.data.data(), pos * d * 2, pos * d * 2, c_.n_kv,
                            cudaMemcpyHostToDevice));
        }
      } else {
        const auto& cv = find(p + "conv", "f32", {c_.conv_kernel - 1, c_.conv_dim()}, 4);
        const auto& rc = find(p + "rec", "f32", {c_.lin_nv, c_.lin_dk, c_.lin_dv}, 4);
        CK(cudaMemcpy(s.conv[s.cur][i], cv.data.data(), cv.data.size(), cudaMemcpyHostToDevice));
        CK(cudaMemcpy(s.rec[s.cur][i], rc.data.data(), rc.data.size(), cudaMemcpyHostToDevice));
      }
    }
    s.pos = pos;
    s.undoable = false;
  }

  // ---------------------------------------------------------------- submission

  bool pipelines() const override { return pipeline_; }
  int gdn_state_copies() const override { return 2; }

  // Undoes the last decode step on st, which may still be in flight (see the top of the file).
  void rollback(State& st) override {
    auto& s = static_cast<CudaState&>(st);
    if (!s.undoable || s.pos < 1) throw std::logic_error("[cuda] rollback(): the state's last step was not a decode step");
    s.cur ^= 1;
    s.pos -= 1;
    s.undoable = false;
    in_ ^= 1;
    if (!unread_.empty() && unread_.back().seq == committed_) unread_.pop_back();
  }

  void begin(Phase phase, const Fusions& f) override {
    if (!s_) throw std::logic_error("[cuda] begin() with no bound state");
    phase_ = phase;
    const int64_t pos = s_->pos;
    CK(cudaMemcpyAsync(pos_dev_, &pos, sizeof pos, cudaMemcpyHostToDevice, stream_));
    ops_ = 0;
    out_ = in_ ^ 1;
    selects_ = false;
    mode_ = Mode::direct;
    if (phase != Phase::decode) return;
    graph_key_ = GraphKey{s_->serial, s_->capacity, fusion_bits(f), sampled_, s_->cur, in_};
    graph_ = nullptr;
    for (auto& [key, exec] : graphs_)
      if (key == graph_key_) graph_ = &exec;
    mode_ = graph_ ? Mode::replay : Mode::capture_pending;
  }

  void commit() override {
    if (phase_ == Phase::decode && mode_ != Mode::direct) {
      // The selection is part of every decode graph. A step that does not select (Engine::logits / feed, only
      // between generations: one request at a time) thus still selects, as the last generation did: it
      // overwrites the token slot, which the next embed writes first, and a sampled one advances the counter
      // and tables, which the next sampled generation's select_begin replaces.
      if (mode_ == Mode::capturing) {
        launch_selection();
        cudaGraph_t graph = nullptr;
        CK(cudaStreamEndCapture(stream_, &graph));
        cudaGraphExec_t exec = nullptr;
        const cudaError_t e = cudaGraphInstantiate(&exec, graph, 0);
        cudaGraphDestroy(graph);
        check(e, "cudaGraphInstantiate (decode step)");
        // graphs of another state, capacity, fusions or selection kernel are not replayed again
        if (!graphs_.empty() && !graphs_[0].first.same_step(graph_key_)) drop_graphs();
        graphs_.emplace_back(graph_key_, exec);
        graph_ = &graphs_.back().second;
        graph_ops_ = ops_;
      } else if (ops_ != graph_ops_) {
        throw std::logic_error("[cuda] decode step called " + std::to_string(ops_) + " ops, its graph holds " +
                               std::to_string(graph_ops_));
      }
      launch_decode_graph();
      mode_ = Mode::direct;
    }
    CK(cudaGetLastError());
    ++committed_;
    if (selects_) {
      if (unread_.size() == kDone) throw std::logic_error("[cuda] more steps in flight than tokens read");
      cudaEvent_t done = done_[selected_++ % kDone];  // not one an unread token still waits on
      CK(cudaEventRecord(done, stream_));
      unread_.push_back({committed_, out_, done});
    }
    in_ = out_;
    s_->cur ^= 1;
    s_->undoable = phase_ == Phase::decode;
  }

  void read_logits(float* out, int rows) override {
    CK(cudaMemcpyAsync(out, logits_[in_], size_t(rows) * c_.vocab * 4, cudaMemcpyDeviceToHost, stream_));
    CK(cudaStreamSynchronize(stream_));
  }

  // ---------------------------------------------------------------- ops

  void embed(const int32_t* tokens, int T) override {
    check_rows(T, "embed");
    for (int t = 0; t < T; ++t)
      if (tokens[t] < 0 || tokens[t] >= c_.vocab)
        throw std::out_of_range("[embed] token id " + std::to_string(tokens[t]) + " outside the vocabulary [0, " +
                                std::to_string(c_.vocab) + ")");
    if (phase_ == Phase::decode && mode_ != Mode::direct) {
      // the graph embeds from the token slot
      CK(cudaMemcpyAsync(tok_slots_ + in_, tokens, 4, cudaMemcpyHostToDevice, stream_));
      embed_selected();
      return;
    }
    CK(cudaMemcpyAsync(tokens_, tokens, size_t(T) * 4, cudaMemcpyHostToDevice, stream_));
    if (!op()) return;
    launch_dependent(embed_kernel, T, 64, 0, embed_, tokens_, act(Act::x), c_.hidden, c_.vocab);
  }

  void embed_selected() override {
    if (mode_ == Mode::capture_pending) {
      CK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
      mode_ = Mode::capturing;
    }
    if (!op()) return;
    launch_dependent(embed_kernel, 1, 64, 0, embed_, tok_slots_ + in_, act(Act::x), c_.hidden, c_.vocab);
  }

  void rmsnorm(Act in, Act out, const Vec& w, int T) override {
    if (!op()) return;
    launch_dependent(rmsnorm_kernel, T, 256, 0, act(in), width(in), act(out), width(out), vec(w), int(w.size()),
                     c_.rms_eps);
  }

  void project(Act in, Act out, const Linear& W, int T, bool accumulate) override {
    check_rows(T, W.name.c_str());
    if (!op()) return;
    matmul(W, act(in), width(in), T, act(out), width(out), accumulate);
  }

  void norm_project(Act in, const Vec& w, std::initializer_list<Projection> ps) override {
    if (!op()) return;
    GemvJobs jobs;
    for (const Projection& p : ps) add_job(jobs, *p.W, act(p.out));
    gemv(jobs, act(in), vec(w), nullptr);
  }

  void norm_lm_head(int row) override {
    if (!op()) return;
    GemvJobs jobs;
    add_job(jobs, m_.lm_head, logits_[out_]);
    gemv(jobs, act(Act::x) + int64_t(row) * c_.hidden, vec(m_.norm), nullptr);
  }

  void lm_head(int first, int rows) override {
    check_rows(rows, "lm_head");
    if (!op()) return;
    grow_logits(rows);
    launch_dependent(rmsnorm_kernel, rows, 256, 0, act(Act::x) + int64_t(first) * c_.hidden, c_.hidden,
                     act(Act::xn), c_.hidden, vec(m_.norm), c_.hidden, c_.rms_eps);
    matmul(m_.lm_head, act(Act::xn), c_.hidden, rows, logits_[out_], c_.vocab, false);
  }

  void attn_prepare(int layer, int T, int64_t pos) override {
    check_pos(pos);
    if (!op()) return;
    const AttentionWeights& A = m_.layers[layer].attn;
    const int d = c_.head_dim;
    launch_dependent(attn_prepare_kernel, dim3(T, (c_.n_q + c_.n_kv + kPrepareWarps - 1) / kPrepareWarps),
        kPrepareWarps * 32, kPrepareWarps * d * 4, act(Act::q_gate), act(Act::k), act(Act::v), vec(A.q_norm),
        vec(A.k_norm), qbuf_, s_->k[layer], s_->v[layer], s_->capacity, pos_dev_, c_.n_q, c_.n_kv, d, c_.rotary_dim,
        c_.rope_theta, c_.rms_eps);
  }

  void attn_prefill(int layer, int T, int64_t pos) override {
    check_pos(pos);
    if (!op()) return;
    by_head_dim(c_.head_dim, [&](auto D) {
      launch_flash_attention<D()>(qbuf_, s_->k[layer], s_->v[layer], s_->capacity, act(Act::q_gate), act(Act::mix),
                                  width(Act::mix), T, c_.n_q, c_.n_kv, pos_dev_, stream_);
    });
  }

  // Split-KV attention for the one row (attention_decode.cuh), then the splits merged and gated. (No
  // attn_prepare_decode of its own: the preparation inside the split kernel measured slower than
  // attn_prepare_kernel before it, so Backend's, the two ops, serves.)
  void attn_decode(int layer, int64_t pos) override {
    check_pos(pos);
    if (!op()) return;
    by_head_dim(c_.head_dim, [&](auto D) {
      launch_dependent(attention_kernel<D()>, c_.n_kv * kDecodeSplits / kAttnWarps, kAttnWarps * 32,
                       attn_smem_bytes<D()>(), qbuf_, s_->k[layer], s_->v[layer], s_->capacity, pos_dev_, c_.n_q,
                       c_.n_kv, attn_part_);
    });
    launch_dependent(attention_combine_kernel, attention_combine_grid(c_.n_q, c_.head_dim), kCombineWarps * 32, 0,
                     attn_part_, c_.head_dim, act(Act::q_gate), act(Act::mix));
  }

  // The chunk's scan: conv over all rows at once, q/k norms and gates over all rows, the recurrence in chunks of
  // 64 rows (gdn_chunked.cuh), the gated norm over all rows.
  void gdn_scan(int layer, int T) override {
    check_rows(T, "gdn_scan");
    if (!op()) return;
    const DeltaNetWeights& G = m_.layers[layer].gdn;
    const int C = c_.conv_dim(), nk = c_.lin_nk, nv = c_.lin_nv, dv = c_.lin_dv;
    const int64_t cells = int64_t(T) * C;
    const int in = s_->cur, out = in ^ 1;
    gdn_conv_rows_kernel<<<int((cells + 255) / 256), 256, 0, stream_>>>(act(Act::qkv), conv_out_,
                                                                       s_->conv[in][layer], vec(G.conv), T, C,
                                                                       c_.conv_kernel);
    gdn_conv_state_kernel<<<(C + 127) / 128, 128, 0, stream_>>>(act(Act::qkv), s_->conv[in][layer],
                                                               s_->conv[out][layer], T, C, c_.conv_kernel);
    // the chunked scan updates the state in place: in the copy out
    CK(cudaMemcpyAsync(s_->rec[out][layer], s_->rec[in][layer], rec_size() * 4, cudaMemcpyDeviceToDevice, stream_));
    const int warps = T * (2 * nk + 1);
    gdn_prepare_kernel<<<(warps + 3) / 4, 128, 0, stream_>>>(conv_out_, act(Act::beta), act(Act::alpha),
                                                            vec(G.A_log), vec(G.dt_bias), T, C, nk, nv, c_.lin_dk);
    auto scan = [&](auto dk) {
      launch_gdn_chunked<decltype(dk)::value>(conv_out_, act(Act::beta), act(Act::alpha), gdn_packs_,
                                              s_->rec[out][layer], act(Act::mix), width(Act::mix), T, C, nk, nv, dv,
                                              stream_);
    };
    switch (c_.lin_dk) {
      case 32: scan(std::integral_constant<int, 32>{}); break;
      case 64: scan(std::integral_constant<int, 64>{}); break;
      default: scan(std::integral_constant<int, 128>{}); break;
    }
    gdn_gated_norm_kernel<<<T * nv, dv, 0, stream_>>>(act(Act::mix), width(Act::mix), act(Act::z), vec(G.norm), nv,
                                                     dv, c_.rms_eps);
  }

  // One row: the conv and everything after it in one kernel, a cluster of blocks a value head (gdn_step_kernel).
  void gdn_step(int layer) override {
    if (!op()) return;
    const DeltaNetWeights& G = m_.layers[layer].gdn;
    const int in = s_->cur, out = in ^ 1;
    auto step = [&](auto kernel) {
      const int S = gdn_step_cluster(c_.lin_dv);
      CK(cuda::launch_dependent(stream_, {S}, kernel, c_.lin_nv * S, kGdnStepThreads, 0, act(Act::qkv),
                                s_->conv[in][layer], s_->conv[out][layer], vec(G.conv), act(Act::beta),
                                act(Act::alpha), act(Act::z), s_->rec[in][layer], s_->rec[out][layer],
                                vec(G.A_log), vec(G.dt_bias), vec(G.norm), act(Act::mix), c_.conv_dim(),
                                c_.conv_kernel, c_.lin_nk, c_.lin_nv, c_.lin_dv, c_.rms_eps));
    };
    switch (c_.lin_dk) {
      case 32: step(gdn_step_kernel<32>); break;
      case 64: step(gdn_step_kernel<64>); break;
      default: step(gdn_step_kernel<128>); break;
    }
  }

  // The routing ops leave the router's logits; the op that consumes them takes the top-k (moe_prefill with a
  // kernel of its own, moe_decode inside the experts' gate/up kernel).
  void moe_route(int layer, int T) override {
    check_rows(T, "moe_route");
    if (!op()) return;
    const MoeWeights& M = m_.layers[layer].moe;
    matmul(M.router, act(Act::xn), c_.hidden, T, router_, c_.experts, false);
    matmul(M.shared_gate, act(Act::xn), c_.hidden, T, shared_logit_, 1, false);
  }

  // Nothing is launched here: moe_decode's experts kernel computes the norm and the logits itself, a kernel
  // boundary fewer (only moe_decode may follow, the op's contract).
  void moe_norm_route(int layer, const Vec& w) override {
    if (!op()) return;
    route_layer_ = layer, route_norm_ = vec(w);
  }

  void moe_prefill(int layer, int T) override {
    check_rows(T, "moe_prefill");
    if (!op()) return;
    const MoeWeights& M = m_.layers[layer].moe;
    const int K = c_.top_k, E = c_.experts, H = c_.hidden, I = c_.moe_inter, Is = c_.shared_inter, TK = T * K;
    topk_kernel<<<T, 32, 0, stream_>>>(router_, E, K, route_ids_, route_w_);
    moe_group_kernel<<<1, 1024, 2 * E * sizeof(int), stream_>>>(route_ids_, TK, E, counts_, offsets_, perm_, inv_);
    const float* xn = act(Act::xn);
    grouped(M.gate, xn, H, T, perm_, K, g_, I);
    grouped(M.up, xn, H, T, perm_, K, u_, I);
    swiglu(g_, u_, hbuf_, int64_t(TK) * I);
    grouped(M.down, hbuf_, I, T, nullptr, 1, ybuf_, H);
    matmul(M.shared_gate_proj, xn, H, T, g_, Is, false);
    matmul(M.shared_up, xn, H, T, u_, Is, false);
    swiglu(g_, u_, hbuf_, int64_t(T) * Is);
    matmul(M.shared_down, hbuf_, Is, T, sy_, H, false);
    moe_combine_kernel<<<T, 256, 0, stream_>>>(act(Act::x), ybuf_, sy_, shared_logit_, route_w_, inv_, K, H);
  }

  void moe_decode(int layer) override {
    if (!op()) return;
    const MoeWeights& M = m_.layers[layer].moe;
    const int H = c_.hidden;
    MoeDecode md{lin(M.gate), lin(M.up), lin(M.shared_gate_proj), lin(M.shared_up), lin(M.down),
                 lin(M.shared_down), c_.top_k, c_.experts, imax_};
    const bool route = route_layer_ == layer;  // moe_norm_route left the route to this op
    route_layer_ = -1;
    if (route) md.router = lin(M.router), md.shared_router = lin(M.shared_gate);
    const MoeGrid g = moe_decode_grid(md, H, slots_, sms_);
    launch_dependent(by_cols(H, [](auto U) { return moe_decode_kernel<decltype(U)::value>; }), g.blocks,
                     kDecodeThreads, g.smem, md, act(route ? Act::x : Act::xn), act(Act::x), H,
                     route ? route_norm_ : nullptr, c_.rms_eps, router_, shared_logit_, moe_counts_, route_ids_,
                     route_w_, hbuf_, g.stages, md.gate_up_stage_bytes(), g.ring_bytes, g.down_rows);
  }

  // ---------------------------------------------------------------- token selection

  // A sampled or penalised generation's SampleArgs (parameters and draw counter) and penalty tables into the
  // device memory sample.cuh reads. Nothing of the host Sampler is needed after this: the kernel keeps the
  // counter and tables in step on the device, and logprobs come from the raw logits (Sampler::fill_logprobs).
  // The tables are read only under a penalty, so without one they are left as they are.
  void select_begin(const Sampler& sampler) override {
    selecting_ = true;
    unread_.clear();
    sampled_ = !sampler.params().greedy() || sampler.params().penalised();
    if (!sampled_) return;
    const SampleArgs args = gpu::sample_args(sampler.params(), c_.vocab, sampler.draws());
    CK(cudaMemcpyAsync(sample_args_dev_, &args, sizeof args, cudaMemcpyHostToDevice, stream_));
    std::vector<int32_t> counts;
    if (sampler.params().penalised()) {
      counts.assign(size_t(c_.vocab), 0);
      for (const auto& [token, n] : sampler.counts()) counts[size_t(token)] = n;
      CK(cudaMemcpyAsync(seen_dev_, sampler.seen().data(), size_t(c_.vocab), cudaMemcpyHostToDevice, stream_));
      CK(cudaMemcpyAsync(counts_dev_, counts.data(), counts.size() * 4, cudaMemcpyHostToDevice, stream_));
    }
    CK(cudaStreamSynchronize(stream_));  // the copies read `args` and `counts`, locals
  }

  void select_token() override {
    if (!selecting_) throw std::logic_error("[cuda] select_token() before select_begin()");
    selects_ = true;
    if (phase_ == Phase::decode && mode_ != Mode::direct) return;  // in the graph (commit)
    launch_selection();
  }

  // The oldest unread step's token from pinned host memory once its event has passed; the steps after it stay
  // queued. Its logits row is its own (the next step writes the other), copied on the default stream, which
  // does not wait for stream_.
  int32_t read_token(float* logits) override {
    if (unread_.empty()) throw std::logic_error("[cuda] read_token() with no step's token unread");
    const Unread u = unread_.front();
    unread_.pop_front();
    CK(cudaEventSynchronize(u.done));
    const int32_t t = static_cast<volatile int32_t*>(host_tok_)[u.slot];
    if (logits) CK(cudaMemcpy(logits, logits_[u.slot], size_t(c_.vocab) * 4, cudaMemcpyDeviceToHost));
    return t;
  }

 private:
  // decode_slots' blocks an SM; $LILY_CUDA_DECODE_BLOCKS_PER_SM overrides it (benchmarks compare the two)
  static constexpr int kDecodeBlocksPerSm = 2;
  enum class Mode { direct, capture_pending, capturing, replay };
  struct GraphKey {
    uint64_t state = 0;  // CudaState::serial
    int64_t capacity = 0;
    uint32_t fusions = 0;
    bool sampled = false;  // sample_token_kernel selects, not argmax_kernel
    int gdn = 0, slot = 0;  // the GDN state copy and token slot the step reads
    bool same_step(const GraphKey& o) const {
      return state == o.state && capacity == o.capacity && fusions == o.fusions && sampled == o.sampled;
    }
    bool operator==(const GraphKey& o) const { return same_step(o) && gdn == o.gdn && slot == o.slot; }
  };
  struct Unread {
    uint64_t seq;  // the submission's number (committed_)
    int slot;      // its token slot and logits row
    cudaEvent_t done;
  };
  static constexpr size_t kDone = 4;  // events of submissions whose token is unread (two in a generation)
  static uint32_t fusion_bits(const Fusions& f) {
    const bool bits[] = {f.norm_project, f.route, f.attn_prepare, f.gdn_step, f.expert_swiglu, f.expert_combine,
                         f.dequant};
    uint32_t v = 0;
    for (size_t i = 0; i < sizeof bits; ++i) v |= uint32_t(bits[i]) << i;
    return v;
  }

  // The token of logits row 0 into the submission's token slot, and from there into pinned host memory.
  void launch_selection() {
    if (sampled_)
      launch_dependent(sample_token_kernel, 1, LILY_SAMPLE_THREADS, 0, sample_args_dev_, logits_[out_], seen_dev_,
                       counts_dev_, tok_slots_ + out_);
    else
      launch_dependent(argmax_kernel, std::min(sms_, (c_.vocab + 1023) / 1024), 1024, 0, logits_[out_], c_.vocab,
                       argmax_slot_, tok_slots_ + out_);
    CK(cudaMemcpyAsync(host_tok_ + out_, tok_slots_ + out_, sizeof(int32_t), cudaMemcpyDeviceToHost, stream_));
  }

  // A decode graph, after every decode graph that any CudaBackend of the process launched before it on this
  // device: moe_decode_kernel's blocks wait on each other (kernels.cuh), so two of them must never share the GPU,
  // each holding part of it — which two backends' streams could otherwise make happen.
  void launch_decode_graph() {
    std::lock_guard<std::mutex> lock(decode_order_->m);
    CK(cudaStreamWaitEvent(stream_, decode_order_->last, 0));
    CK(cudaGraphLaunch(*graph_, stream_));
    CK(cudaEventRecord(decode_order_->last, stream_));
  }

  void drop_graphs() {
    for (auto& [key, exec] : graphs_) cudaGraphExecDestroy(exec);
    graphs_.clear();
    graph_ = nullptr;
  }

  // Counts the op; false when a replayed graph already holds its launches.
  bool op() {
    ++ops_;
    if (mode_ == Mode::capture_pending)
      throw std::logic_error("[cuda] a decode step must start with embed or embed_selected");
    return mode_ != Mode::replay;
  }

  void check_geometry() const {
    auto need = [](bool ok, const std::string& what) {
      if (!ok) throw std::invalid_argument("[cuda] unsupported geometry: " + what);
    };
    const int d = c_.head_dim;
    need(d == 32 || d == 64 || d == 128 || d == 256, "head_dim " + std::to_string(d) + " (32, 64, 128 or 256)");
    need(c_.n_q % c_.n_kv == 0 && c_.n_q / c_.n_kv <= kMaxGroup,
         "n_q / n_kv = " + std::to_string(c_.n_q / std::max(c_.n_kv, 1)) + " (at most 8 query heads per KV head)");
    need(c_.lin_dk == 32 || c_.lin_dk == 64 || c_.lin_dk == 128, "linear_key_head_dim " + std::to_string(c_.lin_dk));
    need(c_.lin_dv % kGdnStepCols == 0 && c_.lin_dv <= kGdnStepMaxCluster * kGdnStepCols,
         "linear_value_head_dim " + std::to_string(c_.lin_dv) + " (a multiple of 32, at most 512)");
    need(c_.conv_kernel >= 1 && c_.conv_kernel <= 8, "linear_conv_kernel_dim " + std::to_string(c_.conv_kernel));
    need(c_.top_k <= kMaxTopK && c_.top_k <= c_.experts && c_.experts <= 32 * kTopkPerLane,
         "num_experts_per_tok " + std::to_string(c_.top_k) + " (at most 32 and num_experts), num_experts " +
             std::to_string(c_.experts) + " (at most 512)");
    need(c_.rotary_dim % 2 == 0 && c_.rotary_dim <= d, "rotary_dim " + std::to_string(c_.rotary_dim));
  }

  // ---- weights: every Linear's tensors and every Vec (fp32) copied once into one device allocation, each at a
  // 256-byte boundary (the kernels' 16-byte vector loads need 16): one allocation, so the weights a step
  // touches lie in as few pages as they can. Two walks: the first only sizes the allocation.
  void upload_weights() {
    sizing_ = true;
    upload_walk();
    arena_ = mem_->alloc<uint8_t>(arena_used_ + 256, gpu::Role::weights);  // + a tile copy's rounding
    sizing_ = false;
    arena_used_ = 0;
    upload_walk();
    CK(cudaDeviceSynchronize());
  }

  void upload_walk() {
    embed_ = lin_upload(m_.embed);
    lin_upload(m_.lm_head);
    vec_upload(m_.norm);
    for (const LayerWeights& L : m_.layers) {
      for (const Vec* v : {&L.input_norm, &L.post_norm, &L.attn.q_norm, &L.attn.k_norm, &L.gdn.conv, &L.gdn.A_log,
                           &L.gdn.dt_bias, &L.gdn.norm})
        if (v->size()) vec_upload(*v);
      for (const Linear* W : {&L.attn.q, &L.attn.k, &L.attn.v, &L.attn.o, &L.gdn.qkv, &L.gdn.z, &L.gdn.b, &L.gdn.a,
                              &L.gdn.out, &L.moe.router, &L.moe.gate, &L.moe.up, &L.moe.down,
                              &L.moe.shared_gate_proj, &L.moe.shared_up, &L.moe.shared_down, &L.moe.shared_gate})
        if (W->w) lin_upload(*W);
    }
  }

  const uint8_t* copy_span(const uint8_t* host, uint64_t bytes) {
    const uint64_t at = (arena_used_ + 255) / 256 * 256;
    arena_used_ = at + bytes;
    if (sizing_) return nullptr;
    CK(cudaMemcpy(arena_ + at, host, bytes, cudaMemcpyHostToDevice));
    return arena_ + at;
  }

  LinDev lin_upload(const Linear& W) {
    if (W.cols % 32 != 0)
      throw std::invalid_argument("[cuda] weight " + W.name + ": " + std::to_string(W.cols) +
                                  " columns, the kernels need a multiple of 32");
    if (W.quantized() && ((W.group != 32 && W.group != 64 && W.group != 128) || (W.bits != 4 && W.bits != 8)))
      throw std::invalid_argument("[cuda] weight " + W.name + ": " + std::to_string(W.bits) + "-bit groups of " +
                                  std::to_string(W.group) + " (4 or 8 bits, groups of 32, 64 or 128 columns)");
    if (!W.quantized() && W.wdtype == DType::u32)
      throw std::invalid_argument("[cuda] weight " + W.name + ": integer dense weight");
    if (W.w_row_bytes % 16 || W.s_row_bytes % 2 || (W.experts > 1 && (W.w_expert_bytes % 16 || W.s_expert_bytes % 16)))
      throw std::invalid_argument("[cuda] weight " + W.name + ": rows or experts not 16-byte aligned (decode copies "
                                  "its weights in 16-byte units)");
    const int64_t E = std::max<int64_t>(W.experts, 1);
    auto span = [&](uint64_t expert_bytes, uint64_t row_bytes) { return (E - 1) * expert_bytes + W.rows * row_bytes; };
    LinDev d;
    d.w = copy_span(W.w, span(W.w_expert_bytes, W.w_row_bytes));
    if (W.quantized()) {
      d.s = copy_span(W.scales, span(W.s_expert_bytes, W.s_row_bytes));
      d.b = copy_span(W.biases, span(W.s_expert_bytes, W.s_row_bytes));
      d.sdt = param_dtype(W.sdtype, W.name);
    } else {
      d.wdt = param_dtype(W.wdtype, W.name);
    }
    d.bits = W.bits, d.group = W.group, d.rows = int(W.rows), d.cols = int(W.cols);
    d.w_row = W.w_row_bytes, d.s_row = W.s_row_bytes, d.w_expert = W.w_expert_bytes, d.s_expert = W.s_expert_bytes;
    lins_[&W] = d;
    return d;
  }

  void vec_upload(const Vec& v) { vecs_[&v] = reinterpret_cast<const float*>(copy_span(
                                      reinterpret_cast<const uint8_t*>(v.data()), v.size() * 4)); }

  const LinDev& lin(const Linear& W) const {
    auto it = lins_.find(&W);
    if (it == lins_.end()) throw std::logic_error("[cuda] weight " + W.name + " was not uploaded");
    return it->second;
  }
  const float* vec(const Vec& v) const {
    auto it = vecs_.find(&v);
    if (it == vecs_.end()) throw std::logic_error("[cuda] parameter " + v.name + " was not uploaded");
    return it->second;
  }

  // ---- launches
  void add_job(GemvJobs& jobs, const Linear& W, float* out) const {
    if (jobs.n == 4) throw std::logic_error("[cuda] more than four projections share one input");
    jobs.W[jobs.n] = lin(W);
    jobs.out[jobs.n] = out;
    ++jobs.n;
  }

  void gemv(GemvJobs& jobs, const float* x, const float* norm, float* xn_out) {
    const int cols = jobs.W[0].cols;
    if (cols > kDecodeRowMax) throw std::logic_error("[cuda] a GEMV row of " + std::to_string(cols) + " columns");
    const uint32_t stage_bytes = plan_gemv(jobs, slots_);
    const DecodeGrid g = decode_grid(jobs.tile_first[jobs.n], stage_bytes, gemv_row_bytes(cols), slots_,
                                     "a GEMV of " + std::to_string(cols) + " columns");
    launch_dependent(by_cols(cols, [](auto U) { return gemv_kernel<decltype(U)::value>; }), g.blocks, kDecodeThreads,
                     g.smem, jobs, x, cols, norm, c_.rms_eps, xn_out, g.stages, stage_bytes);
  }

  // Y (+)= W · X for T rows: a warp-per-row GEMV for one row, the tensor-core GEMM for more.
  void matmul(const Linear& W, const float* X, int ldx, int T, float* Y, int ldy, bool accumulate) {
    if (T == 1) {
      GemvJobs jobs;
      add_job(jobs, W, Y);
      jobs.accumulate = accumulate;
      gemv(jobs, X, nullptr, nullptr);
      return;
    }
    gemm(GemmArgs{lin(W), X, ldx, Y, ldy, T, nullptr, nullptr, nullptr, 1, accumulate, 1}, stream_);
  }

  // The experts' GEMM over the grouped assignment slots (rows of X gathered through `rows` / `div`).
  void grouped(const Linear& W, const float* X, int ldx, int T, const int* rows, int div, float* Y, int ldy) {
    gemm(GemmArgs{lin(W), X, ldx, Y, ldy, T * c_.top_k, counts_, offsets_, rows, div, false, c_.experts}, stream_);
  }

  // The decode path's kernels go out with programmatic dependent launch (the kernels' start_next_kernel /
  // wait_previous_kernel say what each may do early): a GEMV then fetches its weights while the kernel before
  // it drains, instead of a launch latency and a memory latency after it. Kept in the decode graph.
  template <class... P, class... A>
  void launch_dependent(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, A... args) {
    CK(cuda::launch_dependent(stream_, {}, kernel, grid, block, smem, args...));
  }

  void swiglu(const float* g, const float* u, float* h, int64_t n) {
    swiglu_kernel<<<int((n + 255) / 256), 256, 0, stream_>>>(g, u, h, n);
  }

  void grow_logits(int rows) {
    if (rows <= logit_rows_) return;
    CK(cudaStreamSynchronize(stream_));
    for (float*& l : logits_) {
      mem_->release(l);
      l = mem_->alloc<float>(size_t(rows) * c_.vocab, gpu::Role::io);
    }
    logit_rows_ = rows;
    drop_graphs();  // the decode graphs read and select from the logits rows they were captured with
  }

  float* act(Act a) { return act_[int(a)]; }
  int width(Act a) const { return int(width_[int(a)]); }
  template <class T>
  T* scratch(size_t n) {  // a chunk's or a step's intermediates
    return mem_->alloc<T>(n, gpu::Role::activations);
  }
  size_t conv_size() const { return size_t(c_.conv_kernel - 1) * c_.conv_dim(); }
  size_t rec_size() const { return size_t(c_.lin_nv) * c_.lin_dk * c_.lin_dv; }
  void check_rows(int T, const char* op) const {
    if (T < 1 || T > rows_)
      throw std::out_of_range(std::string("[") + op + "] " + std::to_string(T) + " rows, chunk limit is " +
                              std::to_string(rows_));
  }
  void check_pos(int64_t pos) const {
    if (pos != s_->pos)
      throw std::logic_error("[cuda] op at position " + std::to_string(pos) + ", the bound state is at " +
                             std::to_string(s_->pos));
  }

  const Model& m_;
  const ModelConfig& c_;
  const int rows_;
  cudaStream_t stream_ = nullptr;
  std::shared_ptr<DeviceMemory> mem_ = std::make_shared<DeviceMemory>();  // every allocation, by role
  uint8_t* arena_ = nullptr;  // every weight (upload_weights)
  uint64_t arena_used_ = 0;
  bool sizing_ = false;
  std::unordered_map<const Linear*, LinDev> lins_;
  std::unordered_map<const Vec*, const float*> vecs_;
  LinDev embed_;
  int64_t width_[int(Act::count)] = {};
  float* act_[int(Act::count)] = {};
  int logit_rows_ = 0, imax_ = 0, sms_ = 1, slots_ = 1;  // slots_: decode_slots
  float *qbuf_ = nullptr, *conv_out_ = nullptr, *attn_part_ = nullptr, *router_ = nullptr, *shared_logit_ = nullptr;
  float* gdn_packs_ = nullptr;  // gdn_chunked.cuh's per-(chunk, value head) packs for max_rows rows
  int32_t* route_ids_ = nullptr;
  float* route_w_ = nullptr;
  int *counts_ = nullptr, *offsets_ = nullptr, *perm_ = nullptr, *inv_ = nullptr;
  float *g_ = nullptr, *u_ = nullptr, *hbuf_ = nullptr, *ybuf_ = nullptr, *sy_ = nullptr;
  int32_t* tokens_ = nullptr;
  // Submissions: each reads token slot in_ and writes out_ (= in_ ^ 1) with its logits in logits_[out_]; a
  // selecting one's token is copied to host_tok_[out_] and waits in unread_ for read_token.
  int32_t* tok_slots_ = nullptr;  // [2]
  int32_t* host_tok_ = nullptr;   // [2], pinned
  float* logits_[2] = {};         // [logit_rows_, V] each
  int in_ = 0, out_ = 1;
  bool selects_ = false;
  uint64_t committed_ = 0, selected_ = 0;  // submissions, and those of them that selected a token
  cudaEvent_t done_[kDone] = {};
  std::deque<Unread> unread_;
  ArgmaxSlot* argmax_slot_ = nullptr;
  // A device's last decode graph, shared by every CudaBackend of the process on it (launch_decode_graph).
  struct DecodeOrder {
    std::mutex m;
    cudaEvent_t last = nullptr;
    static DecodeOrder& of(int device) {
      struct Registry {
        std::mutex m;
        std::unordered_map<int, DecodeOrder> orders;  // (nodes: references stay valid)
      };
      static Registry& r = *new Registry;  // (never destroyed: backends may outlive static destruction)
      std::lock_guard<std::mutex> lock(r.m);
      DecodeOrder& o = r.orders[device];
      if (!o.last) CK(cudaEventCreateWithFlags(&o.last, cudaEventDisableTiming));
      return o;
    }
  };
  DecodeOrder* decode_order_ = nullptr;
  unsigned* moe_counts_ = nullptr;     // moe_decode_kernel's counts [kMoeCounts]
  int route_layer_ = -1;               // the layer whose moe_decode takes the route (moe_norm_route)
  const float* route_norm_ = nullptr;  // and its post-attention norm
  int64_t* pos_dev_ = nullptr;
  CudaState* s_ = nullptr;
  Phase phase_ = Phase::prefill;
  Mode mode_ = Mode::direct;
  int ops_ = 0, graph_ops_ = 0;
  std::vector<std::pair<GraphKey, cudaGraphExec_t>> graphs_;  // of one (state, capacity, fusions, selection)
  cudaGraphExec_t* graph_ = nullptr;                          // this step's, once captured
  GraphKey graph_key_;
  const bool pipeline_;
  // Token selection: sampled_ (sample.cuh, not argmax) with the generation's SampleArgs (its counter advanced
  // by the kernel) and the penalty tables seen [V] and counts [V] (sampling.h).
  SampleArgs* sample_args_dev_ = nullptr;
  uint8_t* seen_dev_ = nullptr;
  int32_t* counts_dev_ = nullptr;
  bool selecting_ = false, sampled_ = false;
};

}  // namespace

std::string unavailable_reason() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0)
    return std::string("no CUDA device (") + (e != cudaSuccess ? cudaGetErrorString(e) : "none found") + ")";
  cudaDeviceProp p;
  if (cudaGetDeviceProperties(&p, 0) != cudaSuccess) return "no CUDA device (cudaGetDeviceProperties failed)";
  if (p.major < 9)
    return "no CUDA device of compute capability 9.0 (the build targets sm_90a; found " + std::string(p.name) + ", " +
           std::to_string(p.major) + "." + std::to_string(p.minor) + ")";
  return "";
}

std::unique_ptr<Backend> make_cuda_backend(const Model& model, int max_rows, bool pipeline) {
  return std::make_unique<CudaBackend>(model, max_rows, pipeline);
}

void sample_rows(const float* logits, uint8_t* seen, int32_t* counts, uint64_t* counters, int rows, int vocab,
                 int steps, const SamplingParams& params, int32_t* tokens, float* logits_after) {
  if (rows < 1 || vocab < 1 || steps < 1)
    throw std::invalid_argument("[cuda] sample_rows: rows, vocab and steps must be positive, got " +
                                std::to_string(rows) + ", " + std::to_string(vocab) + ", " + std::to_string(steps));
  if (const std::string why = unavailable_reason(); !why.empty()) throw std::runtime_error("[cuda] " + why);
  const size_t cells = size_t(rows) * vocab;
  std::vector<SampleArgs> args(static_cast<size_t>(rows));
  for (int r = 0; r < rows; ++r) args[r] = gpu::sample_args(params, vocab, counters[r]);
  struct Free {
    void operator()(void* p) const { cudaFree(p); }
  };
  const std::unique_ptr<float, Free> l(device_alloc<float>(cells));
  const std::unique_ptr<uint8_t, Free> s(device_alloc<uint8_t>(cells));
  const std::unique_ptr<int32_t, Free> c(device_alloc<int32_t>(cells));
  const std::unique_ptr<SampleArgs, Free> a(device_alloc<SampleArgs>(rows));
  const std::unique_ptr<int32_t, Free> t(device_alloc<int32_t>(size_t(rows) * steps));
  CK(cudaMemcpy(l.get(), logits, cells * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(s.get(), seen, cells, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(c.get(), counts, cells * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(a.get(), args.data(), args.size() * sizeof(SampleArgs), cudaMemcpyHostToDevice));
  for (int r = 0; r < rows; ++r)
    for (int k = 0; k < steps; ++k)
      sample_token_kernel<<<1, LILY_SAMPLE_THREADS>>>(a.get() + r, l.get() + size_t(r) * vocab,
                                                      s.get() + size_t(r) * vocab, c.get() + size_t(r) * vocab,
                                                      t.get() + size_t(r) * steps + k);
  CK(cudaGetLastError());
  CK(cudaMemcpy(tokens, t.get(), size_t(rows) * steps * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(seen, s.get(), cells, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(counts, c.get(), cells * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(logits_after, l.get(), cells * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(args.data(), a.get(), args.size() * sizeof(SampleArgs), cudaMemcpyDeviceToHost));
  for (int r = 0; r < rows; ++r) counters[r] = uint64_t(args[r].counter_hi) << 32 | args[r].counter_lo;
}

}  // namespace lily::cuda
