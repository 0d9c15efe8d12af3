// Decode's attention: the step's one query row against the KV cache, on the tensor cores, split over the keys
// (flash decoding) and merged. (Prefill's attention is flash_attention.cuh.)
//
// A KV head's G query heads (≤ 8) share every key, so a warp computes a tile of 16 keys for all of them with
// two tensor-core products of the KV head's tiles against the group's rows: Sᵀ = K·Qᵀ (keys as the m16 rows,
// the heads as the n8 columns: no padded rows) and Oᵀ += Vᵀ·Pᵀ (head dimensions as the rows). The softmax
// runs on Sᵀ's accumulators and movmatrix turns them into Pᵀ's B fragments, so nothing but K and V goes
// through shared memory. Per key that is 2·D/16 mma where the CUDA-core split it replaced spent ~400
// instructions a lane (8 heads' dot products, five shuffle levels, two exponentials, 8 heads' updates) and
// took 52 µs a layer at 4,096 keys.
//
// Each warp takes a contiguous split of the keys and streams it in tiles of 16 K and V rows (cp.async, 16
// bytes a lane, kAttnStages tiles in flight). Scores are in base 2 (q is scaled by log2(e)/√D), and so are the
// partials' maxima m below.
#pragma once
#include "gemm.cuh"

namespace lily::cuda {

constexpr int kMaxGroup = 8;        // query heads a KV head serves: the n8 of the tiles (16 / 2 in the real model)
constexpr int kDecodeSplits = 128;  // KV splits a KV head (fixed: the step graph's grid)
constexpr int kAttnTileKeys = 16;   // keys a tile: Sᵀ's m16 rows, Oᵀ's k16
constexpr int kAttnStages = 2;      // a warp's tiles in flight
constexpr int kAttnWarps = 4;       // splits (warps) a block
constexpr int kAttnParts = kDecodeSplits / kAttnWarps;  // partials a query head: a block's splits merge in it
constexpr int kCombineWarps = 4;    // attention_combine_kernel's warps: a block's partials split four ways
static_assert(kAttnParts == 32, "attention_combine_kernel takes a partial a lane");

// A staged K or V row: D bf16 and 16 bytes of padding, so ldmatrix's eight rows fall in distinct banks.
template <int D>
__host__ __device__ constexpr int attn_pitch() {
  return D + 8;
}
// A block's dynamic shared memory: each warp's kAttnStages tiles of K and V.
template <int D>
__host__ __device__ constexpr uint32_t attn_smem_bytes() {
  return kAttnWarps * kAttnStages * 2 * kAttnTileKeys * attn_pitch<D>() * 2;
}

// A warp's split of one KV head's cache, keys [s0, s1), staged a tile at a time into `stage` (its
// kAttnStages · 2 tiles). `fresh`, the row at pos, is not copied with the tiles (they go out before the kernel
// that writes it has finished): its tile row is zero-filled, and attend_split copies it from the cache once
// that kernel is done.
template <int D>
struct KvSplit {
  const __nv_bfloat16* K;
  const __nv_bfloat16* V;
  int64_t s0, s1, fresh;
  __nv_bfloat16* stage;
  __device__ int tiles() const { return s1 > s0 ? int((s1 - s0 + kAttnTileKeys - 1) / kAttnTileKeys) : 0; }
  __device__ __nv_bfloat16* k_tile(int t) const {
    return stage + (t % kAttnStages) * 2 * kAttnTileKeys * attn_pitch<D>();
  }
  __device__ __nv_bfloat16* v_tile(int t) const { return k_tile(t) + kAttnTileKeys * attn_pitch<D>(); }
  // Tile t's K and V rows as one commit group (an empty one past the last tile: the waits count groups); rows
  // past s1 are zeros.
  __device__ void issue(int t) const {
    if (t < tiles()) {
      constexpr int kVecs = D / 8;  // 16-byte vectors a row
      __nv_bfloat16 *kt = k_tile(t), *vt = v_tile(t);
      for (int i = threadIdx.x & 31; i < kAttnTileKeys * kVecs; i += 32) {
        const int r = i / kVecs, c = (i % kVecs) * 8;
        const int64_t s = s0 + int64_t(t) * kAttnTileKeys + r;
        const bool read = s < s1 && s != fresh;
        const int64_t at = (read ? s : s0) * D + c;
        cp_async16_once(kt + r * attn_pitch<D>() + c, K + at, read ? 16 : 0);
        cp_async16_once(vt + r * attn_pitch<D>() + c, V + at, read ? 16 : 0);
      }
    }
    cp_async_commit();
  }
};

// One warp's split: the group's G query rows q [G, D] (normed and rotated, unscaled; global or shared memory)
// against the split's keys, its first kAttnStages tiles already issued. Leaves, for the heads h = 2·(lane % 4)
// + {0, 1}: the maximum base-2 score m[h] and the sum l[h] of the split (−inf and 0 when it is empty), and the
// unnormalised output as Oᵀ accumulators, o[t][{0, 1}] at dimension 16·t + lane / 4 and o[t][{2, 3}] at
// dimension 16·t + lane / 4 + 8. Called after the wait on the kernel that wrote the cache's row kv.fresh.
template <int D>
__device__ __forceinline__ void attend_split(const float* q, int G, const KvSplit<D>& kv, float (&o)[D / 16][4],
                                             float (&m)[2], float (&l)[2]) {
  constexpr int P = attn_pitch<D>(), KS = D / 16;
  const int lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
  const float scale = rsqrtf(float(D)) * 1.4426950408889634f;
  uint32_t qb[KS][2];  // Qᵀ's B fragments: head gq, dimensions 16·k + 8·j + 2·tq + {0, 1}
#pragma unroll
  for (int k = 0; k < KS; ++k)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const float* qr = q + gq * D + 16 * k + 8 * j + 2 * tq;
      qb[k][j] = gq < G ? pack_bf16(qr[0] * scale, qr[1] * scale) : 0u;
    }
#pragma unroll
  for (int t = 0; t < KS; ++t)
#pragma unroll
    for (int i = 0; i < 4; ++i) o[t][i] = 0.f;
  m[0] = m[1] = -INFINITY, l[0] = l[1] = 0.f;
  // ldmatrix lane addresses: K as A (key lane % 16, dimension half lane / 16), V as Vᵀ's A (.trans: key
  // lane % 8 + 8·(lane / 16), dimension half (lane / 8) % 2)
  const int k_off = (lane & 15) * P + (lane >> 4) * 8;
  const int v_off = ((lane & 7) + (lane >> 4) * 8) * P + ((lane >> 3) & 1) * 8;
  const int tiles = kv.tiles();
  for (int t = 0; t < tiles; ++t) {
    cp_async_wait<kAttnStages - 1>();
    __syncwarp();  // every lane's copies of tile t
    const int64_t base = kv.s0 + int64_t(t) * kAttnTileKeys;
    __nv_bfloat16 *kt = kv.k_tile(t), *vt = kv.v_tile(t);
    if (kv.fresh >= base && kv.fresh < base + kAttnTileKeys) {
      const int r = int(kv.fresh - base);
      const unsigned short* fk = reinterpret_cast<const unsigned short*>(kv.K + kv.fresh * D);
      const unsigned short* fv = reinterpret_cast<const unsigned short*>(kv.V + kv.fresh * D);
      unsigned short* kr = reinterpret_cast<unsigned short*>(kt + r * P);
      unsigned short* vr = reinterpret_cast<unsigned short*>(vt + r * P);
      for (int j = lane; j < D; j += 32) kr[j] = __ldcg(fk + j), vr[j] = __ldcg(fv + j);  // through L2
      __syncwarp();
    }
    float s[4] = {0.f, 0.f, 0.f, 0.f};  // Sᵀ: keys base + gq ({0, 1}) and + 8 ({2, 3}), heads 2·tq + {0, 1}
#pragma unroll
    for (int k = 0; k < KS; ++k) {
      uint32_t a[4];
      ldmatrix_x4(a, kt + k_off + 16 * k);
      mma_bf16(s, a, qb[k][0], qb[k][1]);
    }
    if (base + gq >= kv.s1) s[0] = s[1] = -INFINITY;
    if (base + gq + 8 >= kv.s1) s[2] = s[3] = -INFINITY;
    float corr[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // key base is in the tile: every head's maximum is finite
      float mx = fmaxf(m[h], fmaxf(s[h], s[h + 2]));
#pragma unroll
      for (int x = 4; x < 32; x <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, x));
      corr[h] = exp2f(m[h] - mx);
      m[h] = mx;
      s[h] = exp2f(s[h] - mx), s[h + 2] = exp2f(s[h + 2] - mx);
      l[h] = fmaf(l[h], corr[h], s[h] + s[h + 2]);
    }
#pragma unroll
    for (int d = 0; d < KS; ++d) o[d][0] *= corr[0], o[d][1] *= corr[1], o[d][2] *= corr[0], o[d][3] *= corr[1];
    // Pᵀ's B fragments (keys 2·tq + {0, 1} and + 8, head gq): the transposes of Sᵀ's 8×8 halves
    const uint32_t b0 = movmatrix_trans(pack_bf16(s[0], s[1])), b1 = movmatrix_trans(pack_bf16(s[2], s[3]));
#pragma unroll
    for (int d = 0; d < KS; ++d) {
      uint32_t a[4];
      ldmatrix_x4_trans(a, vt + v_off + 16 * d);
      mma_bf16(o[d], a, b0, b1);
    }
    __syncwarp();  // every lane is done with the stage
    kv.issue(t + kAttnStages);
  }
  cp_async_wait<0>();
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int x = 4; x < 32; x <<= 1) l[h] += __shfl_xor_sync(0xffffffffu, l[h], x);
}

// Split s of a decode row holds keys [s·len, (s + 1)·len) ∩ [0, n) (the splits after key n − 1's are empty).
__device__ __forceinline__ int64_t split_len(int64_t n) { return (n + kDecodeSplits - 1) / kDecodeSplits; }

// Decode's split-KV attention for the row at pos, after attn_prepare_kernel (q normalised and rotated into qbuf, the
// row at pos written to the cache): a warp per (KV head, split) of kDecodeSplits, blocks of kAttnWarps warps (splits of
// one KV head), attn_smem_bytes of shared memory; a block merges its splits into one partial a query head, part [n_q,
// kAttnParts], and attention_combine_kernel merges those. The tiles go out before the wait on attn_prepare_kernel:
// their rows are earlier steps' (pos is copied in before the step, so no kernel of it writes them), all but the row at
// pos, which the warp holding it copies from the cache after the wait. Many small splits and a merge by another kernel
// measured faster than fewer, longer ones merged inside this kernel by the last block of each KV head (17 / 29 / 63 µs
// a layer at 127 / 1,023 / 4,095 keys). The q/k preparation inside this kernel (Fusions::attn_prepare as one kernel
// fewer: each of a KV head's blocks normalising and rotating the group's 8 query heads itself) measured slower than
// attn_prepare_kernel before it: 12.2 / 12.8 / 18.4 µs a layer against 11.6 / 11.7 / 16.1 (harness, H200, with the
// merge), and 494 / 483 tok/s against 501 / 491 at 128 / 4,096 of context (docs/performance.md, 2026-12-04), so
// CudaBackend runs attn_prepare_decode as the two.
template <int D>
__global__ void __launch_bounds__(kAttnWarps * 32)
    attention_kernel(const float* q_in, const __nv_bfloat16* Kc, const __nv_bfloat16* Vc, int64_t cap,
                     const int64_t* pos_dev, int n_q, int n_kv, float* part) {
  extern __shared__ __align__(16) uint8_t smem[];
  static_assert(kDecodeSplits % kAttnWarps == 0, "a block's splits share their KV head");
  start_next_kernel();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, G = n_q / n_kv;
  const int split = (blockIdx.x * kAttnWarps + warp) % kDecodeSplits, kvh = blockIdx.x * kAttnWarps / kDecodeSplits;
  const int64_t pos = *pos_dev, n = pos + 1, len = split_len(n), s0 = split * len;
  __nv_bfloat16* stage = reinterpret_cast<__nv_bfloat16*>(smem) + warp * (attn_smem_bytes<D>() / 2 / kAttnWarps);
  const KvSplit<D> kv{Kc + int64_t(kvh) * cap * D, Vc + int64_t(kvh) * cap * D, s0, min(s0 + len, n), pos, stage};
  for (int t = 0; t < kAttnStages; ++t) kv.issue(t);
  wait_previous_kernel();
  float o[D / 16][4], m[2], l[2];
  attend_split<D>(q_in + int64_t(kvh) * G * D, G, kv, o, m, l);
  // the block's splits merged into one partial a head: each warp's (m, l, o) into shared memory (the stages'
  // memory: every warp is past its last tile), then a thread an output
  float* ob = reinterpret_cast<float*>(smem);  // [kAttnWarps][kMaxGroup][D]
  __shared__ float ml[kAttnWarps][kMaxGroup][2];
  __syncthreads();
  const int gq = lane >> 2, tq = lane & 3;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float* oh = ob + (warp * kMaxGroup + 2 * tq + h) * D;
#pragma unroll
    for (int d = 0; d < D / 16; ++d) oh[16 * d + gq] = o[d][h], oh[16 * d + gq + 8] = o[d][h + 2];
    if (gq == 0) ml[warp][2 * tq + h][0] = m[h], ml[warp][2 * tq + h][1] = l[h];
  }
  __syncthreads();
  const int part_index = blockIdx.x % kAttnParts;
  for (int i = threadIdx.x; i < G * D; i += kAttnWarps * 32) {
    const int h = i / D, d = i % D;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kAttnWarps; ++w) mx = fmaxf(mx, ml[w][h][0]);
    float acc = 0.f, sum = 0.f;
#pragma unroll
    for (int w = 0; w < kAttnWarps; ++w) {
      const float wt = ml[w][h][0] == -INFINITY ? 0.f : exp2f(ml[w][h][0] - mx);
      acc = fmaf(wt, ob[(w * kMaxGroup + h) * D + d], acc), sum = fmaf(wt, ml[w][h][1], sum);
    }
    float* pp = part + (int64_t(kvh * G + h) * kAttnParts + part_index) * (D + 2);
    pp[2 + d] = acc;
    if (d == 0) pp[0] = mx, pp[1] = sum;
  }
}

// The kAttnParts partials (m, l, o[d]: d + 2 floats each, m in base 2) of one query head merged and gated, 32
// columns of it a block (grid attention_combine_grid, kCombineWarps warps): mix_h = Σ_s w_s·o_s / Σ_s w_s·l_s ·
// σ(gate_h), w_s = 2^(m_s − max_s m_s). Every warp weighs all the partials (a lane each) and sums a quarter of
// them, its loads issued with the weights' (two L2 round trips in all). One block a head over 128 unmerged
// partials read 132 KB through one SM: 9.9 µs a layer (ncu, H200).
__global__ void __launch_bounds__(kCombineWarps * 32)
    attention_combine_kernel(const float* part, int d, const float* q_gate, float* mix) {
  __shared__ float sums[kCombineWarps][32];
  start_next_kernel();
  wait_previous_kernel();
  const int h = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, c = blockIdx.y * 32 + lane;
  part += int64_t(h) * kAttnParts * (d + 2);
  const float m = __ldcg(part + int64_t(lane) * (d + 2)), l = __ldcg(part + int64_t(lane) * (d + 2) + 1);
  float o[kAttnParts / kCombineWarps];
#pragma unroll
  for (int i = 0; i < kAttnParts / kCombineWarps; ++i)
    o[i] = __ldcg(part + int64_t(warp + i * kCombineWarps) * (d + 2) + 2 + c);
  float mx = m;
#pragma unroll
  for (int x = 16; x; x >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, x));
  const float w = m == -INFINITY ? 0.f : exp2f(m - mx);  // (key 0's partial is never empty: mx is finite)
  const float total = warp_sum(w * l);
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < kAttnParts / kCombineWarps; ++i)
    acc = fmaf(__shfl_sync(0xffffffffu, w, warp + i * kCombineWarps), o[i], acc);
  sums[warp][lane] = acc;
  __syncthreads();
  if (warp) return;
  acc = 0.f;
#pragma unroll
  for (int q = 0; q < kCombineWarps; ++q) acc += sums[q][lane];
  mix[int64_t(h) * d + c] = acc / total * sigmoidf_(q_gate[int64_t(2 * h + 1) * d + c]);
}
inline dim3 attention_combine_grid(int n_q, int d) { return dim3(n_q, d / 32); }
// The partials' buffer: kAttnParts a query head.
inline size_t attention_part_floats(int n_q, int d) { return size_t(n_q) * kAttnParts * (d + 2); }

// The decode attention kernels' shared memory beyond the default 48 KB (once, before their first launch).
inline cudaError_t allow_attention_decode_smem() {
  cudaError_t e = cudaSuccess;
  auto allow = [&](auto D) {
    if (e == cudaSuccess)
      e = cudaFuncSetAttribute(attention_kernel<D()>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               int(attn_smem_bytes<D()>()));
  };
  for (int d : {32, 64, 128, 256}) by_head_dim(d, allow);
  return e;
}

}  // namespace lily::cuda
