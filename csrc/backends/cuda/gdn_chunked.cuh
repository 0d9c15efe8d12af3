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
// columns a block. The packs are built in fp32 on the CUDA cores, the scan's products run on the tensor cores as
// three tf32 products each (mma_3xtf32): the state and the solve stay exact to about fp32's rounding.
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
// The scan's shared arrays, each row padded by 8 floats: a tensor-core fragment's loads (lanes 4 apart a row
// apart) then fall in 32 distinct banks.
__host__ __device__ constexpr int gdn_pitch(int n) { return n + 8; }
template <int DK>
constexpr int gdn_scan_smem_bytes() {  // S, Wᵀ, (e^G·Q)ᵀ, Kd, Pᵀ, U, Δ
  constexpr int L = kGdnChunk, J = kGdnCols;
  return (DK * gdn_pitch(J) + 2 * DK * gdn_pitch(L) + L * gdn_pitch(DK) + L * gdn_pitch(L) + 2 * L * gdn_pitch(J)) * 4;
}

__device__ __forceinline__ float dot4(float4 a, float4 b) {
  return fmaf(a.x, b.x, fmaf(a.y, b.y, fmaf(a.z, b.z, a.w * b.w)));
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
  const int warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
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
        const int at = (m0 + g + 8 * (e / 2)) * JP + n0 + 8 * j + 2 * t + e % 2;
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
      const int r = m0 + g + 8 * (e / 2);
      if (r < n)
#pragma unroll
        for (int j = 0; j < 2; ++j)
          mix[int64_t(chunk * L + r) * ldmix + h * dv + jb + n0 + 8 * j + 2 * t + e % 2] = o[j][e];
    }
    cp_async_wait<1>();  // Kd
    __syncthreads();     // every read of S, e^G·Q and P done
    load_qp(chunk + 1);
    float s[kSTiles][4];
#pragma unroll
    for (int j = 0; j < kSTiles; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[j][e] = gL * S[(s0 + g + 8 * (e / 2)) * JP + c0 + 8 * j + 2 * t + e % 2];
    mma_3xtf32(s, Kd, KP, s0, D, JP, c0, L);
#pragma unroll
    for (int j = 0; j < kSTiles; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) S[(s0 + g + 8 * (e / 2)) * JP + c0 + 8 * j + 2 * t + e % 2] = s[j][e];
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
