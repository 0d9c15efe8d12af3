// The encoders: one function per kernel family op, in portable C++ over the Device (device.h). Each fills
// its <Family>Args struct from metal/lily_args.h, picks a KernelId, sizes the grid, and declares how it
// uses every buffer (so the Encoder derives barriers). MetalBackend's ops (metal_backend.h), defined in the
// same family files, call them in the order of the schedule; tests call them one by one through
// csrc/bindings/kernels.cpp.
//
// Data formats on the device (shared by every family):
//   x (residual stream) f32 [T, H]; every other activation bf16 [T, width]; logits f32 [T, V];
//   KV cache bf16 [n_kv, capacity, d]; GDN conv state f32 [k_c - 1, C]; GDN recurrent state f32
//   [n_v, d_k, d_v]; routing ids int32 [T, k] and weights f32 [T, k]; tokens int32.
//   Weights as stored: MLX affine 4/8-bit groups of 64 with bf16 scales/biases, or bf16.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "../../core/sampling.h"
#include "../../core/weights.h"
#include "../gpu/gpu_backend.h"
#include "../gpu/sample_args.h"
#include "device.h"
#include "lily_args.h"

namespace lily::metal {

// A core Linear (weights.h) on the device: the mapped file(s) wrapped as Buffers, with offsets and strides.
struct DeviceMatrix {
  LilyWeightFormat format = LILY_W_BF16;
  Buffer* w = nullptr;
  Buffer* scales = nullptr;  // quantised formats only
  Buffer* biases = nullptr;
  uint64_t w_offset = 0, s_offset = 0, b_offset = 0;  // of logical row 0 of expert 0
  int32_t rows = 0, cols = 0, experts = 0;
  uint64_t w_row_bytes = 0, s_row_bytes = 0, w_expert_bytes = 0, s_expert_bytes = 0;
  uint64_t matrix_bytes = 0;  // bytes one use of one expert's (or the dense) matrix reads: the minimum
};

// The three buffer arguments of a matrix (codes or bf16 values, scales, biases), each declaring its exact
// extent over all experts: matrices that share a buffer (one mapped checkpoint file) then neither serialise
// on each other nor count each other's bytes. A bf16 matrix has no scales or biases, but Metal wants every
// buffer argument bound: those slots get W's first 16 bytes, never read (a short range, so the byte counters
// do not charge W's pages to them too).
struct MatrixBindings {
  Binding w, s, b;
};
MatrixBindings bind_matrix(const DeviceMatrix& W, int slot_w, int slot_s, int slot_b);

// A small fp32 parameter vector (norm weights, A_log, dt_bias, conv filter) uploaded once.
struct DeviceVec {
  Buffer* buffer = nullptr;
  uint64_t offset = 0;
  int32_t size = 0;
};

// ---------------------------------------------------------------- common (metal/common.metal)
// x[t] ← dequantised E[tokens[t]]   (tokens int32 [T], x f32 [T, H])
void encode_embed(Encoder& enc, const DeviceMatrix& E, View tokens, View x, int T);
// out[t] ← bf16( x̂[t] · w ), x̂ = in · rsqrt(mean(in²) + eps)   (in f32 [T, n], out bf16 [T, n])
void encode_rmsnorm(Encoder& enc, View in, const DeviceVec& w, View out, int T, int n, float eps);
// token_slot ← argmax(logits[0, :V])   (greedy selection on the device, into the next step's input slot)
void encode_argmax(Encoder& enc, View logits, int V, View token_slot);
// dst[r, :row_bytes] ← src[r, :row_bytes] for r < rows at byte strides (KV cache growth on the device; row_bytes,
// strides and offsets multiples of 16).
void encode_copy_rows(Encoder& enc, View src, View dst, int rows, uint64_t row_bytes, uint64_t src_stride,
                      uint64_t dst_stride);

// ---------------------------------------------------------------- sample (metal/sample.metal)
// SampleArgs for one step of a request (gpu/sample_args.h, shared with the CUDA backend).
using gpu::sample_args;
// token ← a draw from logits f32 [vocab] with Sampler's semantics (sampling.h), then seen[token] = 1 and
// ++counts[token] (Sampler::accept). seen uint8 [vocab] (prompt + generated), counts int32 [vocab]
// (generated); logits are left unmodified. One dispatch of one threadgroup.
void encode_sample(Encoder& enc, View logits, int vocab, const SampleArgs& args, View seen, View counts, View token);

// ---------------------------------------------------------------- dense (metal/qgemv.metal, metal/qgemm.metal)
enum class OutMode : uint8_t { bf16, f32, f32_add };  // store bf16 / store f32 / add into f32 (residual)
// out[t, r] (op)= Σ_c W[r, c] · in[t, c]  (in bf16 [T, cols]). T == 1 runs the row-parallel GEMV;
// T > 1 the tiled GEMM that dequantises a weight tile into threadgroup memory (never a bf16 copy of W).
// The GEMM's matrix path: automatic = Metal 4 tensor ops (qgemm_tensor_*, matmul2d) where the device has
// them (enc.tensor_ops), simdgroup_matrix (qgemm_*) elsewhere; tests force one (tensor needs enc.tensor_ops).
enum class GemmPath : uint8_t { automatic, simdgroup, tensor };
void encode_project(Encoder& enc, const DeviceMatrix& W, View in, View out, int T, OutMode mode,
                    GemmPath path = GemmPath::automatic);
// Whether a tiled GEMM (dense or MoE) takes the tensor-op path; forcing it on a device without tensor ops
// throws std::invalid_argument starting with `what` (the op and its shapes).
bool gemm_uses_tensor_ops(const Encoder& enc, GemmPath path, const std::string& what);
// The dequant ablation's first pass (Fusions::dequant off): W (q4 / q8) written as bf16 [rows, cols] into
// `scratch` (rows * cols * 2 bytes); returns the bf16 matrix over that copy, for encode_project /
// encode_norm_project to read instead of W.
DeviceMatrix encode_dequant(Encoder& enc, const DeviceMatrix& W, View scratch);

// ---------------------------------------------------------------- proj (metal/proj.metal)
// Decode (one row): out_m ← W_m · bf16(RMSNorm(x) · w) for n ≤ 4 matrices sharing the normed row, in one
// dispatch (x f32 [H], outputs bf16 or f32 [rows_m]); xn (when its buffer is set) also receives the normed row
// bf16 [H] for later consumers.
struct ProjTarget {
  const DeviceMatrix* W;
  View out;
};
void encode_norm_project(Encoder& enc, View x, const DeviceVec& w, float eps, int H, const ProjTarget* targets, int n,
                         bool f32_out, View xn = {});

// ---------------------------------------------------------------- moe (metal/moe.metal)
struct MoeDevice {
  DeviceMatrix router;                           // [E, H] (8-bit in the published checkpoint)
  DeviceMatrix gate, up, down;                   // experts [E, I, H], [E, I, H], [E, H, I]
  DeviceMatrix shared_gate_proj, shared_up, shared_down;  // [I_s, H], [I_s, H], [H, I_s]
  DeviceMatrix shared_gate;                      // [1, H]
  int32_t hidden = 0, experts = 0, top_k = 0, inter = 0, shared_inter = 0;
};
// Per-backend scratch of the MoE family, allocated once for max_rows by the family (moe.cpp).
struct MoeScratch;
std::shared_ptr<MoeScratch> make_moe_scratch(Device& dev, const MoeDevice& M, int max_rows);
// Router logits, softmax, top-k, renormalise: ids int32 [T, k], weights f32 [T, k].
void encode_moe_route(Encoder& enc, MoeScratch& s, const MoeDevice& M, View xn, int T, View ids, View weights);
// Prefill: histogram → prefix scan → scatter → block map → grouped GEMMs (gate/up + SwiGLU, down +
// routing weight) → combine with the shared expert: x[t] += MoE(xn[t]). No CPU wait inside.
// tile_rows: grouped-GEMM tile height, 0 = the rule in moe.cpp (moe_tile_rows), or force 16 / 32 (tests).
// path: the grouped GEMMs' matrix path, chosen as encode_project's (automatic: matmul2d where enc.tensor_ops).
void encode_moe_prefill(Encoder& enc, MoeScratch& s, const MoeDevice& M, View xn, View ids, View weights, int T, View x,
                        int tile_rows = 0, GemmPath path = GemmPath::automatic);
// Decode (T = 1): fused gate/up + SwiGLU per selected expert and the shared expert; fused down + routing
// weight + shared expert gate, added into x.
struct MoeDecodeFusion {
  // The router logits and the shared gate logit are already in the scratch (encode_moe_route_norm wrote
  // them): the gate/up GEMV recomputes the top-k itself and stores ids / weights for the down GEMV.
  bool topk = false;
  // Off (Fusions::expert_swiglu): gate and up rows go to scratch, moe_gemv_swiglu makes h.
  bool swiglu = true;
  // Off (Fusions::expert_combine): each down product goes to scratch, moe_combine_weighted applies
  // the routing weights and the shared expert's sigmoid gate and adds into x.
  bool combine = true;
};
void encode_moe_decode(Encoder& enc, MoeScratch& s, const MoeDevice& M, View xn, View ids, View weights, View x,
                       MoeDecodeFusion fuse = {});
// Decode: xn ← bf16(RMSNorm(x) · w), router logits and the shared gate logit in one proj_norm dispatch, into
// the scratch (the top-k follows inside encode_moe_decode with MoeDecodeFusion::topk).
void encode_moe_route_norm(Encoder& enc, MoeScratch& s, const MoeDevice& M, View x, const DeviceVec& w, float eps,
                           View xn);

// ---------------------------------------------------------------- gdn (metal/gdn.metal)
struct GdnDevice {
  DeviceVec conv;      // [C, k_c]
  DeviceVec A_log, dt_bias;  // [n_v]
  DeviceVec norm;      // [d_v]
  int32_t nk = 0, nv = 0, dk = 0, dv = 0, conv_kernel = 0;
  float eps = 1e-6f;   // rms_norm_eps of the gated norm (the l2-norm eps is the fixed 1e-6)
};
struct GdnScratch;
std::shared_ptr<GdnScratch> make_gdn_scratch(Device& dev, const GdnDevice& G, int max_rows);
using gpu::GdnStates;
// Prefill over T rows: causal conv + SiLU (conv state carried), l2-norm q/k, gates, the register-resident
// delta-rule scan (one simdgroup per state column), gated RMSNorm → out bf16 [T, V_dim].
void encode_gdn_prefill(Encoder& enc, GdnScratch& s, const GdnDevice& G, View qkv, View z, View beta, View alpha,
                        int T, const GdnStates& st, View out);
// Decode: one fused step (conv + l2norm + gates + update + gated norm).
void encode_gdn_decode(Encoder& enc, GdnScratch& s, const GdnDevice& G, View qkv, View z, View beta, View alpha,
                       const GdnStates& st, View out);

// ---------------------------------------------------------------- attn (metal/attn.metal)
struct AttnDevice {
  DeviceVec q_norm, k_norm;  // [d], effective 1 + w
  int32_t n_q = 0, n_kv = 0, head_dim = 0, rotary_dim = 0;
  float rope_theta = 0.f, eps = 1e-6f;
};
struct AttnScratch;
std::shared_ptr<AttnScratch> make_attn_scratch(Device& dev, const AttnDevice& A, int max_rows);
// The normed + roped queries attn_prepare leaves in the scratch: bf16 [T, n_q, d] (tests read them).
View attn_scratch_queries(AttnScratch& s);
// q/k RMSNorm + RoPE, K/V written into the cache rows [pos, pos + T); normed queries kept in scratch.
void encode_attn_prepare(Encoder& enc, AttnScratch& s, const AttnDevice& A, View q_gate, View k, View v, int T,
                         int64_t pos, View k_cache, View v_cache, int64_t capacity);
// Causal attention of T rows over the cache, ⊙ σ(gate) → out bf16 [T, n_q·d].
// pack_limit: query heads per threadgroup at most (0 = LILY_ATTN_PACK_HEADS; 1 = no GQA packing, the ablation).
void encode_attn_prefill(Encoder& enc, AttnScratch& s, const AttnDevice& A, View q_gate, int T, int64_t pos,
                         View k_cache, View v_cache, int64_t capacity, View out, int pack_limit = 0);
// Decode: GQA-packed (each KV row loaded once for the query heads that share it). `automatic` takes the
// fixed-block (split-KV) path at contexts >= LILY_ATTN_SPLIT_MIN_CONTEXT for d = 256 and GQA 8, else the
// general one; tests force either. split_block: keys per block of the split path (0 = LILY_ATTN_SPLIT_BLOCK).
// prep.k set: the fused variant (attn_decode[_split]_prep): the q/k norm + RoPE and the KV-row write of
// attn_prepare happen inside, from the raw projections q_gate, prep.k, prep.v (no attn_prepare dispatch).
enum class AttnDecodePath : uint8_t { automatic, general, split };
struct AttnPrepareInputs {
  View k, v;  // bf16 [n_kv, d] projected key / value rows of the step
};
void encode_attn_decode(Encoder& enc, AttnScratch& s, const AttnDevice& A, View q_gate, int64_t pos,
                        View k_cache, View v_cache, int64_t capacity, View out,
                        AttnDecodePath path = AttnDecodePath::automatic, int split_block = 0, int pack_limit = 0,
                        AttnPrepareInputs prep = {});

}  // namespace lily::metal
