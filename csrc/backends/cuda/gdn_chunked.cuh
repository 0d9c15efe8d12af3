// Prefill's Gated DeltaNet recurrence in chunks of 64 rows (the WY / UT-transform form of the delta rule).
//
// Per value head h and row t (q, k l2-normalised, q · d_k^-1/2, β = σ(b), log-decay λ_t = -A·softplus(a + dt_bias)
// as gdn_prepare_kernel leaves them): S ← e^λ_t·S, δ_t = β_t·(v_t − Sᵀk_t), S ← S + k_t·δ_tᵀ, o_t = Sᵀq_t, the state
// S [d_k, d_v] fp32. Within a chunk with incoming state S₀ and G_t = Σ_{s≤t} λ_s (inclusive, within the chunk),
// unrolling the rows gives, with Δ the chunk's rows δ_t:
//   (I + A)·Δ = diag(β)·V − diag(β·e^G)·K·S₀,   A[t][s] = β_t·e^(G_t − G_s)·(k_t·k_s) for s < t, else 0
// so Δ = U − W·S₀ with U = (I + A)⁻¹·diag(β)·V and W = (I + A)⁻¹·diag(β·e^G)·K (neither depends on S₀), and
//   O = diag(e^G)·Q·S₀ + P·Δ,   P[t][s] = e^(G_t − G_s)·(q_t·k_s) for s ≤ t, else 0
//   S_end = e^(G_L)·S₀ + Kdᵀ·Δ,   Kd[s] = e^(G_L − G_s)·k_s   (L the chunk's last row).
// Two kernels: gdn_chunk_prepare_kernel builds W, U, P, e^G·Q and Kd for every (chunk, value head) at once (the
// work that does not need the state: all of the chunk's row-by-row dependence is in the triangular solve), and
// gdn_chunk_scan_kernel carries the state through the chunks in order, three small products a chunk, for 32 state
// columns a block. All fp32 on the CUDA cores: the state and the solve stay exact to fp32 rounding.
#pragma once
#include "gemm.cuh"  // cp.async

namespace lily::cuda {

constexpr int kGdnChunk = 64;    // rows a chunk
constexpr int kGdnThreads = 256;  // both kernels
constexpr int kGdnCols = 32;     // state columns a scan block carries

// One (chunk, value head)'s pack, as gdn_chunk_scan_kernel reads it: Wᵀ [d_k][64], (e^G·Q)ᵀ [d_k][64], Kd [64][d_k],
// Pᵀ [64][64] (contiguous, in that order), U [64][d_v], then e^(G_L) and 3 floats of padding (16-byte alignment).
// Rows past a partial chunk's end are zero throughout.
__host__ __device__ constexpr int gdn_pack_floats(int dk, int dv) {
  return 3 * dk * kGdnChunk + kGdnChunk * kGdnChunk + kGdnChunk * dv + 4;
}
__host__ __device__ constexpr int gdn_pack_u(int dk) { return 3 * dk * kGdnChunk + kGdnChunk * kGdnChunk; }

template <int DK>
constexpr int gdn_prepare_smem_bytes() {
  // K, Q (rows padded), A, G, β, (I + A)⁻¹ (rows padded)
  return (2 * kGdnChunk * (DK + 4) + kGdnChunk * kGdnChunk + 2 * kGdnChunk + kGdnChunk * (kGdnChunk + 4)) * 4;
}
template <int DK>
constexpr int gdn_scan_smem_bytes() {
  return (DK * kGdnCols + gdn_pack_u(DK) + 2 * kGdnChunk * kGdnCols) * 4;  // S, Wᵀ … Pᵀ, U, Δ
}

__device__ __forceinline__ float dot4(float4 a, float4 b) {
  return fmaf(a.x, b.x, fmaf(a.y, b.y, fmaf(a.z, b.z, a.w * b.w)));
}

// acc[r][c] += Σ_k a[k·lda + r0 + r] · b[k·ldb + c0 + c] for r < 2, c < 4: two columns of a k-major a times four
// columns of b (r0 even, c0 a multiple of 4: one float2 and one float4 load a step).
__device__ __forceinline__ void tile_mac(float (&acc)[2][4], const float* a, int lda, int r0, const float* b, int ldb,
                                         int c0, int K) {
#pragma unroll 8
  for (int k = 0; k < K; ++k) {
    const float2 x = *reinterpret_cast<const float2*>(a + k * lda + r0);
    const float4 y = *reinterpret_cast<const float4*>(b + k * ldb + c0);
    const float xr[2] = {x.x, x.y}, yc[4] = {y.x, y.y, y.z, y.w};
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[r][c] = fmaf(xr[r], yc[c], acc[r][c]);
  }
}

// x ← (I + A)⁻¹·x for A [64][64] strictly lower triangular (row-major, shared): forward substitution
// x_t ← x_t − Σ_{s<t} A[t][s]·x_s, the 64 rows in registers (both loops unrolled). A's rows are read four
// entries at a time by volatile loads, which the compiler keeps in program order: unordered, it hoists all 2016
// of them and spills.
__device__ __forceinline__ void unit_lower_solve(float (&x)[kGdnChunk], const float* A) {
  const uint32_t base = uint32_t(__cvta_generic_to_shared(A));
#pragma unroll
  for (int t = 1; t < kGdnChunk; ++t)
#pragma unroll
    for (int s = 0; s < t; s += 4) {
      float a[4];
      asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];"
                   : "=f"(a[0]), "=f"(a[1]), "=f"(a[2]), "=f"(a[3])
                   : "r"(base + uint32_t(t * kGdnChunk + s) * 4u));
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (s + e < t) x[t] = fmaf(-a[e], x[s + e], x[t]);
    }
}

// One block per (chunk, value head): the chunk's pack (see gdn_pack_floats). `log_decay` holds λ per (row, value
// head), `beta` β; conv the prepared [q ‖ k ‖ v] rows.
template <int DK>
__global__ void __launch_bounds__(kGdnThreads) gdn_chunk_prepare_kernel(const float* conv, const float* beta,
                                                                        const float* log_decay, float* packs, int T,
                                                                        int C, int nk, int nv, int dv) {
  constexpr int L = kGdnChunk, KP = DK + 4, TP = L + 4;  // rows padded by 4 floats: float4 accesses hit all banks
  static_assert(L == 64 && kGdnThreads == 4 * L && DK % 4 == 0, "the prefix sum, the dot-product split");
  extern __shared__ __align__(16) float sm[];
  float* Ks = sm;            // [L][KP]
  float* Qs = Ks + L * KP;   // [L][KP]
  float* As = Qs + L * KP;   // [L][L]
  float* G = As + L * L;     // [L]
  float* B = G + L;          // [L]
  float* Ti = B + L;         // [L][TP]
  const int chunk = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
  const int t0 = chunk * L, n = min(L, T - t0), kh = h / (nv / nk), Kd = nk * DK;
  float* pack = packs + (int64_t(chunk) * nv + h) * gdn_pack_floats(DK, dv);
  for (int idx = tid; idx < L * DK / 4; idx += kGdnThreads) {
    const int t = idx / (DK / 4), i = idx % (DK / 4) * 4;
    float4 q = make_float4(0.f, 0.f, 0.f, 0.f), k = q;
    if (t < n) {
      const float* row = conv + int64_t(t0 + t) * C + kh * DK + i;
      q = *reinterpret_cast<const float4*>(row);
      k = *reinterpret_cast<const float4*>(row + Kd);
    }
    *reinterpret_cast<float4*>(Qs + t * KP + i) = q;
    *reinterpret_cast<float4*>(Ks + t * KP + i) = k;
  }
  if (tid < 32) {
    // G: inclusive prefix sum of λ, lane l holding rows l and l + 32; rows past n decay by nothing (λ = 0, β = 0)
    const int64_t r0 = int64_t(t0 + tid) * nv + h, r1 = r0 + int64_t(32) * nv;
    float g0 = tid < n ? log_decay[r0] : 0.f, g1 = tid + 32 < n ? log_decay[r1] : 0.f;
    B[tid] = tid < n ? beta[r0] : 0.f;
    B[tid + 32] = tid + 32 < n ? beta[r1] : 0.f;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const float u0 = __shfl_up_sync(0xffffffffu, g0, o), u1 = __shfl_up_sync(0xffffffffu, g1, o);
      if (tid >= o) g0 += u0, g1 += u1;
    }
    g1 += __shfl_sync(0xffffffffu, g0, 31);
    G[tid] = g0, G[tid + 32] = g1;
  }
  __syncthreads();

  // k_t·k_s and q_t·k_s for column s and rows t = 16·tq … 16·tq + 15 (a warp shares tq: those rows broadcast)
  {
    const int s = tid % L, tq = tid / L;
    float kk[16], qk[16];
#pragma unroll
    for (int m = 0; m < 16; ++m) kk[m] = qk[m] = 0.f;
#pragma unroll 1
    for (int i = 0; i < DK; i += 4) {
      const float4 ks = *reinterpret_cast<const float4*>(Ks + s * KP + i);
#pragma unroll
      for (int m = 0; m < 16; ++m) {
        const int t = tq * 16 + m;
        kk[m] += dot4(*reinterpret_cast<const float4*>(Ks + t * KP + i), ks);
        qk[m] += dot4(*reinterpret_cast<const float4*>(Qs + t * KP + i), ks);
      }
    }
    float p[16];
#pragma unroll
    for (int m = 0; m < 16; ++m) {
      const int t = tq * 16 + m;
      const float decay = s <= t ? expf(G[t] - G[s]) : 0.f;  // masked before the exp: G_t − G_s > 0 above it
      As[t * L + s] = s < t ? B[t] * decay * kk[m] : 0.f;
      p[m] = decay * qk[m];
    }
    float* prow = pack + 3 * DK * L + s * L + tq * 16;  // Pᵀ row s
#pragma unroll
    for (int m = 0; m < 16; m += 4)
      *reinterpret_cast<float4*>(prow + m) = make_float4(p[m], p[m + 1], p[m + 2], p[m + 3]);
  }
  // (e^G·Q)ᵀ, one row i a thread, and Kd
  for (int i = tid; i < DK; i += kGdnThreads) {
    float* qrow = pack + DK * L + i * L;
    for (int t = 0; t < L; t += 4)
      *reinterpret_cast<float4*>(qrow + t) =
          make_float4(expf(G[t]) * Qs[t * KP + i], expf(G[t + 1]) * Qs[(t + 1) * KP + i],
                      expf(G[t + 2]) * Qs[(t + 2) * KP + i], expf(G[t + 3]) * Qs[(t + 3) * KP + i]);
  }
  for (int idx = tid; idx < L * DK / 4; idx += kGdnThreads) {
    const int s = idx / (DK / 4), i = idx % (DK / 4) * 4;
    const float d = expf(G[L - 1] - G[s]);
    const float4 k = *reinterpret_cast<const float4*>(Ks + s * KP + i);
    *reinterpret_cast<float4*>(pack + 2 * DK * L + s * DK + i) = make_float4(d * k.x, d * k.y, d * k.z, d * k.w);
  }
  if (tid == 0) pack[gdn_pack_u(DK) + L * dv] = expf(G[L - 1]);
  __syncthreads();  // A complete

  // (I + A)⁻¹, a column c of it a thread (the right-hand side e_c), kept transposed: Ti[c][t] = (I + A)⁻¹[t][c]
  if (tid < L) {
    float x[L];
#pragma unroll
    for (int t = 0; t < L; ++t) x[t] = t == tid ? 1.f : 0.f;
    unit_lower_solve(x, As);
#pragma unroll
    for (int t = 0; t < L; t += 4)
      *reinterpret_cast<float4*>(Ti + tid * TP + t) = make_float4(x[t], x[t + 1], x[t + 2], x[t + 3]);
  }
  __syncthreads();
  // W = (I + A)⁻¹·diag(β·e^G)·K (columns < DK) and U = (I + A)⁻¹·diag(β)·V (columns DK …), a column a thread:
  // x += (I + A)⁻¹[:, s]·rhs_s over the rows s (V read at row min(s, n - 1): β = 0 past n zeroes it)
  for (int col = tid; col < DK + dv; col += kGdnThreads) {
    const bool is_w = col < DK;
    const float* v = conv + int64_t(t0) * C + 2 * Kd + h * dv + (col - DK);
    float x[L];
#pragma unroll
    for (int t = 0; t < L; ++t) x[t] = 0.f;
#pragma unroll 4
    for (int s = 0; s < L; ++s) {
      const float r = B[s] * (is_w ? expf(G[s]) * Ks[s * KP + col] : v[int64_t(min(s, n - 1)) * C]);
#pragma unroll
      for (int t = 0; t < L; t += 4) {
        const float4 a = *reinterpret_cast<const float4*>(Ti + s * TP + t);
        x[t] = fmaf(a.x, r, x[t]), x[t + 1] = fmaf(a.y, r, x[t + 1]);
        x[t + 2] = fmaf(a.z, r, x[t + 2]), x[t + 3] = fmaf(a.w, r, x[t + 3]);
      }
    }
    if (is_w) {
      float* wrow = pack + col * L;  // Wᵀ row col
#pragma unroll
      for (int t = 0; t < L; t += 4)
        *reinterpret_cast<float4*>(wrow + t) = make_float4(x[t], x[t + 1], x[t + 2], x[t + 3]);
    } else {
      float* u = pack + gdn_pack_u(DK) + (col - DK);
#pragma unroll
      for (int t = 0; t < L; ++t) u[t * dv] = x[t];
    }
  }
}

// n floats (a multiple of 4, both ends 16-byte aligned) global → shared by the block's threads, as cp.async copies
// of the group being built.
__device__ __forceinline__ void gdn_copy_async(float* dst, const float* src, int n) {
  for (int i = 4 * int(threadIdx.x); i < n; i += 4 * kGdnThreads) cp_async16(dst + i, src + i, 16);
}

// One block per (value head, 32 state columns), through the chunks in order: Δ = U − W·S, O = (e^G·Q)·S + P·Δ
// (the raw output, into mix: gdn_gated_norm_kernel finishes it), S ← e^(G_L)·S + Kdᵀ·Δ. The state slice stays in
// shared memory from the first chunk to the last. The chain through the chunks is the kernel's time, so no part
// of it waits on a load: each of the pack's parts is copied in (cp.async) for the next chunk as soon as this
// chunk's product that reads it is done — W and U after Δ, e^G·Q and P after O, Kd after S — and each chunk
// finds them there (a pack does not fit twice in shared memory beside the state).
template <int DK>
__global__ void __launch_bounds__(kGdnThreads) gdn_chunk_scan_kernel(const float* packs, float* rec, float* mix,
                                                                     int ldmix, int T, int nv, int dv) {
  constexpr int L = kGdnChunk, J = kGdnCols;
  static_assert(kGdnThreads == (L / 2) * (J / 4), "a 2 × 4 tile of the chunk's [L][J] outputs a thread");
  extern __shared__ __align__(16) float sm[];
  float* S = sm;                       // [DK][J]
  float* Wt = S + DK * J;              // [DK][L]; then Qt [DK][L], Kd [L][DK], Pt [L][L], as in the pack
  float* Qt = Wt + DK * L;
  float* Kd = Qt + DK * L;
  float* Pt = Kd + L * DK;
  float* U = Wt + gdn_pack_u(DK);      // [L][J]
  float* D = U + L * J;                // [L][J]: Δ
  const int h = blockIdx.x, jb = blockIdx.y * J, tid = threadIdx.x;
  const int chunks = (T + L - 1) / L;
  auto pack_of = [&](int chunk) { return packs + (int64_t(chunk) * nv + h) * gdn_pack_floats(DK, dv); };
  // each part one cp.async group (empty past the last chunk, so that the groups keep their count)
  auto load_wu = [&](int chunk) {
    if (chunk < chunks) {
      const float* pack = pack_of(chunk);
      gdn_copy_async(Wt, pack, DK * L);
      for (int idx = tid; idx < L * J / 4; idx += kGdnThreads) {
        const int t = idx / (J / 4), c = idx % (J / 4) * 4;
        cp_async16(U + t * J + c, pack + gdn_pack_u(DK) + t * dv + jb + c, 16);
      }
    }
    cp_async_commit();
  };
  auto load_qp = [&](int chunk) {
    if (chunk < chunks) {
      gdn_copy_async(Qt, pack_of(chunk) + DK * L, DK * L);
      gdn_copy_async(Pt, pack_of(chunk) + 3 * DK * L, L * L);
    }
    cp_async_commit();
  };
  auto load_kd = [&](int chunk) {
    if (chunk < chunks) gdn_copy_async(Kd, pack_of(chunk) + 2 * DK * L, L * DK);
    cp_async_commit();
  };
  float* Sg = rec + int64_t(h) * DK * dv + jb;
  for (int idx = tid; idx < DK * J; idx += kGdnThreads) S[idx] = Sg[(idx / J) * dv + idx % J];
  load_wu(0), load_qp(0), load_kd(0);
  cp_async_wait<2>();  // W and U
  __syncthreads();
  const int tr = 2 * (tid / (J / 4)), tc = 4 * (tid % (J / 4));
  // at each chunk's start: its W and U in place; its e^G·Q, P and Kd in flight (the two groups pending)
  for (int chunk = 0; chunk < chunks; ++chunk) {
    const float gL = pack_of(chunk)[gdn_pack_u(DK) + L * dv];
    float acc[2][4] = {};
    tile_mac(acc, Wt, L, tr, S, J, tc, DK);
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int c = 0; c < 4; ++c) D[(tr + r) * J + tc + c] = U[(tr + r) * J + tc + c] - acc[r][c];
    cp_async_wait<1>();  // e^G·Q and P
    __syncthreads();     // Δ complete; W and U read
    load_wu(chunk + 1);
    float o[2][4] = {};
    tile_mac(o, Qt, L, tr, S, J, tc, DK);
    tile_mac(o, Pt, L, tr, D, J, tc, L);
    const int n = min(L, T - chunk * L);
#pragma unroll
    for (int r = 0; r < 2; ++r)
      if (tr + r < n) {
        float* out = mix + int64_t(chunk * L + tr + r) * ldmix + h * dv + jb + tc;
#pragma unroll
        for (int c = 0; c < 4; ++c) out[c] = o[r][c];
      }
    cp_async_wait<1>();  // Kd
    __syncthreads();     // every read of S, e^G·Q and P done
    load_qp(chunk + 1);
    for (int tile = tid; tile < (DK / 2) * (J / 4); tile += kGdnThreads) {
      const int ir = 2 * (tile / (J / 4)), ic = 4 * (tile % (J / 4));
      float s[2][4] = {};
      tile_mac(s, Kd, DK, ir, D, J, ic, L);
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int c = 0; c < 4; ++c) S[(ir + r) * J + ic + c] = fmaf(gL, S[(ir + r) * J + ic + c], s[r][c]);
    }
    cp_async_wait<1>();  // the next chunk's W and U
    __syncthreads();     // S complete; Kd read
    load_kd(chunk + 1);
  }
  cp_async_wait<0>();  // (only empty groups left)
  for (int idx = tid; idx < DK * J; idx += kGdnThreads) Sg[(idx / J) * dv + idx % J] = S[idx];
}

// The recurrence over T prepared rows, state rec [n_v][d_k][d_v] in and out; packs holds ⌈T/64⌉·n_v packs.
template <int DK>
void launch_gdn_chunked(const float* conv, const float* beta, const float* log_decay, float* packs, float* rec,
                        float* mix, int ldmix, int T, int C, int nk, int nv, int dv, cudaStream_t stream) {
  constexpr int prep_bytes = gdn_prepare_smem_bytes<DK>(), scan_bytes = gdn_scan_smem_bytes<DK>();
  static const cudaError_t raised[] = {
      cudaFuncSetAttribute(gdn_chunk_prepare_kernel<DK>, cudaFuncAttributeMaxDynamicSharedMemorySize, prep_bytes),
      cudaFuncSetAttribute(gdn_chunk_scan_kernel<DK>, cudaFuncAttributeMaxDynamicSharedMemorySize, scan_bytes)};
  (void)raised;  // a failure shows as the launch's error
  const int chunks = (T + kGdnChunk - 1) / kGdnChunk;
  gdn_chunk_prepare_kernel<DK><<<dim3(chunks, nv), kGdnThreads, prep_bytes, stream>>>(conv, beta, log_decay, packs,
                                                                                     T, C, nk, nv, dv);
  gdn_chunk_scan_kernel<DK><<<dim3(nv, dv / kGdnCols), kGdnThreads, scan_bytes, stream>>>(packs, rec, mix, ldmix, T,
                                                                                         nv, dv);
}

}  // namespace lily::cuda
