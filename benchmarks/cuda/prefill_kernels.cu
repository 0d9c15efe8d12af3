// Correctness and speed of the CUDA backend's prefill kernels (gemm.cuh, flash_attention.cuh, gdn_chunked.cuh) on
// fresh random data, each against a naive fp32 reference kernel in this file, at the model's shapes; exits 1 on a
// failure.
//
//   nvcc -std=c++17 -gencode=arch=compute_90a,code=sm_90a -O3 -I csrc benchmarks/cuda/prefill_kernels.cu \
//        -o build/prefill_kernels && build/prefill_kernels
//
// `build/prefill_kernels --small` runs only the small shapes, untimed (for compute-sanitizer).
// With -DLILY_OLD_KERNELS='"path"' (a copy of an earlier kernels.cuh whose namespace is renamed lily::old) the
// earlier gemm_kernel / attention_kernel are timed on the same data too.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backends/cuda/flash_attention.cuh"
#include "backends/cuda/gdn_chunked.cuh"
#include "harness.cuh"
#ifdef LILY_OLD_KERNELS
#include LILY_OLD_KERNELS
#endif

using namespace lily::cuda;
using namespace lily::cuda::harness;

namespace {

// ---------------------------------------------------------------- GEMM

__device__ float round_bf16(float x) { return __bfloat162float(__float2bfloat16(x)); }

// One thread per output (p, n): the expert of p found by scanning the offsets. `rounded`: weights and
// activations rounded to bf16 first (what the tensor cores multiply), else exact fp32. A SwiGLU product
// (a.up given): SiLU of the gate's dot times the up's, both in fp32.
__global__ void ref_gemm_kernel(GemmArgs a, bool rounded) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= int64_t(a.M) * a.W.rows) return;
  const int p = int(idx / a.W.rows), n = int(idx % a.W.rows);
  int e = 0;
  if (a.counts) {
    e = -1;
    for (int i = 0; i < a.groups; ++i)
      if (p >= a.offsets[i] && p < a.offsets[i] + a.counts[i]) e = i;
    if (e < 0) return;
  }
  const float* x = a.X + int64_t(a.in_rows ? a.in_rows[p] / a.in_div : p) * a.ldx;
  float acc = 0.f, up = 0.f;
  for (int k = 0; k < a.W.cols; ++k) {
    float w = ref_weight(a.W, e, n, k), xv = x[k];
    if (rounded) w = round_bf16(w), xv = round_bf16(xv);
    acc = fmaf(w, xv, acc);
    if (a.up.w) {
      float u = ref_weight(a.up, e, n, k);
      if (rounded) u = round_bf16(u);
      up = fmaf(u, xv, up);
    }
  }
  if (a.up.w) acc = acc / (1.f + expf(-acc)) * up;
  float* y = a.Y + int64_t(p) * a.ldy + n;
  *y = a.accumulate ? *y + acc : acc;
}

#ifdef LILY_OLD_KERNELS
lily::old::GemmArgs old_args(const GemmArgs& a) {
  lily::old::LinDev w;
  std::memcpy(&w, &a.W, sizeof w);
  static_assert(sizeof(lily::old::LinDev) == sizeof(LinDev), "same LinDev");
  return {w, a.X, a.ldx, a.Y, a.ldy, a.M, a.counts, a.offsets, a.in_rows, a.in_div, a.accumulate};
}
#endif

// One product with each tile checked against both references (bf16-rounded inputs: tight; exact fp32:
// bf16's error), and timed (gemm()'s choice of tile, and each tile).
void check_gemm(const char* what, GemmArgs a, int rows_out, const std::vector<float>& y0, bool time,
                int old_m_tiles) {
  const size_t ny = size_t(rows_out) * a.ldy;
  auto run_ref = [&](bool rounded) {
    CK(cudaMemcpy(a.Y, y0.data(), ny * 4, cudaMemcpyHostToDevice));
    const int64_t n = int64_t(a.M) * a.W.rows;
    ref_gemm_kernel<<<int((n + 255) / 256), 256>>>(a, rounded);
    CK(cudaGetLastError());
    return download(a.Y, ny);
  };
  const auto ref_rounded = run_ref(true), ref_exact = run_ref(false);
  GemmScratch xh;
  xh.elems = gemm_x_bf16_elems(gemm_x_rows(a), a.W.cols);
  CK(cudaMalloc(&xh.xh, xh.elems * sizeof(__nv_bfloat16)));
  Err tight, loose;  // the worst over the tiles
  for (const GemmTile t : kGemmTiles) {
    CK(cudaMemcpy(a.Y, y0.data(), ny * 4, cudaMemcpyHostToDevice));
    gemm_x_bf16(a, xh, 0);
    gemm_launch(a, t, xh, 0);
    CK(cudaGetLastError());
    const auto got = download(a.Y, ny);
    const Err et = compare(got, ref_rounded), el = compare(got, ref_exact);
    tight = {std::max(tight.max_rel, et.max_rel), std::max(tight.mean_rel, et.mean_rel)};
    loose = {std::max(loose.max_rel, el.max_rel), std::max(loose.mean_rel, el.mean_rel)};
  }
  float ms_new = 0, ms_old = 0;
  const double flop = (a.up.w ? 4.0 : 2.0) * a.M * a.W.rows * a.W.cols;
  if (time && !a.accumulate) {
    ms_new = time_ms([&] { gemm(a, xh, 0); });
#ifdef LILY_OLD_KERNELS
    const auto o = old_args(a);
    ms_old = time_ms([&] {
      lily::old::gemm_kernel<<<dim3((a.W.rows + lily::old::kTileN - 1) / lily::old::kTileN, old_m_tiles,
                                    a.counts ? a.groups : 1),
                               256>>>(o);
    });
#endif
  }
  (void)old_m_tiles;
  char shape[96];
  std::snprintf(shape, sizeof shape, "%s %s M=%d N=%d K=%d%s", what, format_name(a.W.bits, a.W.wdt, a.W.sdt), a.M,
                a.W.rows, a.W.cols, a.accumulate ? " +=" : a.up.w ? " swiglu" : "");
  report("gemm", shape, tight, 2e-3, 2e-4, flop, ms_new, ms_old);
  report("", "  (vs exact fp32)", loose, 1.5e-2, 4e-3, 0, 0, 0);
  if (ms_new > 0) {
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const GemmTile picked = gemm_tile(a, sms);
    std::printf("      gemm() takes %dx%d; tiles (rows x weight rows):", picked.bm, kGemmTileN);
    for (const GemmTile t : kGemmTiles)
      std::printf("  %dx%d: %.1f TFLOP/s", t.bm, kGemmTileN, flop / time_ms([&] {
                                                                     gemm_x_bf16(a, xh, 0);
                                                                     gemm_launch(a, t, xh, 0);
                                                                   }) * 1e-9);
    std::printf("\n");
  }  cudaFree(xh.xh);
}

// `swiglu`: a gate/up pair of such matrices as one SwiGLU product.
void dense_case(int M, int N, int K, int bits, int wdt, int sdt, int group, bool accumulate, bool time,
                bool swiglu = false) {
  Weights w, u;
  make_weights(w, 1, N, K, bits, wdt, sdt, group);
  if (swiglu) make_weights(u, 1, N, K, bits, wdt, sdt, group);
  const int ldx = K + 32, ldy = N + 8;  // strided rows, as the backend's activations can be
  float* X = upload(random_floats(size_t(M) * ldx, -2.f, 2.f));
  const auto y0 = random_floats(size_t(M) * ldy, -1.f, 1.f);
  float* Y = upload(y0);
  GemmArgs a{w.W, X, ldx, Y, ldy, M, nullptr, nullptr, nullptr, 1, accumulate, 1};
  if (swiglu) a.up = u.W;
  check_gemm("dense", a, M, y0, time, (M + 63) / 64);
  cudaFree(X);
  cudaFree(Y);
}

// T tokens routed to top_k of E experts (random, some experts empty, one crowded), gate/up-style (rows of X
// gathered per slot) or down-style (X already in slot order); `swiglu`: gate and up as one SwiGLU product.
void grouped_case(int T, int E, int top_k, int N, int K, bool gather, bool time, bool swiglu = false) {
  Weights w, u;
  make_weights(w, E, N, K, 4, kBF16, kBF16, 64);
  if (swiglu) make_weights(u, E, N, K, 4, kBF16, kBF16, 64);
  const int slots = T * top_k;
  std::vector<int> expert_of(slots);
  std::uniform_int_distribution<int> pick(0, E - 1);
  for (int s = 0; s < slots; ++s) {
    int e = pick(rng);
    if (e < E / 16) e = E - 1;  // the first experts stay empty, the last gets their share too
    expert_of[s] = e;
  }
  std::vector<int> counts(E, 0), offsets(E, 0), perm(slots);
  for (int e : expert_of) ++counts[e];
  std::exclusive_scan(counts.begin(), counts.end(), offsets.begin(), 0);
  std::vector<int> fill(offsets);
  for (int s = 0; s < slots; ++s) perm[fill[expert_of[s]]++] = s;
  const int x_rows = gather ? T : slots, ldx = K, ldy = N;
  float* X = upload(random_floats(size_t(x_rows) * ldx, -2.f, 2.f));
  const auto y0 = random_floats(size_t(slots) * ldy, -1.f, 1.f);
  float* Y = upload(y0);
  int* dc = upload(counts);
  int* doff = upload(offsets);
  int* dperm = upload(perm);
  GemmArgs a{w.W, X, ldx, Y, ldy, slots, dc, doff, gather ? dperm : nullptr, gather ? top_k : 1, false, E};
  if (swiglu) a.up = u.W;
  char what[48];
  std::snprintf(what, sizeof what, "grouped T=%d E=%d top%d max%d", T, E, top_k,
                *std::max_element(counts.begin(), counts.end()));
  check_gemm(what, a, slots, y0, time, (T + 63) / 64);
  for (void* p : std::initializer_list<void*>{X, Y, dc, doff, dperm}) cudaFree(p);
}

// ---------------------------------------------------------------- attention

// One block per (row t, query head h): scores over keys [0, pos + t] in fp32 (q fp32, K and V bf16), softmax,
// · V, · σ(gate).
__global__ void ref_attention_kernel(const float* qbuf, const __nv_bfloat16* Kc, const __nv_bfloat16* Vc,
                                     int64_t cap, const float* q_gate, float* mix, int ldmix, int n_q, int n_kv,
                                     int D, int64_t pos) {
  extern __shared__ float sc[];
  __shared__ float red[32];
  const int t = blockIdx.x, h = blockIdx.y, kvh = h / (n_q / n_kv);
  const int64_t n = pos + t + 1;
  const float* q = qbuf + (int64_t(t) * n_q + h) * D;
  const __nv_bfloat16* Kh = Kc + int64_t(kvh) * cap * D;
  const __nv_bfloat16* Vh = Vc + int64_t(kvh) * cap * D;
  for (int64_t s = threadIdx.x; s < n; s += blockDim.x) {
    float dot = 0.f;
    for (int c = 0; c < D; ++c) dot = fmaf(q[c], __bfloat162float(Kh[s * D + c]), dot);
    sc[s] = dot / sqrtf(float(D));
  }
  __syncthreads();
  float mx = -INFINITY;
  for (int64_t s = threadIdx.x; s < n; s += blockDim.x) mx = fmaxf(mx, sc[s]);
  for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = mx;
  __syncthreads();
  mx = -INFINITY;
  for (int i = 0; i < int(blockDim.x >> 5); ++i) mx = fmaxf(mx, red[i]);
  __syncthreads();
  for (int64_t s = threadIdx.x; s < n; s += blockDim.x) sc[s] = expf(sc[s] - mx);
  __syncthreads();
  for (int c = threadIdx.x; c < D; c += blockDim.x) {
    float l = 0.f, o = 0.f;
    for (int64_t s = 0; s < n; ++s) l += sc[s], o = fmaf(sc[s], __bfloat162float(Vh[s * D + c]), o);
    const float gate = q_gate[(int64_t(t) * 2 * n_q + 2 * h) * D + D + c];
    mix[int64_t(t) * ldmix + h * D + c] = o / l / (1.f + expf(-gate));
  }
}

template <int D>
void attention_case(int T, int64_t pos, int n_q, int n_kv, bool time) {
  const int64_t cap = (pos + T + 1023) / 1024 * 1024 + 64;
  // rows past pos + T hold NaN: a kernel that reads them without masking them out fails
  std::vector<uint16_t> kc(size_t(n_kv) * cap * D, 0x7fc0), vc(kc.size(), 0x7fc0);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  for (int h = 0; h < n_kv; ++h)
    for (int64_t s = 0; s < pos + T; ++s)
      for (int c = 0; c < D; ++c) {
        kc[(h * cap + s) * D + c] = to_bf16_bits(2.f * u(rng));  // logits of a few units: a peaked softmax
        vc[(h * cap + s) * D + c] = to_bf16_bits(u(rng));
      }
  auto* K = reinterpret_cast<__nv_bfloat16*>(upload(kc));
  auto* V = reinterpret_cast<__nv_bfloat16*>(upload(vc));
  float* qbuf = upload(random_floats(size_t(T) * n_q * D, -1.f, 1.f));
  float* q_gate = upload(random_floats(size_t(T) * 2 * n_q * D, -3.f, 3.f));
  const int ldmix = n_q * D + 32;
  const auto mix0 = random_floats(size_t(T) * ldmix, -1.f, 1.f);
  float* mix = upload(mix0);
  int64_t* pos_dev = upload(std::vector<int64_t>{pos});
  // the scores, plus 16 bytes: compute-sanitizer saw the reference's unrolled score loop read 12 bytes at its
  // last score (a vector load), past an allocation of exactly pos + T floats
  const size_t smem = size_t(pos + T + 4) * 4;
  CK(cudaFuncSetAttribute(ref_attention_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  ref_attention_kernel<<<dim3(T, n_q), 256, smem>>>(qbuf, K, V, cap, q_gate, mix, ldmix, n_q, n_kv, D, pos);
  CK(cudaGetLastError());
  const auto ref = download(mix, size_t(T) * ldmix);
  CK(cudaMemcpy(mix, mix0.data(), mix0.size() * 4, cudaMemcpyHostToDevice));
  auto run = [&] { launch_flash_attention<D>(qbuf, K, V, cap, q_gate, mix, ldmix, T, n_q, n_kv, pos_dev, 0); };
  run();
  CK(cudaGetLastError());
  const auto got = download(mix, size_t(T) * ldmix);  // the padding columns too: they must be left alone
  double flop = 0;
  for (int t = 0; t < T; ++t) flop += 4.0 * D * n_q * double(pos + t + 1);
  float ms_new = 0, ms_old = 0;
  if (time) {
    ms_new = time_ms(run);
#ifdef LILY_OLD_KERNELS
    const int warps = T * n_kv;
    ms_old = time_ms([&] {
      lily::old::attention_kernel<D><<<(warps + 3) / 4, 128>>>(qbuf, K, V, cap, q_gate, mix, ldmix, T, n_q, n_kv, 1,
                                                              pos_dev, nullptr);
    });
#endif
  }
  char shape[96];
  std::snprintf(shape, sizeof shape, "D=%d n_q=%d n_kv=%d T=%d pos=%lld", D, n_q, n_kv, T, (long long)pos);
  report("attn", shape, compare(got, ref), 1.5e-2, 4e-3, flop, ms_new, ms_old);
  for (void* p : std::initializer_list<void*>{K, V, qbuf, q_gate, mix, pos_dev}) cudaFree(p);
}

// ---------------------------------------------------------------- Gated DeltaNet

// One thread per (value head h, state column j), row by row from the raw inputs: q, k of the key head
// l2-normalised (q · d_k^-1/2), β = σ(b), decay exp(-A·softplus(a + dt_bias)); S ← decay·S, δ = β·(v − Sᵀk),
// S ← S + k·δᵀ, o = Sᵀq (the raw output, before the gated norm). The state [n_v][d_k][d_v] in and out.
__global__ void ref_gdn_kernel(const float* conv, const float* b, const float* a, const float* A_log,
                               const float* dt_bias, float* rec, float* out, int ldout, int T, int C, int nk, int nv,
                               int dk, int dv) {
  const int h = blockIdx.x, j = threadIdx.x, kh = h / (nv / nk), Kd = nk * dk;
  float col[128];
  float* S = rec + int64_t(h) * dk * dv;
  for (int i = 0; i < dk; ++i) col[i] = S[i * dv + j];
  for (int t = 0; t < T; ++t) {
    const float* q = conv + int64_t(t) * C + kh * dk;
    const float* k = q + Kd;
    float qq = 0.f, kk = 0.f;
    for (int i = 0; i < dk; ++i) qq += q[i] * q[i], kk += k[i] * k[i];
    const float qs = 1.f / sqrtf(qq + 1e-6f) / sqrtf(float(dk)), ks = 1.f / sqrtf(kk + 1e-6f);
    const float beta = 1.f / (1.f + expf(-b[int64_t(t) * nv + h]));
    const float x = a[int64_t(t) * nv + h] + dt_bias[h];
    const float decay = expf(-expf(A_log[h]) * (x > 20.f ? x : log1pf(expf(x))));
    float mk = 0.f;
    for (int i = 0; i < dk; ++i) col[i] *= decay, mk += col[i] * k[i] * ks;
    const float delta = beta * (conv[int64_t(t) * C + 2 * Kd + h * dv + j] - mk);
    float o = 0.f;
    for (int i = 0; i < dk; ++i) col[i] += k[i] * ks * delta, o += col[i] * q[i] * qs;
    out[int64_t(t) * ldout + h * dv + j] = o;
  }
  for (int i = 0; i < dk; ++i) S[i * dv + j] = col[i];
}

// The backend's path after the conv (gdn_prepare_kernel, then gdn_chunked.cuh) against the reference over T rows
// from a random incoming state; outputs and final state compared; timed: the chunked recurrence alone.
void gdn_case(int T, int nk, int nv, int dk, int dv, bool time) {
  const int C = 2 * nk * dk + nv * dv, ldmix = nv * dv + 32;  // mix's padding columns must be left alone
  const auto conv = random_floats(size_t(T) * C, -1.f, 1.f);
  const auto b = random_floats(size_t(T) * nv, -4.f, 4.f), a = random_floats(size_t(T) * nv, -4.f, 4.f);
  // decays from ~0.997 (long memory across chunks) to ~e^-22 a row
  const auto A_log = random_floats(nv, -1.f, 1.5f), dt_bias = random_floats(nv, -1.f, 1.f);
  const auto rec0 = random_floats(size_t(nv) * dk * dv, -0.5f, 0.5f);
  const auto mix0 = random_floats(size_t(T) * ldmix, -1.f, 1.f);
  float *dconv = upload(conv), *db = upload(b), *da = upload(a), *dA = upload(A_log), *ddt = upload(dt_bias);
  float *rec = upload(rec0), *mix = upload(mix0);
  ref_gdn_kernel<<<nv, dv>>>(dconv, db, da, dA, ddt, rec, mix, ldmix, T, C, nk, nv, dk, dv);
  CK(cudaGetLastError());
  const auto ref_out = download(mix, mix0.size()), ref_state = download(rec, rec0.size());
  CK(cudaMemcpy(rec, rec0.data(), rec0.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(mix, mix0.data(), mix0.size() * 4, cudaMemcpyHostToDevice));
  const int warps = T * (2 * nk + 1);
  gdn_prepare_kernel<<<(warps + 3) / 4, 128>>>(dconv, db, da, dA, ddt, T, C, nk, nv, dk);  // in place
  CK(cudaGetLastError());
  float* packs = nullptr;
  CK(cudaMalloc(&packs, size_t((T + kGdnChunk - 1) / kGdnChunk) * nv * gdn_pack_floats(dk, dv) * 4));
  auto run = [&] {
    switch (dk) {
      case 32: launch_gdn_chunked<32>(dconv, db, da, packs, rec, mix, ldmix, T, C, nk, nv, dv, 0); break;
      case 64: launch_gdn_chunked<64>(dconv, db, da, packs, rec, mix, ldmix, T, C, nk, nv, dv, 0); break;
      default: launch_gdn_chunked<128>(dconv, db, da, packs, rec, mix, ldmix, T, C, nk, nv, dv, 0); break;
    }
  };
  run();
  CK(cudaGetLastError());
  const auto got_out = download(mix, mix0.size()), got_state = download(rec, rec0.size());
  const float ms = time ? time_ms(run) : 0.f;  // (the state moves on each run: only the time counts)
  char shape[96];
  std::snprintf(shape, sizeof shape, "chunked nk=%d nv=%d dk=%d dv=%d T=%d", nk, nv, dk, dv, T);
  // both fp32, differently associated (a float32 model of the chunked form at T = 2048: max 3e-6, mean 1e-6);
  // flops: the row-by-row form's four multiply-adds a state element a row
  report("gdn", shape, compare(got_out, ref_out), 3e-4, 3e-5, 8.0 * T * nv * dk * dv, ms, 0);
  report("", "  (final state)", compare(got_state, ref_state), 3e-4, 3e-5, 0, 0, 0);
  if (time && dk == 128) {  // the two kernels' shares: the packs alone (every chunk at once), the rest the scan
    const int chunks = (T + kGdnChunk - 1) / kGdnChunk;
    const float prep = time_ms([&] {
      gdn_chunk_prepare_kernel<128><<<dim3(chunks, nv), kGdnThreads, gdn_prepare_smem_bytes<128>()>>>(
          dconv, db, da, packs, T, C, nk, nv, dv);
    });
    std::printf("        of which the packs %.3f ms, the scan %.3f ms (%.1f us a chunk)\n", prep, ms - prep,
                1e3f * (ms - prep) / chunks);
  }
  for (void* p : std::initializer_list<void*>{dconv, db, da, dA, ddt, rec, mix, packs}) cudaFree(p);
}

// The experts' products of a chunk of T rows: gate/up (gathered rows; apart, then as one SwiGLU product) and down
void experts_at(int T, bool time) {
  grouped_case(T, 256, 8, 512, 2048, true, time);
  grouped_case(T, 256, 8, 512, 2048, true, time, true);
  grouped_case(T, 256, 8, 2048, 512, false, time);
}

// Every weight format at small shapes: ragged M, N not a multiple of the tile, K with a half k-tile left,
// accumulate; the tiny model's experts
void small_gemms() {
  struct Format {
    int bits, wdt, sdt, group;
  };
  for (const Format f : {Format{4, kBF16, kBF16, 64}, Format{4, kBF16, kF32, 32}, Format{4, kBF16, kF16, 64},
                         Format{8, kBF16, kBF16, 64}, Format{8, kBF16, kF32, 32}, Format{0, kBF16, kBF16, 0},
                         Format{0, kF16, kBF16, 0}, Format{0, kF32, kBF16, 0}})
    for (int M : {1, 7, 65, 513}) {
      dense_case(M, 200, 96, f.bits, f.wdt, f.sdt, f.group, false, false);
      dense_case(M, 200, 96, f.bits, f.wdt, f.sdt, f.group, false, false, true);
    }
  dense_case(63, 328, 160, 4, kBF16, kBF16, 32, true, false);
  dense_case(130, 256, 2048, 8, kBF16, kBF16, 64, true, false);
  grouped_case(40, 16, 4, 64, 128, true, false);  // the tiny model's experts
  grouped_case(40, 16, 4, 64, 128, true, false, true);
  grouped_case(40, 16, 4, 128, 64, false, false);
}

// The model's products, the large ones timed.
void model_gemms() {
  // the model's dense projections (q4, bf16 scales, groups of 64) at the chunk sizes
  for (int M : {7, 63, 65, 513, 2048}) {
    dense_case(M, 12352, 2048, 4, kBF16, kBF16, 64, false, M >= 513);  // GDN in_proj
    dense_case(M, 8192, 2048, 4, kBF16, kBF16, 64, false, M >= 513);   // attention q (with gate)
    dense_case(M, 2048, 4096, 4, kBF16, kBF16, 64, false, M >= 513);   // o / out projection
    dense_case(M, 512, 2048, 4, kBF16, kBF16, 64, false, M >= 513);    // shared expert gate / up
    dense_case(M, 512, 2048, 4, kBF16, kBF16, 64, false, M >= 513, true);  // … as one SwiGLU product
  }
  dense_case(512, 256, 2048, 8, kBF16, kBF16, 64, false, true);  // router (8-bit)
  dense_case(7, 248320, 2048, 4, kBF16, kBF16, 64, false, true);  // lm_head
  dense_case(2048, 2048, 2048, 0, kBF16, kBF16, 0, false, true);  // dense bf16
  for (int T : {1, 65, 512, 2048}) experts_at(T, T >= 512);
}

// Causal prefill attention: the real geometry (GQA 16/2, d 256) at the chunk sizes and at later positions.
void model_attention() {
  for (const auto& [T, pos] : {std::pair<int, int64_t>{1, 0}, {7, 0}, {63, 5}, {65, 100}, {513, 0}, {512, 1536},
                               {2048, 0}, {2048, 2048}})
    attention_case<256>(T, pos, 16, 2, T >= 512);
}

// Gated DeltaNet: the tiny models' geometries (d_k 32/64, d_v 32/64/128), then (model) the real one, 32 value heads
// over 16 key heads, d_k = d_v = 128, partial chunks and chunk edges, timed at 512 rows and more
void gdn_cases(bool model) {
  gdn_case(100, 2, 4, 32, 32, false);
  gdn_case(130, 2, 4, 64, 64, false);
  gdn_case(65, 1, 2, 32, 128, false);
  gdn_case(70, 2, 2, 64, 128, false);
  gdn_case(129, 16, 32, 128, 128, false);
  if (model)
    for (int T : {1, 7, 63, 64, 65, 512, 513, 2048}) gdn_case(T, 16, 32, 128, 128, T >= 512);
}

}  // namespace

int main(int argc, char** argv) {
  // --small: the small shapes only (for compute-sanitizer); --gdn: only the Gated DeltaNet's cases, in full;
  // --gemm: only the products (small shapes and the model's); --experts: only the experts' products at 2,048
  // tokens; --experts-once: the same untimed, each tile launched once (a profiler's target)
  const std::string only = argc > 1 ? argv[1] : "";
  const bool small = only == "--small";
  cudaDeviceProp p;
  CK(cudaGetDeviceProperties(&p, 0));
  std::printf("%s, %d SMs\n", p.name, p.multiProcessorCount);
  auto done = [] {
    std::printf(failures ? "%d FAILED\n" : "all passed\n", failures);
    return failures ? 1 : 0;
  };
  if (only == "--gdn") {
    gdn_cases(true);
    return done();
  }
  if (only == "--experts" || only == "--experts-once") {
    experts_at(2048, only == "--experts");
    return done();
  }
  small_gemms();
  if (only == "--gemm") {
    model_gemms();
    return done();
  }
  attention_case<64>(40, 3, 4, 2, false);  // the tiny models' geometries (incl. a group of 3)
  attention_case<128>(100, 17, 8, 2, false);
  attention_case<128>(77, 30, 6, 2, false);
  attention_case<32>(33, 0, 2, 2, false);
  attention_case<256>(65, 100, 16, 2, false);
  gdn_cases(!small);
  if (!small) {
    model_gemms();
    model_attention();
  }
  return done();
}
