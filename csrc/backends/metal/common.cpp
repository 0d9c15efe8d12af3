// The common family (metal/common.metal): embedding rows into the residual stream, RMSNorm to bf16, greedy token
// selection into the next step's input slot, device row copies — the encoders, and MetalBackend's rmsnorm and
// its encode_embed / encode_copy_rows hooks. Previous hop: the schedule and GpuBackend (tests:
// csrc/bindings/kernels_common.cpp); next hop: Encoder::dispatch.
#include <algorithm>
#include <stdexcept>
#include <string>

#include "metal_backend.h"

namespace lily::metal {

static_assert(sizeof(EmbedArgs) == 32 && sizeof(RmsNormArgs) == 16 && sizeof(ArgmaxArgs) == 8 && sizeof(CopyArgs) == 32);

void encode_embed(Encoder& enc, const DeviceMatrix& E, View tokens, View x, int T) {
  if (T <= 0) return;
  if (!E.w || E.rows <= 0 || E.cols <= 0)
    throw std::invalid_argument("[embed] empty embedding matrix (rows " + std::to_string(E.rows) + ", cols " +
                                std::to_string(E.cols) + ")");
  const bool quant = E.format != LILY_W_BF16;
  if (quant && E.cols % LILY_QGROUP != 0)
    throw std::invalid_argument("[embed] quantised H = " + std::to_string(E.cols) + " is not a multiple of 64");
  const EmbedArgs args{
      .T = T, .H = E.cols, .V = E.rows, .pad = 0, .w_row_bytes = E.w_row_bytes, .s_row_bytes = E.s_row_bytes};
  const KernelId k = E.format == LILY_W_Q4   ? KernelId::embed_q4_f32
                     : E.format == LILY_W_Q8 ? KernelId::embed_q8_f32
                                             : KernelId::embed_bf16_f32;
  const int per_group = LILY_EMBED_THREADS * LILY_EMBED_VALUES;
  const Grid groups{uint32_t((E.cols + per_group - 1) / per_group), uint32_t(T), 1};
  const Grid threads{uint32_t(LILY_EMBED_THREADS), 1, 1};
  const MatrixBindings m = bind_matrix(E, LILY_EMBED_W, LILY_EMBED_SCALES, LILY_EMBED_BIASES);
  enc.dispatch(k, groups, threads, args,
               {m.w, m.s, m.b,
                {LILY_EMBED_TOKENS, tokens.buffer, tokens.offset, Access::read, uint64_t(T) * 4},
                {LILY_EMBED_X, x.buffer, x.offset, Access::write, uint64_t(T) * E.cols * 4}});
}

void encode_rmsnorm(Encoder& enc, View in, const DeviceVec& w, View out, int T, int n, float eps) {
  if (T <= 0) return;
  if (n <= 0 || w.size != n)
    throw std::invalid_argument("[rmsnorm] width " + std::to_string(n) + " vs weight of " + std::to_string(w.size));
  const RmsNormArgs args{.T = T, .n = n, .eps = eps, .pad = 0};
  // One thread per float4 of the row (n = 2048: 512 threads), at least one simdgroup, at most 1024.
  const int per_thread = n % 4 == 0 ? 4 : 1;
  int threads = (n / per_thread + LILY_SIMD_WIDTH - 1) / LILY_SIMD_WIDTH * LILY_SIMD_WIDTH;
  threads = std::clamp(threads, int(LILY_SIMD_WIDTH), int(LILY_RMSNORM_MAX_THREADS));
  enc.dispatch(KernelId::rmsnorm_f32_bf16, Grid{uint32_t(T), 1, 1}, Grid{uint32_t(threads), 1, 1}, args,
               {{LILY_RMSNORM_IN, in.buffer, in.offset, Access::read, uint64_t(T) * n * 4},
                {LILY_RMSNORM_W, w.buffer, w.offset, Access::read, uint64_t(n) * 4},
                {LILY_RMSNORM_OUT, out.buffer, out.offset, Access::write, uint64_t(T) * n * 2}});
}

void encode_argmax(Encoder& enc, View logits, int V, View token_slot) {
  if (V <= 0) throw std::invalid_argument("[argmax] empty vocabulary (V = " + std::to_string(V) + ")");
  const ArgmaxArgs args{.V = V, .pad = 0};
  // One threadgroup: a second pass (and a barrier) would cost more than the ~250 logits each of 1024 threads
  // reads at V = 248320.
  const int threads = std::min(int(LILY_ARGMAX_THREADS), (V + LILY_SIMD_WIDTH - 1) / LILY_SIMD_WIDTH * LILY_SIMD_WIDTH);
  enc.dispatch(KernelId::argmax_f32, Grid{1, 1, 1}, Grid{uint32_t(threads), 1, 1}, args,
               {{LILY_ARGMAX_LOGITS, logits.buffer, logits.offset, Access::read, uint64_t(V) * 4},
                {LILY_ARGMAX_TOKEN, token_slot.buffer, token_slot.offset, Access::write, 4}});
}

void encode_copy_rows(Encoder& enc, View src, View dst, int rows, uint64_t row_bytes, uint64_t src_stride,
                      uint64_t dst_stride) {
  if (rows <= 0 || row_bytes == 0) return;
  if ((row_bytes | src_stride | dst_stride | src.offset | dst.offset) % 16 != 0 || row_bytes > src_stride ||
      row_bytes > dst_stride)
    throw std::invalid_argument("[copy_rows] row_bytes " + std::to_string(row_bytes) + ", strides " +
                                std::to_string(src_stride) + " / " + std::to_string(dst_stride) +
                                ": multiples of 16, strides at least row_bytes");
  const CopyArgs args{.rows = rows, .pad = 0, .row_bytes = row_bytes, .src_stride = src_stride, .dst_stride = dst_stride};
  const uint64_t words = row_bytes / 16;
  const Grid groups{uint32_t((words + LILY_COPY_THREADS - 1) / LILY_COPY_THREADS), uint32_t(rows), 1};
  enc.dispatch(KernelId::copy_rows, groups, Grid{uint32_t(LILY_COPY_THREADS), 1, 1}, args,
               {{LILY_COPY_SRC, src.buffer, src.offset, Access::read, uint64_t(rows - 1) * src_stride + row_bytes},
                {LILY_COPY_DST, dst.buffer, dst.offset, Access::write, uint64_t(rows - 1) * dst_stride + row_bytes}});
}

// ---------------------------------------------------------------- MetalBackend's rmsnorm, embedding and KV copy hooks, norm weights (metal_backend.h)

const DeviceVec& MetalBackend::vec_of(const Vec& v) const {
  auto it = vecs_.find(&v);
  if (it == vecs_.end()) throw std::logic_error(tag() + " '" + v.name + "' is not a norm weight of the model");
  return it->second;
}

void MetalBackend::rmsnorm(Act in, Act out, const Vec& w, int T) {
  if (in != Act::x) throw std::invalid_argument((tag() + " rmsnorm reads the f32 residual x, not ") + act_name(in));
  encode_rmsnorm(enc(), view(in), vec_of(w), view(out), T, c_.hidden, c_.rms_eps);
}

void MetalBackend::encode_embed(View ids, int T) { lily::metal::encode_embed(enc(), embed_, ids, view(Act::x), T); }

void MetalBackend::encode_copy_rows(View src, View dst, int rows, uint64_t row_bytes, uint64_t src_stride,
                                    uint64_t dst_stride) {
  lily::metal::encode_copy_rows(enc(), src, dst, rows, row_bytes, src_stride, dst_stride);
}

}  // namespace lily::metal
