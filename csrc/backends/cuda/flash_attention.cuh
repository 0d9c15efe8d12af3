// Prefill's causal attention on the tensor cores (flash attention: mma.sync bf16, online softmax in fp32).
//
// Inputs as attn_prepare_kernel leaves them: q in qbuf [T, n_q, D] (fp32, normed and rotated, not yet scaled),
// K and V in the bf16 cache [n_kv, cap, D] at rows 0 … pos + T - 1; row t attends keys [0, pos + t]. Output
// mix[t, h·D + c] = softmax(q·Kᵀ / √D)·V · σ(gate), the gate being the second half of head h's q_gate row.
//
// A block serves 64 query rows of one KV head: the group's G query heads of consecutive tokens packed as rows
// r = t·G + g (so each K/V tile in shared memory serves all G heads), four warps of 16 rows. K and V tiles of
// 64 keys are loaded by cp.async, V's while S = Q·Kᵀ is computed and the next K's while P·V is.
#pragma once
#include "gemm.cuh"

namespace lily::cuda {

constexpr int kFlashRows = 64, kFlashKeys = 64, kFlashThreads = 128;

template <int D>
constexpr int flash_smem_bytes() {
  return 3 * 64 * (D + 8) * 2;  // Q, K, V tiles of 64 rows, bf16, each row padded by 16 bytes
}

template <int D>
__global__ void __launch_bounds__(kFlashThreads) flash_attention_kernel(const float* qbuf, const __nv_bfloat16* Kc,
                                                                       const __nv_bfloat16* Vc, int64_t cap,
                                                                       const float* q_gate, float* mix, int ldmix,
                                                                       int T, int n_q, int n_kv,
                                                                       const int64_t* pos_dev) {
  static_assert(D % 32 == 0 && kFlashRows == 4 * 16 && kFlashKeys == 64, "tile shapes");
  constexpr int P = D + 8, NTO = D / 8, NTS = kFlashKeys / 8;
  extern __shared__ __align__(16) uint8_t smem[];
  __nv_bfloat16* Qs = reinterpret_cast<__nv_bfloat16*>(smem);
  __nv_bfloat16* Ks = Qs + kFlashRows * P;
  __nv_bfloat16* Vs = Ks + kFlashKeys * P;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int G = n_q / n_kv, rows = T * G;
  // the heaviest tiles (latest rows, most keys) first
  const int r0 = (gridDim.x - 1 - blockIdx.x) * kFlashRows, kvh = blockIdx.y;
  const int64_t pos = *pos_dev;
  const int last_t = (min(r0 + kFlashRows, rows) - 1) / G;
  const int64_t n_keys = pos + last_t + 1;
  const int key_tiles = int((n_keys + kFlashKeys - 1) / kFlashKeys);
  const __nv_bfloat16* Kh = Kc + int64_t(kvh) * cap * D;
  const __nv_bfloat16* Vh = Vc + int64_t(kvh) * cap * D;

  auto load_kv = [&](const __nv_bfloat16* src, __nv_bfloat16* dst, int tile) {
    constexpr int kVecsPerRow = D / 8;
    for (int i = tid; i < kFlashKeys * kVecsPerRow; i += kFlashThreads) {
      const int r = i / kVecsPerRow, c = (i % kVecsPerRow) * 8;
      const int64_t s = int64_t(tile) * kFlashKeys + r;
      const bool ok = s < n_keys;  // past the block's last key: zeros (the cache there is uninitialised)
      cp_async16(dst + r * P + c, src + (ok ? s : 0) * D + c, ok ? 16 : 0);
    }
  };
  load_kv(Kh, Ks, 0);
  cp_async_commit();

  // Q rows as bf16 (row r: token r / G, head kvh·G + r % G); rows past T·G are zeros and never stored
  for (int i = tid; i < kFlashRows * D / 4; i += kFlashThreads) {
    const int r = i / (D / 4), c = (i % (D / 4)) * 4, rr = r0 + r;
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    if (rr < rows) v = *reinterpret_cast<const float4*>(qbuf + (int64_t(rr / G) * n_q + kvh * G + rr % G) * D + c);
    *reinterpret_cast<uint2*>(Qs + r * P + c) = make_uint2(pack_bf16(v.x, v.y), pack_bf16(v.z, v.w));
  }

  const int g = lane >> 2, tig = lane & 3;
  // this thread's two rows of the warp's 16: g and g + 8; the last key each may see
  int limit[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) limit[h] = int(pos) + (r0 + warp * 16 + g + 8 * h) / G;
  const float scale_log2 = rsqrtf(float(D)) * 1.4426950408889634f;
  float o[NTO][4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
#pragma unroll
  for (int j = 0; j < NTO; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) o[j][i] = 0.f;

  // ldmatrix lane addresses: A (Q) row lane % 16, k half lane / 16; K (non-transposed B) key lane % 8 +
  // 8·(lane / 16), d half (lane / 8) % 2; V (transposed B) key lane % 8 + 8·((lane / 8) % 2), d half lane / 16
  const __nv_bfloat16* q_lane = Qs + (warp * 16 + (lane & 15)) * P + (lane >> 4) * 8;
  const __nv_bfloat16* k_lane = Ks + ((lane & 7) + (lane >> 4) * 8) * P + ((lane >> 3) & 1) * 8;
  const __nv_bfloat16* v_lane = Vs + ((lane & 7) + ((lane >> 3) & 1) * 8) * P + (lane >> 4) * 8;

  for (int kt = 0; kt < key_tiles; ++kt) {
    load_kv(Vh, Vs, kt);
    cp_async_commit();
    cp_async_wait<1>();  // K tile kt
    __syncthreads();

    float s[NTS][4];
#pragma unroll
    for (int j = 0; j < NTS; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) s[j][i] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D; kk += 16) {
      uint32_t qa[4];
      ldmatrix_x4(qa, q_lane + kk);
#pragma unroll
      for (int np = 0; np < NTS / 2; ++np) {
        uint32_t kb[4];
        ldmatrix_x4(kb, k_lane + np * 16 * P + kk);
        mma_bf16(s[2 * np], qa, kb[0], kb[1]);
        mma_bf16(s[2 * np + 1], qa, kb[2], kb[3]);
      }
    }

    // causal mask, online softmax (base 2) per row; every row sees key 0, so m is finite after the first tile
    float mx[2] = {m[0], m[1]};
#pragma unroll
    for (int j = 0; j < NTS; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int key = kt * kFlashKeys + j * 8 + 2 * tig + (i & 1);
        const float v = key <= limit[i >> 1] ? s[j][i] * scale_log2 : -INFINITY;
        s[j][i] = v;
        mx[i >> 1] = fmaxf(mx[i >> 1], v);
      }
    float corr[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
      corr[h] = exp2f(m[h] - mx[h]);
      m[h] = mx[h];
    }
    float sum[2] = {0.f, 0.f};
    uint32_t pa[NTS / 2][4];  // P as the A fragments of P·V: keys 16·kk2 … + 15
#pragma unroll
    for (int j = 0; j < NTS; ++j) {
      const float p0 = exp2f(s[j][0] - m[0]), p1 = exp2f(s[j][1] - m[0]);
      const float p2 = exp2f(s[j][2] - m[1]), p3 = exp2f(s[j][3] - m[1]);
      sum[0] += p0 + p1, sum[1] += p2 + p3;
      pa[j / 2][(j & 1) * 2] = pack_bf16(p0, p1);
      pa[j / 2][(j & 1) * 2 + 1] = pack_bf16(p2, p3);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) l[h] = l[h] * corr[h] + sum[h];
#pragma unroll
    for (int j = 0; j < NTO; ++j) o[j][0] *= corr[0], o[j][1] *= corr[0], o[j][2] *= corr[1], o[j][3] *= corr[1];

    __syncthreads();  // every warp is done with K tile kt
    if (kt + 1 < key_tiles) load_kv(Kh, Ks, kt + 1);
    cp_async_commit();
    cp_async_wait<1>();  // V tile kt
    __syncthreads();
#pragma unroll
    for (int kk2 = 0; kk2 < NTS / 2; ++kk2)
#pragma unroll
      for (int dp = 0; dp < NTO / 2; ++dp) {
        uint32_t vb[4];
        ldmatrix_x4_trans(vb, v_lane + kk2 * 16 * P + dp * 16);
        mma_bf16(o[2 * dp], pa[kk2], vb[0], vb[1]);
        mma_bf16(o[2 * dp + 1], pa[kk2], vb[2], vb[3]);
      }
    __syncthreads();  // every warp is done with V tile kt
  }

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    const int rr = r0 + warp * 16 + g + 8 * h;
    if (rr >= rows) continue;
    const int t = rr / G, head = kvh * G + rr % G;
    const float inv = 1.f / l[h];
    const float* gate = q_gate + (int64_t(t) * 2 * n_q + 2 * head) * D + D;
    float* out = mix + int64_t(t) * ldmix + head * D;
#pragma unroll
    for (int j = 0; j < NTO; ++j) {
      const int c = j * 8 + 2 * tig;
      const float2 gv = *reinterpret_cast<const float2*>(gate + c);
      *reinterpret_cast<float2*>(out + c) =
          make_float2(o[j][2 * h] * inv * sigmoidf_(gv.x), o[j][2 * h + 1] * inv * sigmoidf_(gv.y));
    }
  }
}

template <int D>
void launch_flash_attention(const float* qbuf, const __nv_bfloat16* Kc, const __nv_bfloat16* Vc, int64_t cap,
                            const float* q_gate, float* mix, int ldmix, int T, int n_q, int n_kv,
                            const int64_t* pos_dev, cudaStream_t stream) {
  constexpr int bytes = flash_smem_bytes<D>();
  static const cudaError_t raised =
      cudaFuncSetAttribute(flash_attention_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  (void)raised;  // a failure shows as the launch's error
  const dim3 grid((T * (n_q / n_kv) + kFlashRows - 1) / kFlashRows, n_kv);
  flash_attention_kernel<D><<<grid, kFlashThreads, bytes, stream>>>(qbuf, Kc, Vc, cap, q_gate, mix, ldmix, T, n_q,
                                                                    n_kv, pos_dev);
}

}  // namespace lily::cuda
