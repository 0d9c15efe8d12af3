// The CUDA backend (cuda_backend.h): a GpuBackend (backends/gpu/gpu_backend.h) over a CudaDevice (device.h)
// whose ops launch the kernels of kernels.cuh on the device's stream. GpuBackend keeps what every GPU backend
// shares — the session states (KV cache growth, the GDN states in two copies), the token slots and the
// selection's bookkeeping, the command buffers in flight, rollback, counters and memory by role — and this file
// the weights on the device and the ops.
//
// Decode graphs: every kernel that depends on the position reads it from pos_dev_ (set before each step) and
// the step's input token from its token slot (records_steps_once: a host token is written there too), so one
// decode step's launches are the same every step. The first decode step of a (state, KV capacity, fusions,
// selection kernel, GDN copy, token slot) is captured as a CUDA graph; later steps replay it, the ops only
// checking that the schedule calls the same sequence. Token selection into the output slot is part of the
// graph: the first maximum (argmax_kernel) for plain greedy, else sample.cuh (penalties, sampling), which reads
// the generation's parameters, draw counter and penalty tables from device memory (select_begin uploads them,
// the kernel advances the counter and the tables). Which of the two is the one thing about selection a graph
// key must say; every sampled generation on a state replays the same graphs, and no token visits the host
// between steps.
//
// Two steps in flight (pipelines()): each submission reads the token slot and GDN state copy the one before
// wrote and writes the other ones, with its logits in a row of their own (GpuBackend's parities). So the engine
// commits step n + 1 before it reads step n's token, and rollback() undoes step n + 1 by flipping back. The
// parities make two graphs of a steady generation.
#include "cuda_backend.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <type_traits>
#include <unordered_map>

#include "attention_decode.cuh"
#include "device.h"
#include "flash_attention.cuh"
#include "gdn_chunked.cuh"
#include "gemm.cuh"
#include "kernels.cuh"
#include "sample.cuh"
#include "../gpu/gpu_backend.h"
#include "../gpu/sample_args.h"

namespace lily::cuda {
namespace {

#define CK(call) check((call), #call)

using gpu::Role;
using gpu::View;

int param_dtype(DType t, const std::string& name) {
  switch (t) {
    case DType::f32: return kF32;
    case DType::bf16: return kBF16;
    case DType::f16: return kF16;
    case DType::u32: break;
  }
  throw std::invalid_argument("[cuda] tensor " + name + ": integer dtype where a float one is needed");
}

template <class T>
T* device_alloc(size_t n) {
  void* p = nullptr;
  if (n) CK(cudaMalloc(&p, n * sizeof(T)));
  return static_cast<T*>(p);
}

class CudaBackend final : public gpu::GpuBackend {
 public:
  CudaBackend(const Model& m, std::unique_ptr<CudaDevice> device, int max_rows, bool pipeline)
      : GpuBackend(m, std::move(device), max_rows, pipeline, gpu::ActFormat::f32),
        dev_(static_cast<CudaDevice&>(GpuBackend::device())),
        stream_(dev_.stream()) {
    check_geometry();
    int device_id = 0;
    CK(cudaGetDevice(&device_id));
    CK(cudaDeviceGetAttribute(&sms_, cudaDevAttrMultiProcessorCount, device_id));
    const char* per_sm = std::getenv("LILY_CUDA_DECODE_BLOCKS_PER_SM");
    slots_ = decode_slots(sms_, per_sm && *per_sm ? std::atoi(per_sm) : kDecodeBlocksPerSm);
    CK(allow_decode_smem());
    CK(allow_attention_decode_smem());
    if (!moe_decode_fits(moe_decode_kernel_for(c_.hidden, true), slots_, sms_) ||
        !moe_decode_fits(moe_decode_kernel_for(c_.hidden, false), slots_, sms_))
      throw std::runtime_error("[cuda] the experts' decode kernel: " + std::to_string(slots_) +
                               " blocks do not fit this GPU at once (LILY_CUDA_DECODE_BLOCKS_PER_SM=1: one an SM)");
    decode_order_ = &DecodeOrder::of(device_id);
    upload_weights();
    const int K = c_.top_k, E = c_.experts, TK = max_rows * K, H = c_.hidden, I = c_.moe_inter;
    imax_ = std::max(I, c_.shared_inter);
    qbuf_ = scratch<float>(size_t(max_rows) * c_.n_q * c_.head_dim, "attn.q");
    conv_out_ = scratch<float>(size_t(max_rows) * c_.conv_dim(), "gdn.conv_out");
    gdn_packs_ = scratch<float>(size_t((max_rows + kGdnChunk - 1) / kGdnChunk) * c_.lin_nv *
                                    gdn_pack_floats(c_.lin_dk, c_.lin_dv),
                                "gdn.packs");
    attn_part_ = scratch<float>(attention_part_floats(c_.n_q, c_.head_dim), "attn.parts");
    router_ = scratch<float>(size_t(max_rows) * E, "moe.router");
    shared_logit_ = scratch<float>(max_rows, "moe.shared_logit");
    route_ids_ = scratch<int32_t>(TK, "moe.ids");
    route_w_ = scratch<float>(TK, "moe.weights");
    counts_ = scratch<int>(E, "moe.counts");
    offsets_ = scratch<int>(E, "moe.offsets");
    perm_ = scratch<int>(TK, "moe.perm");
    inv_ = scratch<int>(TK, "moe.inv");
    hbuf_ = scratch<float>(size_t(TK) * imax_, "moe.h");
    ybuf_ = scratch<float>(size_t(TK) * H, "moe.y");
    sy_ = scratch<float>(size_t(max_rows) * H, "moe.shared_y");
    sh_ = scratch<float>(size_t(max_rows) * c_.shared_inter, "moe.shared_h");
    // a GEMM's activations as bf16: a chunk's rows of the widest input, or the experts' down over every slot
    const int widest = std::max({H, c_.n_q * c_.head_dim, c_.lin_nv * c_.lin_dv, imax_});
    xh_.elems = std::max(gemm_x_bf16_elems(max_rows, widest), gemm_x_bf16_elems(TK, imax_));
    xh_.xh = scratch<__nv_bfloat16>(xh_.elems, "gemm.x_bf16");
    argmax_slot_ = scratch<ArgmaxSlot>(1, "argmax");
    moe_counts_ = scratch<unsigned>(kMoeCounts, "moe.decode_counts");
    pos_ = scratch_view(sizeof(int64_t), "pos", Role::io);
    pos_dev_ = device_ptr<int64_t>(pos_);
    sample_args_ = scratch_view(sizeof(SampleArgs), "sample.args", Role::io);
  }

  ~CudaBackend() override {
    drop_graphs();
    cudaStreamSynchronize(stream_);
  }

  const char* kernel_label(gpu::KernelIndex) const override { return "cuda kernel"; }  // (no per-kernel counts)

  // ---------------------------------------------------------------- submission

  void begin(Phase phase, const Fusions& f) override {
    GpuBackend::begin(phase, f);  // (the KV growth copies go out here, before any capture)
    const int64_t pos = position();
    dev_.write(pos_, &pos, sizeof pos);
    ops_ = 0, launches_ = 0;
    mode_ = Mode::direct;
    if (phase != Phase::decode) return;
    graph_key_ = GraphKey{state_serial(), kv_capacity(), fusion_bits(f), !plain_greedy(), gdn_copy(), token_slot()};
    graph_ = nullptr;
    for (auto& g : graphs_)
      if (g.key == graph_key_) graph_ = &g;
    mode_ = graph_ ? Mode::replay : Mode::capture_pending;
  }

  void commit() override {
    if (phase() == Phase::decode && mode_ != Mode::direct) {
      // The selection is part of every decode graph. A step that does not select (Engine::logits / feed, only
      // between generations: one request at a time) thus still selects, as the last generation did: it
      // overwrites the output token slot, which the next step embeds from only after writing it, and a sampled
      // one advances the counter and tables, which the next sampled generation's select_begin replaces.
      if (mode_ == Mode::capture_pending)
        throw std::logic_error("[cuda] a decode step must start with embed or embed_selected");
      if (mode_ == Mode::capturing) {
        launch_selection(row_logits_out(), token_out(), !plain_greedy());
        cudaGraph_t graph = nullptr;
        CK(cudaStreamEndCapture(stream_, &graph));
        graph_ = &keep_graph(graph);
        cudaGraphDestroy(graph);
      } else if (ops_ != graph_->ops) {
        throw std::logic_error("[cuda] decode step called " + std::to_string(ops_) + " ops, its graph holds " +
                               std::to_string(graph_->ops));
      }
      launch_decode_graph();
      mode_ = Mode::direct;
    } else {
      dev_.launched(launches_);
    }
    CK(cudaGetLastError());
    GpuBackend::commit();
  }

  // ---------------------------------------------------------------- token selection

  // A sampled or penalised generation's SampleArgs (parameters and draw counter) into the device memory
  // sample.cuh reads (GpuBackend writes the penalty tables). Nothing of the host Sampler is needed after this:
  // the kernel keeps the counter and tables in step on the device, and logprobs come from the raw logits
  // (Sampler::fill_logprobs).
  void select_begin(const Sampler& sampler) override {
    GpuBackend::select_begin(sampler);
    if (plain_greedy()) return;
    const SampleArgs args = gpu::sample_args(sampler.params(), c_.vocab, sampler.draws());
    dev_.write(sample_args_, &args, sizeof args);
  }

 protected:
  bool records_steps_once() const override { return true; }

  void encode_embed(View ids, int T) override {
    if (mode_ == Mode::capture_pending) {
      CK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
      mode_ = Mode::capturing;
    }
    if (!op()) return;
    launch_dependent(embed_kernel, T, 64, 0, embed_, device_ptr<int32_t>(ids), act(Act::x), c_.hidden, c_.vocab);
  }

  void encode_copy_rows(View src, View dst, int rows, uint64_t row_bytes, uint64_t src_stride,
                        uint64_t dst_stride) override {
    CK(cudaMemcpy2DAsync(device_ptr<uint8_t>(dst), dst_stride, device_ptr<uint8_t>(src), src_stride, row_bytes,
                         rows, cudaMemcpyDeviceToDevice, stream_));
  }

  // The selection's draw counter and parameters are the device's (select_begin), not `sample` and `draws`:
  // a replayed graph cannot take new values from the host. In a decode graph the selection is launched at
  // commit (every decode graph selects).
  void encode_select(View logits, View token, const SamplingParams* sample, uint64_t, View, View) override {
    if (phase() == Phase::decode && mode_ != Mode::direct) return;
    launch_selection(logits, token, sample != nullptr);
  }

  // ---------------------------------------------------------------- ops

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
    float* logits = device_ptr<float>(logits_rows(1));
    if (!op()) return;
    GemvJobs jobs;
    add_job(jobs, m_.lm_head, logits);
    gemv(jobs, act(Act::x) + int64_t(row) * c_.hidden, vec(m_.norm), nullptr);
  }

  void lm_head(int first, int rows) override {
    float* logits = device_ptr<float>(logits_rows(rows));
    if (!op()) return;
    launch_dependent(rmsnorm_kernel, rows, 256, 0, act(Act::x) + int64_t(first) * c_.hidden, c_.hidden,
                     act(Act::xn), c_.hidden, vec(m_.norm), c_.hidden, c_.rms_eps);
    matmul(m_.lm_head, act(Act::xn), c_.hidden, rows, logits, c_.vocab, false);
  }

  void attn_prepare(int layer, int T, int64_t pos) override {
    check_pos(pos);
    if (!op()) return;
    const AttentionWeights& A = m_.layers[layer].attn;
    const int d = c_.head_dim;
    launch_dependent(attn_prepare_kernel, dim3(T, (c_.n_q + c_.n_kv + kPrepareWarps - 1) / kPrepareWarps),
        kPrepareWarps * 32, kPrepareWarps * d * 4, act(Act::q_gate), act(Act::k), act(Act::v), vec(A.q_norm),
        vec(A.k_norm), qbuf_, kc(layer), vc(layer), kv_capacity(), pos_dev_, c_.n_q, c_.n_kv, d, c_.rotary_dim,
        c_.rope_theta, c_.rms_eps);
  }

  void attn_prefill(int layer, int T, int64_t pos) override {
    check_pos(pos);
    if (!op()) return;
    by_head_dim(c_.head_dim, [&](auto D) {
      launch_flash_attention<D()>(qbuf_, kc(layer), vc(layer), kv_capacity(), act(Act::q_gate), act(Act::mix),
                                  width(Act::mix), T, c_.n_q, c_.n_kv, pos_dev_, stream_);
    });
    launched();
  }

  // Split-KV attention for the one row (attention_decode.cuh), then the splits merged and gated. (No
  // attn_prepare_decode of its own: the preparation inside the split kernel measured slower than
  // attn_prepare_kernel before it, so Backend's, the two ops, serves.)
  void attn_decode(int layer, int64_t pos) override {
    check_pos(pos);
    if (!op()) return;
    by_head_dim(c_.head_dim, [&](auto D) {
      launch_dependent(attention_kernel<D()>, c_.n_kv * kDecodeSplits / kAttnWarps, kAttnWarps * 32,
                       attn_smem_bytes<D()>(), qbuf_, kc(layer), vc(layer), kv_capacity(), pos_dev_, c_.n_q,
                       c_.n_kv, attn_part_);
    });
    launch_dependent(attention_combine_kernel, attention_combine_grid(c_.n_q, c_.head_dim), kCombineWarps * 32, 0,
                     attn_part_, c_.head_dim, act(Act::q_gate), act(Act::mix));
  }

  // The chunk's scan: conv over all rows at once, q/k norms and gates over all rows, the recurrence in chunks of
  // 64 rows (gdn_chunked.cuh), the gated norm over all rows.
  void gdn_scan(int layer, int T) override {
    check_rows(T, "gdn_scan");
    const gpu::GdnStates st = gdn_states(layer);
    if (!op()) return;
    const DeltaNetWeights& G = m_.layers[layer].gdn;
    const int C = c_.conv_dim(), nk = c_.lin_nk, nv = c_.lin_nv, dv = c_.lin_dv;
    const int64_t cells = int64_t(T) * C;
    gdn_conv_rows_kernel<<<int((cells + 255) / 256), 256, 0, stream_>>>(act(Act::qkv), conv_out_,
                                                                       f32(st.conv_in), vec(G.conv), T, C,
                                                                       c_.conv_kernel);
    gdn_conv_state_kernel<<<(C + 127) / 128, 128, 0, stream_>>>(act(Act::qkv), f32(st.conv_in),
                                                               f32(st.conv_out), T, C, c_.conv_kernel);
    launched(2);
    // the chunked scan updates the state in place: in the copy out
    CK(cudaMemcpyAsync(f32(st.rec_out), f32(st.rec_in), rec_size() * 4, cudaMemcpyDeviceToDevice, stream_));
    const int warps = T * (2 * nk + 1);
    gdn_prepare_kernel<<<(warps + 3) / 4, 128, 0, stream_>>>(conv_out_, act(Act::beta), act(Act::alpha),
                                                            vec(G.A_log), vec(G.dt_bias), T, C, nk, nv, c_.lin_dk);
    launched();
    auto scan = [&](auto dk) {
      launch_gdn_chunked<decltype(dk)::value>(conv_out_, act(Act::beta), act(Act::alpha), gdn_packs_,
                                              f32(st.rec_out), act(Act::mix), width(Act::mix), T, C, nk, nv, dv,
                                              stream_);
    };
    switch (c_.lin_dk) {
      case 32: scan(std::integral_constant<int, 32>{}); break;
      case 64: scan(std::integral_constant<int, 64>{}); break;
      default: scan(std::integral_constant<int, 128>{}); break;
    }
    gdn_gated_norm_kernel<<<T * nv, dv, 0, stream_>>>(act(Act::mix), width(Act::mix), act(Act::z), vec(G.norm), nv,
                                                     dv, c_.rms_eps);
    launched(3);  // and the chunked scan's two
  }

  // One row: the conv and everything after it in one kernel, a cluster of blocks a value head (gdn_step_kernel).
  void gdn_step(int layer) override {
    const gpu::GdnStates st = gdn_states(layer);
    if (!op()) return;
    const DeltaNetWeights& G = m_.layers[layer].gdn;
    auto step = [&](auto kernel) {
      const int S = gdn_step_cluster(c_.lin_dv);
      launch_dependent(Placement{S}, kernel, c_.lin_nv * S, kGdnStepThreads, 0, act(Act::qkv), f32(st.conv_in),
                       f32(st.conv_out), vec(G.conv), act(Act::beta), act(Act::alpha), act(Act::z), f32(st.rec_in),
                       f32(st.rec_out), vec(G.A_log), vec(G.dt_bias), vec(G.norm), act(Act::mix), c_.conv_dim(),
                       c_.conv_kernel, c_.lin_nk, c_.lin_nv, c_.lin_dv, c_.rms_eps);
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
    matmul(M.shared_gate, act(Act::xn), c_.hidden, T, shared_logit_, 1, false, GemmInput::converted);
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
    launched(2);
    const float* xn = act(Act::xn);
    if (fusions().expert_swiglu) {  // both gate/up products from one bf16 copy of the normed rows, SwiGLU inside
      GemmArgs routed = grouped_args(M.gate, xn, H, T, perm_, K, hbuf_, I);
      routed.up = lin(M.up);
      GemmArgs shared = dense_args(M.shared_gate_proj, xn, H, T, sh_, Is);
      shared.up = lin(M.shared_up);
      product(routed);
      product(shared, GemmInput::converted);
      grouped(M.down, hbuf_, I, T, nullptr, 1, ybuf_, H);
      matmul(M.shared_down, sh_, Is, T, sy_, H, false);
    } else {
      if (!g_) {  // only the unfused products need them (~67 MB at 2,048-row chunks): made on their first use
        g_ = scratch<float>(size_t(max_rows()) * K * imax_, "moe.gate");
        u_ = scratch<float>(size_t(max_rows()) * K * imax_, "moe.up");
      }
      grouped(M.gate, xn, H, T, perm_, K, g_, I);
      grouped(M.up, xn, H, T, perm_, K, u_, I);
      swiglu(g_, u_, hbuf_, int64_t(TK) * I);
      grouped(M.down, hbuf_, I, T, nullptr, 1, ybuf_, H);
      matmul(M.shared_gate_proj, xn, H, T, g_, Is, false);
      matmul(M.shared_up, xn, H, T, u_, Is, false);
      swiglu(g_, u_, hbuf_, int64_t(T) * Is);
      matmul(M.shared_down, hbuf_, Is, T, sy_, H, false);
    }
    moe_combine_kernel<<<T, 256, 0, stream_>>>(act(Act::x), ybuf_, sy_, shared_logit_, route_w_, inv_, K, H);
    launched();
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
    launch_dependent(moe_decode_kernel_for(H, moe_mlx4(md)), g.blocks, kDecodeThreads, g.smem, md,
                     act(route ? Act::x : Act::xn), act(Act::x), H, route ? route_norm_ : nullptr, c_.rms_eps, router_,
                     shared_logit_, moe_counts_, route_ids_, route_w_, hbuf_, g.stages, md.gate_up_stage_bytes(),
                     g.ring_bytes, g.down_rows);
  }

 private:
  // decode_slots' blocks an SM; $LILY_CUDA_DECODE_BLOCKS_PER_SM overrides it (benchmarks compare the two)
  static constexpr int kDecodeBlocksPerSm = 2;
  static constexpr size_t kMaxGraphs = 8;  // two shapes of step (e.g. greedy and sampled) of four graphs each
  enum class Mode { direct, capture_pending, capturing, replay };
  struct GraphKey {
    uint64_t state = 0;  // GpuBackend::state_serial
    int64_t capacity = 0;
    uint32_t fusions = 0;
    bool sampled = false;  // sample_token_kernel selects, not argmax_kernel
    int gdn = 0, slot = 0;  // the GDN state copy and token slot the step reads
    bool same_step(const GraphKey& o) const {
      return state == o.state && capacity == o.capacity && fusions == o.fusions && sampled == o.sampled;
    }
    bool operator==(const GraphKey& o) const { return same_step(o) && gdn == o.gdn && slot == o.slot; }
    // the same kernels in the same order, their arguments (the state's buffers, the KV stride) aside
    bool same_shape(const GraphKey& o) const {
      return fusions == o.fusions && sampled == o.sampled && gdn == o.gdn && slot == o.slot;
    }
  };
  struct Graph {
    GraphKey key;
    cudaGraphExec_t exec;
    int ops;            // the schedule's ops it holds
    uint64_t launches;  // and their kernel launches (the counters' dispatches each replay)
  };
  static uint32_t fusion_bits(const Fusions& f) {
    const bool bits[] = {f.norm_project, f.route, f.attn_prepare, f.gdn_step, f.expert_swiglu, f.expert_combine,
                         f.dequant};
    uint32_t v = 0;
    for (size_t i = 0; i < sizeof bits; ++i) v |= uint32_t(bits[i]) << i;
    return v;
  }

  // The token of the logits row into the token slot: sampled (sample.cuh, with the penalty tables) or the first
  // maximum.
  void launch_selection(View logits, View token, bool sampled) {
    if (sampled)
      launch_dependent(sample_token_kernel, 1, LILY_SAMPLE_THREADS, 0, device_ptr<SampleArgs>(sample_args_),
                       f32(logits), device_ptr<uint8_t>(penalty_seen()), device_ptr<int32_t>(penalty_counts()),
                       device_ptr<int32_t>(token));
    else
      launch_dependent(argmax_kernel, std::min(sms_, (c_.vocab + 1023) / 1024), 1024, 0, f32(logits), c_.vocab,
                       argmax_slot_, device_ptr<int32_t>(token));
  }

  // A decode graph, after every decode graph that any CudaBackend of the process launched before it on this
  // device: moe_decode_kernel's blocks wait on each other (kernels.cuh), so two of them must never share the GPU,
  // each holding part of it — which two backends' streams could otherwise make happen.
  void launch_decode_graph() {
    std::lock_guard<std::mutex> lock(decode_order_->m);
    CK(cudaStreamWaitEvent(stream_, decode_order_->last, 0));
    CK(cudaGraphLaunch(graph_->exec, stream_));
    CK(cudaEventRecord(decode_order_->last, stream_));
    dev_.launched(graph_->launches);
  }

  // The executable graph of a step just captured. A new state (every fork, clone or new session) has steps of
  // its own buffers, but a graph of another state's step of the same shape is updated to them in place
  // (cudaGraphExecUpdate changes kernel arguments, from the graph's next launch on) instead of a graph
  // instantiated afresh, the cost that otherwise falls on the first steps of every turn (each GDN state copy and
  // token slot has its graph): H100, synthetic:full at 4K, a one-token turn 8.8-9.1 → 7.1-7.2 ms. At most
  // kMaxGraphs are kept, the current state's last.
  Graph& keep_graph(cudaGraph_t graph) {
    for (size_t i = 0; i < graphs_.size(); ++i) {
      Graph& g = graphs_[i];
      if (g.key.same_step(graph_key_) || !g.key.same_shape(graph_key_)) continue;
      cudaGraphExecUpdateResultInfo info{};
      if (cudaGraphExecUpdate(g.exec, graph, &info) == cudaSuccess) {
        g.key = graph_key_, g.ops = ops_, g.launches = launches_;
        return g;
      }
      cudaGetLastError();  // another topology after all: this one is replaced below
      cudaGraphExecDestroy(g.exec);
      graphs_.erase(graphs_.begin() + i);
      break;
    }
    cudaGraphExec_t exec = nullptr;
    check(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate (decode step)");
    for (auto it = graphs_.begin(); graphs_.size() >= kMaxGraphs && it != graphs_.end();) {
      if (it->key.same_step(graph_key_)) {
        ++it;
      } else {
        cudaGraphExecDestroy(it->exec);
        it = graphs_.erase(it);
      }
    }
    graphs_.push_back({graph_key_, exec, ops_, launches_});
    return graphs_.back();
  }

  void drop_graphs() {
    for (Graph& g : graphs_) cudaGraphExecDestroy(g.exec);
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
    arena_buffer_ = dev_.alloc(arena_used_ + 256, Role::weights, "weights");  // + a tile copy's rounding
    arena_ = device_ptr<uint8_t>({arena_buffer_.get()});
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

  // Y (+)= W · X for T rows: a warp-per-row GEMV for one row, the tensor-core GEMM for more (`in`: whether X is
  // in the GEMMs' bf16 scratch already, from the product before it; a GEMV reads X as it is).
  void matmul(const Linear& W, const float* X, int ldx, int T, float* Y, int ldy, bool accumulate,
              GemmInput in = GemmInput::convert) {
    if (T == 1) {
      GemvJobs jobs;
      add_job(jobs, W, Y);
      jobs.accumulate = accumulate;
      gemv(jobs, X, nullptr, nullptr);
      return;
    }
    GemmArgs a = dense_args(W, X, ldx, T, Y, ldy);
    a.accumulate = accumulate;
    product(a, in);
  }
  void product(const GemmArgs& a, GemmInput in = GemmInput::convert) {
    gemm(a, xh_, stream_, in);
    launched(in == GemmInput::convert ? 2 : 1);
  }
  GemmArgs dense_args(const Linear& W, const float* X, int ldx, int T, float* Y, int ldy) {
    return {lin(W), X, ldx, Y, ldy, T, nullptr, nullptr, nullptr, 1, false, 1};
  }

  // The experts' GEMM over the grouped assignment slots (rows of X gathered through `rows` / `div`).
  void grouped(const Linear& W, const float* X, int ldx, int T, const int* rows, int div, float* Y, int ldy) {
    product(grouped_args(W, X, ldx, T, rows, div, Y, ldy));
  }
  GemmArgs grouped_args(const Linear& W, const float* X, int ldx, int T, const int* rows, int div, float* Y,
                        int ldy) {
    return {lin(W), X, ldx, Y, ldy, T * c_.top_k, counts_, offsets_, rows, div, false, c_.experts};
  }

  // The decode path's kernels go out with programmatic dependent launch (the kernels' start_next_kernel /
  // wait_previous_kernel say what each may do early): a GEMV then fetches its weights while the kernel before
  // it drains, instead of a launch latency and a memory latency after it. Kept in the decode graph.
  template <class... P, class... A>
  void launch_dependent(Placement place, void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, A... args) {
    CK(cuda::launch_dependent(stream_, place, kernel, grid, block, smem, args...));
    ++launches_;
  }
  template <class... P, class... A>
  void launch_dependent(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, A... args) {
    launch_dependent(Placement{}, kernel, grid, block, smem, args...);
  }
  // Counts kernels launched otherwise (<<<>>> and the prefill kernels' launchers) for the counters.
  void launched(int n = 1) { launches_ += uint64_t(n); }

  void swiglu(const float* g, const float* u, float* h, int64_t n) {
    swiglu_kernel<<<int((n + 255) / 256), 256, 0, stream_>>>(g, u, h, n);
    launched();
  }

  float* act(Act a) { return f32(view(a)); }
  int width(Act a) const { return int(act_width(c_, a)); }
  static float* f32(View v) { return device_ptr<float>(v); }
  __nv_bfloat16* kc(int layer) const { return device_ptr<__nv_bfloat16>(k_cache(layer)); }
  __nv_bfloat16* vc(int layer) const { return device_ptr<__nv_bfloat16>(v_cache(layer)); }
  // A chunk's or a step's intermediates (zeroed once: the counters the kernels keep start at 0), held until the
  // backend goes.
  View scratch_view(uint64_t bytes, const char* label, Role role = Role::activations) {
    owned_.push_back(dev_.alloc(bytes, role, label));
    dev_.zero({owned_.back().get()}, bytes);
    return {owned_.back().get()};
  }
  template <class T>
  T* scratch(size_t n, const char* label) {
    return device_ptr<T>(scratch_view(n * sizeof(T), label));
  }
  size_t rec_size() const { return size_t(c_.lin_nv) * c_.lin_dk * c_.lin_dv; }
  void check_pos(int64_t pos) const {
    if (pos != position())
      throw std::logic_error("[cuda] op at position " + std::to_string(pos) + ", the bound state is at " +
                             std::to_string(position()));
  }

  CudaDevice& dev_;
  cudaStream_t stream_ = nullptr;  // dev_'s
  std::vector<std::shared_ptr<gpu::Buffer>> owned_;  // scratch
  std::shared_ptr<gpu::Buffer> arena_buffer_;        // every weight (upload_weights)
  uint8_t* arena_ = nullptr;                         // its device address
  uint64_t arena_used_ = 0;
  bool sizing_ = false;
  std::unordered_map<const Linear*, LinDev> lins_;
  std::unordered_map<const Vec*, const float*> vecs_;
  LinDev embed_;
  int imax_ = 0, sms_ = 1, slots_ = 1;  // slots_: decode_slots
  float *qbuf_ = nullptr, *conv_out_ = nullptr, *attn_part_ = nullptr, *router_ = nullptr, *shared_logit_ = nullptr;
  float* gdn_packs_ = nullptr;  // gdn_chunked.cuh's per-(chunk, value head) packs for max_rows rows
  int32_t* route_ids_ = nullptr;
  float* route_w_ = nullptr;
  int *counts_ = nullptr, *offsets_ = nullptr, *perm_ = nullptr, *inv_ = nullptr;
  float *g_ = nullptr, *u_ = nullptr, *hbuf_ = nullptr, *ybuf_ = nullptr, *sy_ = nullptr, *sh_ = nullptr;
  GemmScratch xh_;  // the GEMMs' bf16 activations
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
  View pos_;  // the bound state's position, written before each submission
  int64_t* pos_dev_ = nullptr;
  View sample_args_;  // a sampled generation's SampleArgs (its counter advanced by the kernel)
  Mode mode_ = Mode::direct;
  int ops_ = 0;
  uint64_t launches_ = 0;     // kernels launched since begin()
  std::vector<Graph> graphs_;  // oldest first (keep_graph)
  Graph* graph_ = nullptr;     // this step's, once captured
  GraphKey graph_key_;
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
  if (const std::string why = unavailable_reason(); !why.empty()) throw std::runtime_error("[cuda] " + why);
  if (max_rows <= 0) throw std::invalid_argument("[cuda] max_rows must be positive");
  return std::make_unique<CudaBackend>(model, std::make_unique<CudaDevice>(), max_rows, pipeline);
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
