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
// columns a block. Both kernels' products run on the tensor cores as three tf32 products each (mma_3xtf32): the
// state and the packs stay exact to about fp32's rounding. The triangular solve runs on the CUDA cores.
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

// The scan's shared arrays, each row padded by 8 floats: a tensor-core fragment's loads (lanes 4 apart a row
// apart) then fall in 32 distinct banks.
__host__ __device__ constexpr int gdn_pitch(int n) { return n + 8; }
template <int DK>
constexpr int gdn_scan_smem_bytes() {  // S, Wᵀ, (e^G·Q)ᵀ, Kd, Pᵀ, U, Δ
  constexpr int L = kGdnChunk, J = kGdnCols;
  return (DK * gdn_pitch(J) + 2 * DK * gdn_pitch(L) + L * gdn_pitch(DK) + L * gdn_pitch(L) + 2 * L * gdn_pitch(J)) * 4;
}
template <int DK>
constexpr int gdn_prepare_smem_bytes() {  // Kᵀ, Qᵀ (later the right-hand sides), A, G, β, e^G, (I + A)⁻¹ᵀ
  constexpr int L = kGdnChunk, LP = gdn_pitch(L);
  return (DK * LP + (DK > L ? DK : L) * LP + L * L + 3 * L + L * LP) * 4;
}

__device__ __forceinline__ void split_tf32(float x, uint32_t& hi, uint32_t& lo) {
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(hi) : "f"(x));
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(lo) : "f"(x - __uint_as_float(hi)));
}

__device__ __forceinline__ void mma_tf32(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// acc[j][e]'s place in a warp's mma_3xtf32 tile: row m0 + mma_row(e), column n0 + mma_col(j, e).
__device__ __forceinline__ int mma_row(int e) { return (threadIdx.x & 31) / 4 + 8 * (e / 2); }
__device__ __forceinline__ int mma_col(int j, int e) { return 8 * j + 2 * (threadIdx.x & 3) + e % 2; }

// acc[j] += A·B for a warp's NT tiles of 16 × 8 outputs (rows m0 …, columns n0 + 8j …), over K (a multiple of 8):
// A and B both k-major in shared memory (A[m][k] = a[k·lda + m], B[k][n] = b[k·ldb + n]). Each product is three
// tf32 products, hi·hi + hi·lo + lo·hi of each operand's split x = hi + lo: the state's recurrence keeps fp32's
// accuracy (one tf32 product alone loses ~3 decimal digits a chunk) on the tensor cores. acc[j][·] holds the
// tile's (g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1) for lane = 4g + t.
template <int NT>
__device__ __forceinline__ void mma_3xtf32(float (&acc)[NT][4], const float* a, int lda, int m0, const float* b,
                                           int ldb, int n0, int K) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll 2
  for (int k = 0; k < K; k += 8) {
    const float* ak = a + (k + t) * lda + m0 + g;
    const float av[4] = {ak[0], ak[8], ak[4 * lda], ak[4 * lda + 8]};
    uint32_t ah[4], al[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) split_tf32(av[i], ah[i], al[i]);
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const float* bk = b + (k + t) * ldb + n0 + 8 * j + g;
      uint32_t bh[2], bl[2];
      split_tf32(bk[0], bh[0], bl[0]);
      split_tf32(bk[4 * ldb], bh[1], bl[1]);
      mma_tf32(acc[j], al, bh);
      mma_tf32(acc[j], ah, bl);
      mma_tf32(acc[j], ah, bh);
    }
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
// head), `beta` β; conv the prepared [q ‖ k ‖ v] rows. Its products — K·Kᵀ and Q·Kᵀ over d_k, then W and U, (I + A)⁻¹
// times the chunk's right-hand sides — run on the tensor cores like the scan's (mma_3xtf32, so Q and K are held
// transposed); the triangular solve for (I + A)⁻¹ stays on 64 threads while the others stage the first
// right-hand sides.
template <int DK>
__global__ void __launch_bounds__(kGdnThreads, 2) gdn_chunk_prepare_kernel(const float* conv, const float* beta,
                                                                           const float* log_decay, float* packs,
                                                                           int T, int C, int nk, int nv, int dv) {
  constexpr int L = kGdnChunk, LP = gdn_pitch(L), RC = 64;  // RC: right-hand-side columns a pass
  static_assert(L == 64 && kGdnThreads == 8 * 32 && DK % 32 == 0,
                "eight warps: a 16 × 32 tile of the chunk's [L][L] products or of a pass's [L][RC] outputs each");
  extern __shared__ __align__(16) float sm[];
  float* Kt = sm;                           // [DK][LP]: Kᵀ
  float* Qt = Kt + DK * LP;                 // [DK][LP]: Qᵀ; once read, R [L][LP], a pass's right-hand sides
  float* R = Qt;
  float* As = Qt + (DK > L ? DK : L) * LP;  // [L][L]
  float* G = As + L * L;                    // [L]
  float* B = G + L;                         // [L]
  float* EG = B + L;                        // [L]: e^G
  float* Ti = EG + L;                       // [L][LP]: Ti[c][t] = (I + A)⁻¹[t][c]
  const int chunk = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
  const int t0 = chunk * L, n = min(L, T - t0), kh = h / (nv / nk), Kd = nk * DK;
  float* pack = packs + (int64_t(chunk) * nv + h) * gdn_pack_floats(DK, dv);
  // rows fastest, so that the transposed stores fall in distinct banks
  for (int idx = tid; idx < L * DK / 4; idx += kGdnThreads) {
    const int t = idx % L, i = idx / L * 4;
    float4 q = make_float4(0.f, 0.f, 0.f, 0.f), k = q;
    if (t < n) {
      const float* row = conv + int64_t(t0 + t) * C + kh * DK + i;
      q = *reinterpret_cast<const float4*>(row);
      k = *reinterpret_cast<const float4*>(row + Kd);
    }
    Qt[i * LP + t] = q.x, Qt[(i + 1) * LP + t] = q.y, Qt[(i + 2) * LP + t] = q.z, Qt[(i + 3) * LP + t] = q.w;
    Kt[i * LP + t] = k.x, Kt[(i + 1) * LP + t] = k.y, Kt[(i + 2) * LP + t] = k.z, Kt[(i + 3) * LP + t] = k.w;
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
    EG[tid] = expf(g0), EG[tid + 32] = expf(g1);
  }
  __syncthreads();

  const int warp = tid / 32;
  const int m0 = 16 * (warp / 2), n0 = 32 * (warp % 2);  // the warp's rows and columns of an [L][64] product
  {
    float kk[4][4] = {}, qk[4][4] = {};
    mma_3xtf32(kk, Kt, LP, m0, Kt, LP, n0, DK);
    mma_3xtf32(qk, Qt, LP, m0, Kt, LP, n0, DK);
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int t = m0 + mma_row(e), s = n0 + mma_col(j, e);
        const float decay = s <= t ? expf(G[t] - G[s]) : 0.f;  // masked before the exp: G_t − G_s > 0 above it
        As[t * L + s] = s < t ? B[t] * decay * kk[j][e] : 0.f;
        pack[3 * DK * L + s * L + t] = decay * qk[j][e];  // Pᵀ
      }
  }
  // (e^G·Q)ᵀ and Kd
  for (int idx = tid; idx < DK * L / 4; idx += kGdnThreads) {
    const int i = idx / (L / 4), t = idx % (L / 4) * 4;
    const float4 q = *reinterpret_cast<const float4*>(Qt + i * LP + t);
    *reinterpret_cast<float4*>(pack + DK * L + i * L + t) =
        make_float4(EG[t] * q.x, EG[t + 1] * q.y, EG[t + 2] * q.z, EG[t + 3] * q.w);
  }
  for (int idx = tid; idx < L / 4 * DK; idx += kGdnThreads) {  // four rows a thread: Kᵀ read a float4 at a time
    const int s = idx / DK * 4, i = idx % DK;
    const float4 k = *reinterpret_cast<const float4*>(Kt + i * LP + s);
    const float e[4] = {k.x, k.y, k.z, k.w};
#pragma unroll
    for (int r = 0; r < 4; ++r) pack[2 * DK * L + (s + r) * DK + i] = expf(G[L - 1] - G[s + r]) * e[r];
  }
  if (tid == 0) pack[gdn_pack_u(DK) + L * dv] = EG[L - 1];
  __syncthreads();  // A complete; Qᵀ read

  // R ← the right-hand sides of columns c0 … c0 + RC of [W ‖ U], four rows a thread: β·e^G·K for a column of W,
  // β·V for one of U (V read at row min(s, n − 1): β = 0 past n zeroes it), 0 past the last column
  auto stage_rhs = [&](int c0, int first, int threads) {
    for (int idx = tid - first; idx < L / 4 * RC; idx += threads) {
      const int s = idx / RC * 4, c = idx % RC, col = c0 + c;
      float r[4] = {0.f, 0.f, 0.f, 0.f};
      if (col < DK) {
        const float4 k = *reinterpret_cast<const float4*>(Kt + col * LP + s);
        r[0] = EG[s] * k.x, r[1] = EG[s + 1] * k.y, r[2] = EG[s + 2] * k.z, r[3] = EG[s + 3] * k.w;
      } else if (col < DK + dv) {
        const float* v = conv + int64_t(t0) * C + 2 * Kd + h * dv + col - DK;
#pragma unroll
        for (int e = 0; e < 4; ++e) r[e] = v[int64_t(min(s + e, n - 1)) * C];
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) R[(s + e) * LP + c] = B[s + e] * r[e];
    }
  };
  // (I + A)⁻¹, a column c of it a thread (the right-hand side e_c), kept transposed; the other threads stage the
  // first pass's right-hand sides meanwhile
  if (tid < L) {
    float x[L];
#pragma unroll
    for (int t = 0; t < L; ++t) x[t] = t == tid ? 1.f : 0.f;
    unit_lower_solve(x, As);
#pragma unroll
    for (int t = 0; t < L; t += 4)
      *reinterpret_cast<float4*>(Ti + tid * LP + t) = make_float4(x[t], x[t + 1], x[t + 2], x[t + 3]);
  } else {
    stage_rhs(0, L, kGdnThreads - L);
  }
  __syncthreads();
  // W = (I + A)⁻¹·diag(β·e^G)·K and U = (I + A)⁻¹·diag(β)·V, RC columns a pass
  for (int c0 = 0; c0 < DK + dv; c0 += RC) {
    if (c0 > 0) {
      stage_rhs(c0, 0, kGdnThreads);
      __syncthreads();
    }
    float x[4][4] = {};
    mma_3xtf32(x, Ti, LP, m0, R, LP, n0, L);
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int t = m0 + mma_row(e), col = c0 + n0 + mma_col(j, e);
        if (col < DK)
          pack[col * L + t] = x[j][e];  // Wᵀ
        else if (col < DK + dv)
          pack[gdn_pack_u(DK) + t * dv + col - DK] = x[j][e];
      }
    __syncthreads();  // R read
  }
}

// rows × cols floats (cols a multiple of 4, rows 16-byte aligned) global → shared by the block's threads, as
// cp.async copies of the group being built.
__device__ __forceinline__ void gdn_copy_async(float* dst, int dst_pitch, const float* src, int64_t src_pitch,
                                               int rows, int cols) {
  for (int idx = threadIdx.x; idx < rows * cols / 4; idx += kGdnThreads) {
    const int r = idx / (cols / 4), c = idx % (cols / 4) * 4;
    cp_async16(dst + r * dst_pitch + c, src + r * src_pitch + c, 16);
  }
}

// One block per (value head, 32 state columns), through the chunks in order: Δ = U − W·S, O = (e^G·Q)·S + P·Δ
// (the raw output, into mix: gdn_gated_norm_kernel finishes it), S ← e^(G_L)·S + Kdᵀ·Δ, the three products on
// the tensor cores (mma_3xtf32). The state slice stays in shared memory from the first chunk to the last. The
// chain through the chunks is the kernel's time, so no part of it waits on a load: each of the pack's parts is
// copied in (cp.async) for the next chunk as soon as this chunk's product that reads it is done — W and U after
// Δ, e^G·Q and P after O, Kd after S — and each chunk finds them there (a pack does not fit twice in shared
// memory beside the state).
template <int DK>
__global__ void __launch_bounds__(kGdnThreads) gdn_chunk_scan_kernel(const float* packs, float* rec, float* mix,
                                                                     int ldmix, int T, int nv, int dv) {
  constexpr int L = kGdnChunk, J = kGdnCols, LP = gdn_pitch(L), KP = gdn_pitch(DK), JP = gdn_pitch(J);
  static_assert(kGdnThreads == 8 * 32 && L == 64 && J == 32 && DK % 32 == 0 && DK <= 128,
                "eight warps: a 16 × 16 tile of the chunk's [L][J] outputs each, and DK / 32 16 × 8 tiles of S");
  extern __shared__ __align__(16) float sm[];
  float* S = sm;              // [DK][JP]
  float* Wt = S + DK * JP;    // [DK][LP]
  float* Qt = Wt + DK * LP;   // [DK][LP]
  float* Kd = Qt + DK * LP;   // [L][KP]
  float* Pt = Kd + L * KP;    // [L][LP]
  float* U = Pt + L * LP;     // [L][JP]
  float* D = U + L * JP;      // [L][JP]: Δ
  const int h = blockIdx.x, jb = blockIdx.y * J, tid = threadIdx.x;
  const int chunks = (T + L - 1) / L;
  auto pack_of = [&](int chunk) { return packs + (int64_t(chunk) * nv + h) * gdn_pack_floats(DK, dv); };
  // each part one cp.async group (empty past the last chunk, so that the groups keep their count)
  auto load_wu = [&](int chunk) {
    if (chunk < chunks) {
      gdn_copy_async(Wt, LP, pack_of(chunk), L, DK, L);
      gdn_copy_async(U, JP, pack_of(chunk) + gdn_pack_u(DK) + jb, dv, L, J);
    }
    cp_async_commit();
  };
  auto load_qp = [&](int chunk) {
    if (chunk < chunks) {
      gdn_copy_async(Qt, LP, pack_of(chunk) + DK * L, L, DK, L);
      gdn_copy_async(Pt, LP, pack_of(chunk) + 3 * DK * L, L, L, L);
    }
    cp_async_commit();
  };
  auto load_kd = [&](int chunk) {
    if (chunk < chunks) gdn_copy_async(Kd, KP, pack_of(chunk) + 2 * DK * L, DK, L, DK);
    cp_async_commit();
  };
  float* Sg = rec + int64_t(h) * DK * dv + jb;
  gdn_copy_async(S, JP, Sg, dv, DK, J);
  load_wu(0), load_qp(0), load_kd(0);  // (S in the first group)
  cp_async_wait<2>();                  // S, W and U
  __syncthreads();
  const int warp = tid / 32;
  // Δ and O: the warp's rows m0 …, columns n0 … (two 16 × 8 tiles); S: rows s0 …, columns c0 … (DK / 32 tiles)
  constexpr int kSWarps = 128 / DK, kSTiles = DK / 32;  // warps an S row tile, its column tiles a warp
  const int m0 = 16 * (warp / 2), n0 = 16 * (warp % 2);
  const int s0 = 16 * (warp / kSWarps), c0 = 8 * kSTiles * (warp % kSWarps);
  // at each chunk's start: its W and U in place; its e^G·Q, P and Kd in flight (the two groups pending)
  for (int chunk = 0; chunk < chunks; ++chunk) {
    const float gL = pack_of(chunk)[gdn_pack_u(DK) + L * dv];
    float acc[2][4] = {};
    mma_3xtf32(acc, Wt, LP, m0, S, JP, n0, DK);
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int at = (m0 + mma_row(e)) * JP + n0 + mma_col(j, e);
        D[at] = U[at] - acc[j][e];
      }
    cp_async_wait<1>();  // e^G·Q and P
    __syncthreads();     // Δ complete; W and U read
    load_wu(chunk + 1);
    float o[2][4] = {};
    mma_3xtf32(o, Qt, LP, m0, S, JP, n0, DK);
    mma_3xtf32(o, Pt, LP, m0, D, JP, n0, L);
    const int n = min(L, T - chunk * L);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = m0 + mma_row(e);
      if (r < n)
#pragma unroll
        for (int j = 0; j < 2; ++j)
          mix[int64_t(chunk * L + r) * ldmix + h * dv + jb + n0 + mma_col(j, e)] = o[j][e];
    }
    cp_async_wait<1>();  // Kd
    __syncthreads();     // every read of S, e^G·Q and P done
    load_qp(chunk + 1);
    float s[kSTiles][4];
#pragma unroll
    for (int j = 0; j < kSTiles; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[j][e] = gL * S[(s0 + mma_row(e)) * JP + c0 + mma_col(j, e)];
    mma_3xtf32(s, Kd, KP, s0, D, JP, c0, L);
#pragma unroll
    for (int j = 0; j < kSTiles; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) S[(s0 + mma_row(e)) * JP + c0 + mma_col(j, e)] = s[j][e];
    cp_async_wait<1>();  // the next chunk's W and U
    __syncthreads();     // S complete; Kd read
    load_kd(chunk + 1);
  }
  cp_async_wait<0>();  // (only empty groups left)
  for (int idx = tid; idx < DK * J; idx += kGdnThreads) Sg[(idx / J) * dv + idx % J] = S[(idx / J) * JP + idx % J];
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
