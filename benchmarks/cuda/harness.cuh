// What the CUDA kernel harnesses (prefill_kernels.cu, decode_kernels.cu) share: random data in the weight
// formats, upload/download, naive reference decoding of a weight, error measures and timing.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backends/cuda/kernels.cuh"

namespace lily::cuda::harness {

void ck(cudaError_t e, const char* what, int line) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "CUDA error %s at line %d: %s\n", cudaGetErrorString(e), line, what);
    std::exit(2);
  }
}
#define CK(x) ck((x), #x, __LINE__)

inline std::mt19937 rng(1234);
inline int failures = 0;

template <class T>
T* upload(const std::vector<T>& h) {
  T* d = nullptr;
  // + 256: the decode kernels' bulk copies round a tile's parts up to 16 bytes (the backend pads its arena)
  CK(cudaMalloc(&d, std::max<size_t>(h.size(), 1) * sizeof(T) + 256));
  CK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  // From pageable memory cudaMemcpy may return before its last DMA lands, and the kernels run on a stream that
  // does not wait for the default one: a 1 MB row launched on at once was read half-written.
  CK(cudaDeviceSynchronize());
  return d;
}
template <class T>
std::vector<T> download(const T* d, size_t n) {
  std::vector<T> h(n);
  CK(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

std::vector<float> random_floats(size_t n, float lo, float hi) {
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = u(rng);
  return v;
}

uint16_t to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
uint16_t to_f16_bits(float f) {
  const __half h = __float2half(f);
  return *reinterpret_cast<const uint16_t*>(&h);
}

// Parameters (scales, biases, dense weights) stored as dtype dt.
std::vector<uint8_t> encode(const std::vector<float>& v, int dt) {
  std::vector<uint8_t> out(v.size() * (dt == kF32 ? 4 : 2));
  for (size_t i = 0; i < v.size(); ++i) {
    if (dt == kF32) std::memcpy(&out[4 * i], &v[i], 4);
    else {
      const uint16_t b = dt == kBF16 ? to_bf16_bits(v[i]) : to_f16_bits(v[i]);
      std::memcpy(&out[2 * i], &b, 2);
    }
  }
  return out;
}

float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median milliseconds of launch() (which issues its work into `stream`), after one warm-up.
template <class F>
float time_ms(F&& launch, int repeats = 15, cudaStream_t stream = 0) {
  launch();  // warm-up (and the shared-memory attribute)
  CK(cudaDeviceSynchronize());
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<float> ms;
  for (int i = 0; i < repeats; ++i) {
    CK(cudaEventRecord(a, stream));
    launch();
    CK(cudaEventRecord(b, stream));
    CK(cudaEventSynchronize(b));
    float t = 0.f;
    CK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  CK(cudaGetLastError());
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return median(ms);
}

// max |got - ref| / max |ref| and mean |got - ref| / mean |ref| over the rows given (all when rows is empty).
struct Err {
  double max_rel = 0, mean_rel = 0;
};
Err compare(const std::vector<float>& got, const std::vector<float>& ref) {
  double mx = 0, sum = 0, emx = 0, esum = 0;
  bool finite = true;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(got[i])) finite = false;
    const double d = std::fabs(double(got[i]) - ref[i]);
    mx = std::max(mx, double(std::fabs(ref[i]))), sum += std::fabs(ref[i]);
    emx = std::max(emx, d), esum += d;
  }
  if (!finite) return {INFINITY, INFINITY};
  return {emx / std::max(mx, 1e-30), esum / std::max(sum, 1e-30)};
}

void report(const char* what, const std::string& shape, Err e, double max_tol, double mean_tol, double flop,
            float ms_new, float ms_old) {
  const bool ok = e.max_rel <= max_tol && e.mean_rel <= mean_tol;
  if (!ok) ++failures;
  std::printf("%-5s %-52s max %.2e mean %.2e %s", what, shape.c_str(), e.max_rel, e.mean_rel, ok ? "ok  " : "FAIL");
  if (ms_new > 0) std::printf("  new %8.3f ms %6.1f TFLOP/s", ms_new, flop / ms_new * 1e-9);
  if (ms_old > 0) std::printf("  old %8.3f ms %6.1f TFLOP/s", ms_old, flop / ms_old * 1e-9);
  std::printf("\n");
  std::fflush(stdout);
}

// Element (n, k) of expert e, decoded element by element (independently of gemm.cuh's chunks).
__device__ float ref_weight(const LinDev& W, int e, int n, int k) {
  const uint8_t* row = W.w + uint64_t(e) * W.w_expert + uint64_t(n) * W.w_row;
  if (!W.bits) return load_param(row, W.wdt, k);
  const uint64_t s_off = uint64_t(e) * W.s_expert + uint64_t(n) * W.s_row;
  const float s = load_param(W.s + s_off, W.sdt, k / W.group), b = load_param(W.b + s_off, W.sdt, k / W.group);
  const uint32_t word = reinterpret_cast<const uint32_t*>(row)[k * W.bits / 32];
  const int per = 32 / W.bits;
  const uint32_t q = (word >> (W.bits * (k % per))) & ((1u << W.bits) - 1u);
  return s * float(q) + b;
}

struct Weights {
  LinDev W;
  std::vector<void*> owned;
  ~Weights() {
    for (void* p : owned) cudaFree(p);
  }
};

// E experts of [N, K] in format (bits 0: dense wdt), scales/biases in sdt, groups of `group`.
void make_weights(Weights& w, int E, int N, int K, int bits, int wdt, int sdt, int group) {
  LinDev& W = w.W;
  W.bits = bits, W.group = bits ? group : 0, W.wdt = wdt, W.sdt = sdt, W.rows = N, W.cols = K;
  if (bits) {
    W.w_row = uint64_t(K) * bits / 8;
    std::vector<uint8_t> codes(W.w_row * N * E);
    for (auto& c : codes) c = uint8_t(rng());
    const int groups = (K + group - 1) / group, pbytes = sdt == kF32 ? 4 : 2;
    W.s_row = uint64_t(groups) * pbytes;
    const float qmax = float((1 << bits) - 1);
    // weights ≈ scale · (q - qmax/2) + jitter: centred, of magnitude ~1/sqrt(K) like a trained matrix
    std::vector<float> s = random_floats(size_t(groups) * N * E, 0.5f, 1.5f), b(s.size());
    std::uniform_real_distribution<float> jit(-0.2f, 0.2f);
    for (size_t i = 0; i < s.size(); ++i) {
      s[i] *= 2.f / qmax / std::sqrt(float(K));
      b[i] = -s[i] * (qmax / 2 + jit(rng));
    }
    auto* dw = upload(codes);
    auto* ds = upload(encode(s, sdt));
    auto* db = upload(encode(b, sdt));
    W.w = dw, W.s = ds, W.b = db;
    w.owned = {dw, ds, db};
  } else {
    W.w_row = uint64_t(K) * (wdt == kF32 ? 4 : 2);
    auto* dw = upload(encode(random_floats(size_t(N) * K * E, -1.f / std::sqrt(float(K)), 1.f / std::sqrt(float(K))), wdt));
    W.w = dw;
    w.owned = {dw};
  }
  W.w_expert = W.w_row * N, W.s_expert = W.s_row * N;
}

const char* format_name(int bits, int wdt, int sdt) {
  static char buf[32];
  const char* dt[] = {"f32", "bf16", "f16"};
  if (bits) std::snprintf(buf, sizeof buf, "q%d/%s", bits, dt[sdt]);
  else std::snprintf(buf, sizeof buf, "%s", dt[wdt]);
  return buf;
}

}  // namespace lily::cuda::harness
