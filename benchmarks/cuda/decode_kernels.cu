// Correctness and speed of the CUDA backend's decode kernels (kernels.cuh: gemv_kernel, moe_decode_kernel with and
// without the route, argmax_kernel; attention_decode.cuh: the split attention after attn_prepare_kernel, and its
// merge) on fresh random data, each against a naive fp32 reference
// (a kernel, or host code for attention) in this file, with the launch geometry the backend uses (plan_gemv,
// decode_grid, moe_decode_grid); exits 1 on a failure. `--attention` runs the attention cases alone.
//
//   nvcc -std=c++17 -gencode=arch=compute_90a,code=sm_90a -O3 -I csrc benchmarks/cuda/decode_kernels.cu \
//        -o build/decode_kernels && build/decode_kernels
//
// `--small` runs only the small shapes, untimed (for compute-sanitizer); `--profile` the model's shapes once each,
// untimed (for ncu), `--step` the step chain alone three times (to compare builds), `--trace` the step chain once
// and the experts' kernel's timeline in it (built with -DLILY_DECODE_TRACE: the stamps cost ~60 µs a step). Timing: 40 launches captured in a
// CUDA graph with programmatic dependent launch, as the decode step runs, each on its own copy of the weights
// (so they come from DRAM, not L2), the median of 10 replays; then a step's worth of the model's projections
// and experts (40 layers, distinct weights, and the logits' projection and argmax) the same way.
#include <memory>

#include "backends/cuda/attention_decode.cuh"
#include "harness.cuh"

using namespace lily::cuda;
using namespace lily::cuda::harness;

namespace {

int sms = 0, slots = 0;  // slots: decode_slots
cudaStream_t stream;

template <class... P, class... A>
void launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, A... args) {
  CK(launch_dependent(stream, {}, kernel, grid, block, smem, args...));
}

// Median microseconds of one `body()` (which issues `per` launches into `stream`), captured as a graph.
template <class F>
double graph_us(F&& body, int per) {
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  body();
  CK(cudaStreamEndCapture(stream, &g));
  CK(cudaGraphInstantiate(&ge, g, 0));
  const float ms = time_ms([&] { CK(cudaGraphLaunch(ge, stream)); }, 10, stream);
  cudaGraphExecDestroy(ge);
  cudaGraphDestroy(g);
  return ms * 1e3 / per;
}

uint64_t weight_bytes(const LinDev& W) { return uint64_t(W.rows) * (W.w_row + 2 * W.s_row); }

// `copies` copies of W's tensors (one expert) side by side: the timed launches each read their own.
std::vector<LinDev> copies_of(const LinDev& W, int copies, std::vector<void*>& owned) {
  std::vector<LinDev> out;
  for (int c = 0; c < copies; ++c) {
    LinDev d = W;
    auto copy = [&](const uint8_t*& dst, const uint8_t* src, uint64_t bytes) {
      if (!src) return;
      void* p = nullptr;
      CK(cudaMalloc(&p, bytes + 256));
      CK(cudaMemcpy(p, src, bytes, cudaMemcpyDeviceToDevice));
      owned.push_back(p);
      dst = static_cast<const uint8_t*>(p);
    };
    copy(d.w, W.w, W.rows * W.w_row);
    copy(d.s, W.s, W.rows * W.s_row);
    copy(d.b, W.b, W.rows * W.s_row);
    out.push_back(d);
  }
  return out;
}

// y[r] (+)= Σ_c W_e[r, c] · x[c], a thread a row, the weight decoded element by element.
__global__ void ref_gemv_kernel(LinDev W, int e, const float* x, float* y, bool accumulate) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= W.rows) return;
  float acc = 0.f;
  for (int c = 0; c < W.cols; ++c) acc = fmaf(ref_weight(W, e, r, c), x[c], acc);
  y[r] = accumulate ? y[r] + acc : acc;
}
std::vector<float> ref_gemv(const LinDev& W, int e, const std::vector<float>& x) {
  float* dx = upload(x);
  float* dy = nullptr;
  CK(cudaMalloc(&dy, W.rows * 4));
  ref_gemv_kernel<<<(W.rows + 127) / 128, 128>>>(W, e, dx, dy, false);
  CK(cudaGetLastError());
  auto y = download(dy, W.rows);
  cudaFree(dx), cudaFree(dy);
  return y;
}

std::vector<float> rmsnorm(const std::vector<float>& x, const std::vector<float>& g, float eps) {
  double ss = 0;
  for (float v : x) ss += double(v) * v;
  const double inv = 1.0 / std::sqrt(ss / x.size() + eps);
  std::vector<float> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = float(x[i] * inv * g[i]);
  return out;
}

// The decode kernels' dot products quantise x to 16 bits per 32-column chunk (kernels.cuh, QChunk): ~3e-5 of
// a dot product (more where its terms cancel), against the 1e-2 or more of a wrong code, scale or row.
constexpr double kDotTol = 5e-4;

// A check that passes or fails as a whole (a route, a count reset, a result repeated bit for bit).
void verdict(const char* what, const std::string& label, bool ok) {
  if (!ok) ++failures;
  std::printf("%-8s %-50s %s\n", what, label.c_str(), ok ? "ok" : "FAIL");
  std::fflush(stdout);
}

void check(const char* what, const std::string& shape, const std::vector<float>& got, const std::vector<float>& ref,
           double tol = 2e-5, double mean_tol = 0) {
  const Err e = compare(got, ref);
  const bool ok = e.max_rel <= tol && e.mean_rel <= (mean_tol ? mean_tol : tol);
  if (!ok) ++failures;
  std::printf("%-8s %-50s max %.2e mean %.2e %s\n", what, shape.c_str(), e.max_rel, e.mean_rel, ok ? "ok" : "FAIL");
  std::fflush(stdout);
}

void print_time(const char* what, const std::string& shape, double us, uint64_t bytes) {
  std::printf("%-8s %-50s %8.2f us  %6.2f TB/s\n", what, shape.c_str(), us, bytes / us * 1e-6);
  std::fflush(stdout);
}

// ---------------------------------------------------------------- GEMV

struct Job {
  int rows, bits;
};

void launch_gemv(GemvJobs jobs, const float* x, int cols, const float* norm, float* xn_out) {
  const uint32_t stage_bytes = plan_gemv(jobs, slots);
  const DecodeGrid g = decode_grid(jobs.tile_first[jobs.n], stage_bytes, gemv_row_bytes(cols), slots, "gemv");
  launch(by_cols(cols, [](auto U) { return gemv_kernel<decltype(U)::value>; }), g.blocks, kDecodeThreads, g.smem,
         jobs, x, cols, norm, 1e-6f, xn_out, g.stages, stage_bytes);
}

// out_j (+)= W_j · (RMSNorm(x)·g or x) for the jobs, one input row; xn_out checked against the normed row.
void gemv_case(const std::vector<Job>& js, int cols, bool norm, bool accumulate, bool time) {
  std::string shape = "cols " + std::to_string(cols) + " rows";
  for (const Job& j : js) shape += " " + std::to_string(j.rows) + (j.bits ? "q" + std::to_string(j.bits) : "bf16");
  shape += norm ? " norm" : "";
  shape += accumulate ? " acc" : "";
  std::vector<Weights> w(js.size());
  GemvJobs jobs;
  std::vector<float*> outs;
  std::vector<std::vector<float>> y0;
  for (size_t i = 0; i < js.size(); ++i) {
    make_weights(w[i], 1, js[i].rows, cols, js[i].bits, kBF16, kBF16, 64);
    y0.push_back(random_floats(js[i].rows, -1.f, 1.f));
    outs.push_back(upload(y0.back()));
    jobs.W[jobs.n] = w[i].W, jobs.out[jobs.n] = outs.back(), ++jobs.n;
  }
  jobs.accumulate = accumulate;
  const std::vector<float> x = random_floats(cols, -2.f, 2.f), g = random_floats(cols, 0.5f, 1.5f);
  float *dx = upload(x), *dg = upload(g), *dxn = nullptr;
  CK(cudaMalloc(&dxn, cols * 4));
  launch_gemv(jobs, dx, cols, norm ? dg : nullptr, dxn);
  CK(cudaStreamSynchronize(stream));
  CK(cudaGetLastError());
  const std::vector<float> xhat = norm ? rmsnorm(x, g, 1e-6f) : x;
  check("xn", shape, download(dxn, cols), xhat);
  uint64_t bytes = 0;
  for (size_t i = 0; i < js.size(); ++i) {
    std::vector<float> ref = ref_gemv(w[i].W, 0, xhat);
    if (accumulate)
      for (int r = 0; r < js[i].rows; ++r) ref[r] += y0[i][r];
    check("gemv", shape + " job " + std::to_string(i), download(outs[i], js[i].rows), ref, kDotTol);
    bytes += weight_bytes(w[i].W);
  }
  if (time) {
    const int copies = int(std::min<uint64_t>(40, (512ull << 20) / bytes + 1));
    std::vector<void*> owned;
    std::vector<std::vector<LinDev>> c;
    for (auto& wi : w) c.push_back(copies_of(wi.W, copies, owned));
    const double us = graph_us([&] {
      for (int l = 0; l < 40; ++l) {
        GemvJobs jl = jobs;
        for (int i = 0; i < jobs.n; ++i) jl.W[i] = c[i][l % copies];
        launch_gemv(jl, dx, cols, norm ? dg : nullptr, nullptr);
      }
    }, 40);
    print_time("time", shape, us, bytes);
    for (void* p : owned) cudaFree(p);
  }
  for (float* p : outs) cudaFree(p);
  cudaFree(dx), cudaFree(dg), cudaFree(dxn);
}

// ---------------------------------------------------------------- experts

struct Experts {
  Weights gate, up, down, sgate, sup, sdown, router, shared_router;
  int H, I, Is, E, K;
  bool fused = false;  // the route inside the gate/up kernel (as CudaBackend's moe_norm_route + moe_decode)
  MoeDecode plan() const {
    MoeDecode md{gate.W, up.W, sgate.W, sup.W, down.W, sdown.W, K, E, std::max(I, Is)};
    if (fused) md.router = router.W, md.shared_router = shared_router.W;
    return md;
  }
};

// The experts' and the router's formats: the MLX 4-bit checkpoint's by default (4-bit experts, an 8-bit router
// and shared gate, bf16 scales; moe_decode_kernel built for them alone), else any (AnyWeights): bits 0 is dense
// weights of dtype sdt.
struct ExpertsFormat {
  int bits = 4, router_bits = 8, sdt = kBF16;
  std::string name() const {
    if (!bits) return sdt == kF32 ? " f32" : sdt == kF16 ? " f16" : " bf16";
    if (bits == 4 && router_bits == 8 && sdt == kBF16) return "";
    return " q" + std::to_string(bits) + "/q" + std::to_string(router_bits) +
           (sdt == kF32 ? " f32s" : sdt == kF16 ? " f16s" : " bf16s");
  }
};

void make_experts(Experts& x, int H, int I, int Is, int E, int K, ExpertsFormat f = {}) {
  x.H = H, x.I = I, x.Is = Is, x.E = E, x.K = K;
  const int wdt = f.bits ? kBF16 : f.sdt, rb = f.bits ? f.router_bits : 0;
  make_weights(x.gate, E, I, H, f.bits, wdt, f.sdt, 64);
  make_weights(x.up, E, I, H, f.bits, wdt, f.sdt, 64);
  make_weights(x.down, E, H, I, f.bits, wdt, f.sdt, 64);
  make_weights(x.sgate, 1, Is, H, f.bits, wdt, f.sdt, 64);
  make_weights(x.sup, 1, Is, H, f.bits, wdt, f.sdt, 64);
  make_weights(x.sdown, 1, H, Is, f.bits, wdt, f.sdt, 64);
  make_weights(x.router, 1, E, H, rb, wdt, f.sdt, 64);
  make_weights(x.shared_router, 1, 1, H, rb, wdt, f.sdt, 64);
}

// xn: gate/up's input row (unfused) — or, with the route fused in, x (the residual, which down also updates)
// RMSNorm'd by norm inside the kernel. router / sg: the logits, input (unfused) or output (fused).
struct MoeBuffers {
  float *xn, *router, *h, *w, *sg, *x;
  int32_t* ids;
  const float* norm = nullptr;
  unsigned* count = nullptr;
};

// The experts' kernel as the backend launches it.
void launch_experts(const MoeDecode& md, const MoeBuffers& b, int H) {
  const MoeGrid g = moe_decode_grid(md, H, slots, sms);
  const bool fused = md.route_tiles() > 0;
  launch(moe_decode_kernel_for(H, moe_mlx4(md)), g.blocks, kDecodeThreads, g.smem,
         md, (const float*)(fused ? b.x : b.xn), b.x, H, fused ? b.norm : nullptr, 1e-6f, b.router, b.sg, b.count,
         b.ids, b.w, b.h, g.stages, md.gate_up_stage_bytes(), g.ring_bytes, g.down_rows);
}

float silu(float v) { return v / (1.f + std::exp(-v)); }

// The route (top-k, ties to the lower id; softmax weights over the K), h of every slot and the residual
// update, each against the reference decoding of the same weights.
void experts_case(int H, int I, int Is, int E, int K, bool time, bool fused, ExpertsFormat f = {}) {
  const std::string shape = "H " + std::to_string(H) + " I " + std::to_string(I) + " Is " + std::to_string(Is) +
                            " E " + std::to_string(E) + " K " + std::to_string(K) + (fused ? " route" : "") + f.name();
  Experts ex;
  make_experts(ex, H, I, Is, E, K, f);
  ex.fused = fused;
  const MoeDecode md = ex.plan();
  const int ldh = md.ldh;
  const std::vector<float> x0 = random_floats(H, -1.f, 1.f), g = random_floats(H, 0.5f, 1.5f);
  std::vector<float> xn = random_floats(H, -2.f, 2.f), router = random_floats(E, -4.f, 4.f);
  std::vector<float> sg = random_floats(1, -2.f, 2.f);
  if (fused) xn = rmsnorm(x0, g, 1e-6f);
  else router[E - 1] = router[E / 2] = 5.f, router[E - 2] = router[1] = 4.5f;  // ties: the lower id first
  MoeBuffers b{upload(xn), upload(router), nullptr, nullptr, upload(sg), upload(x0), nullptr};
  float* dg = upload(g);
  b.norm = dg;
  CK(cudaMalloc(&b.count, kMoeCounts * sizeof(unsigned)));
  CK(cudaMemset(b.count, 0, kMoeCounts * sizeof(unsigned)));
  CK(cudaMalloc(&b.h, size_t(K + 1) * ldh * 4));
  CK(cudaMemset(b.h, 0, size_t(K + 1) * ldh * 4));
  CK(cudaMalloc(&b.w, K * 4));
  CK(cudaMalloc(&b.ids, K * 4));
  launch_experts(md, b, H);
  CK(cudaStreamSynchronize(stream));
  CK(cudaGetLastError());
  if (fused) {  // the logits the kernel computed (the shared gate's last, on the router's scale: alone, one
               // small dot's relative error says little); the route below is checked against its own logits
    router = download(b.router, E), sg = download(b.sg, 1);
    std::vector<float> got = router, want = ref_gemv(ex.router.W, 0, xn);
    got.push_back(sg[0]), want.push_back(ref_gemv(ex.shared_router.W, 0, xn)[0]);
    check("logits", shape, got, want, kDotTol);
  }
  std::vector<unsigned> counts(kMoeCounts);
  CK(cudaMemcpy(counts.data(), b.count, sizeof(unsigned) * kMoeCounts, cudaMemcpyDeviceToHost));
  const bool reset = std::all_of(counts.begin(), counts.end(), [](unsigned c) { return c == 0; });
  verdict("counts", shape + ": 0 after the launch", reset);
  // the route
  std::vector<int> order(E);
  for (int e = 0; e < E; ++e) order[e] = e;
  std::stable_sort(order.begin(), order.end(), [&](int a, int c) { return router[a] > router[c]; });
  const auto ids = download(b.ids, K);
  const auto wts = download(b.w, K);
  std::vector<float> want_w(K);
  double z = 0;
  for (int j = 0; j < K; ++j) z += std::exp(double(router[order[j]]) - router[order[0]]);
  bool route_ok = true;
  for (int j = 0; j < K; ++j) {
    want_w[j] = float(std::exp(double(router[order[j]]) - router[order[0]]) / z);
    route_ok = route_ok && ids[j] == order[j];
  }
  verdict("route", shape, route_ok);
  check("weights", shape, wts, want_w);
  // h
  std::vector<float> h_ref(size_t(K + 1) * ldh, 0.f);
  for (int j = 0; j <= K; ++j) {
    const LinDev& G = j < K ? ex.gate.W : ex.sgate.W;
    const LinDev& U = j < K ? ex.up.W : ex.sup.W;
    const int e = j < K ? order[j] : 0;
    const auto g = ref_gemv(G, e, xn), u = ref_gemv(U, e, xn);
    for (int r = 0; r < G.rows; ++r) h_ref[size_t(j) * ldh + r] = silu(g[r]) * u[r];
  }
  check("h", shape, download(b.h, h_ref.size()), h_ref, kDotTol);
  // x += Σ_j w_j · down_j · h_j + σ(sg) · sdown · h_K, from the kernel's own h (the step above checked it)
  const auto h = download(b.h, h_ref.size());
  std::vector<double> x_ref(x0.begin(), x0.end());
  for (int j = 0; j <= K; ++j) {
    const LinDev& D = j < K ? ex.down.W : ex.sdown.W;
    std::vector<float> hj(h.begin() + size_t(j) * ldh, h.begin() + size_t(j) * ldh + D.cols);
    const auto y = ref_gemv(D, j < K ? order[j] : 0, hj);
    const double wj = j < K ? want_w[j] : 1.0 / (1.0 + std::exp(-double(sg[0])));
    for (int r = 0; r < H; ++r) x_ref[r] += wj * y[r];
  }
  check("down", shape, download(b.x, H), std::vector<float>(x_ref.begin(), x_ref.end()), kDotTol);
  if (time) {
    // 40 layers' routes over the one set of experts: their weights mostly come from DRAM (8 of 256 a layer)
    std::vector<float*> routers;
    for (int l = 0; l < 40; ++l) routers.push_back(upload(random_floats(E, -4.f, 4.f)));
    const uint64_t gate_up_bytes = K * (weight_bytes(ex.gate.W) + weight_bytes(ex.up.W)) + weight_bytes(ex.sgate.W) +
                                   weight_bytes(ex.sup.W);
    const uint64_t down_bytes = K * weight_bytes(ex.down.W) + weight_bytes(ex.sdown.W);
    const uint64_t route_bytes = weight_bytes(ex.router.W) + weight_bytes(ex.shared_router.W);
    // unfused: the experts' kernel alone (on given logits), then with the router's GEMV before it (the step's
    // two kernels); fused: the route inside, one kernel
    for (const bool with_router : fused ? std::vector<bool>{true} : std::vector<bool>{false, true}) {
      const double us = graph_us([&] {
        for (int l = 0; l < 40; ++l) {
          MoeBuffers bl = b;
          bl.router = routers[l];
          if (with_router && !fused) {
            GemvJobs route;
            route.W[0] = ex.router.W, route.out[0] = bl.router, route.W[1] = ex.shared_router.W, route.out[1] = bl.sg;
            route.n = 2;
            launch_gemv(route, bl.x, H, dg, bl.xn);
          }
          launch_experts(md, bl, H);
        }
      }, 40);
      print_time("time", shape + (with_router ? " route+experts" : " experts"), us,
                 gate_up_bytes + down_bytes + (with_router ? route_bytes : 0));
    }
    for (float* p : routers) cudaFree(p);
  }
  for (void* p : std::initializer_list<void*>{b.xn, b.router, b.h, b.w, b.sg, b.x, b.ids, (void*)dg, (void*)b.count})
    cudaFree(p);
}

// ---------------------------------------------------------------- attention

// Decode's attention for one row: attn_prepare_kernel, the split kernel and the merge, at the backend's launch
// geometry.
struct AttnShape {
  int n_q, n_kv, d, rot;
  std::string name(int64_t pos) const {
    return "q" + std::to_string(n_q) + " kv" + std::to_string(n_kv) + " d" + std::to_string(d) + " rot" +
           std::to_string(rot) + " pos " + std::to_string(pos);
  }
};
constexpr float kRopeTheta = 1e7f, kRmsEps = 1e-6f;
constexpr uint16_t kBf16Nan = 0x7fc0;

float bf16_value(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// A decode row at pos: its q_gate, k and v, the norms' weights, and the caches [n_kv, cap, d] (bf16 bits) with
// random rows before pos and NaN from pos on (a key read before it is written, or past pos, poisons the output).
struct AttnData {
  AttnShape s;
  int64_t pos, cap;
  std::vector<float> q_gate, k, v, q_norm, k_norm;
  std::vector<uint16_t> K, V;
};
AttnData make_attn_data(const AttnShape& s, int64_t pos) {
  AttnData a{s, pos, pos + 9};
  a.q_gate = random_floats(size_t(2) * s.n_q * s.d, -2.f, 2.f);
  a.k = random_floats(size_t(s.n_kv) * s.d, -2.f, 2.f);
  a.v = random_floats(size_t(s.n_kv) * s.d, -1.f, 1.f);
  a.q_norm = random_floats(s.d, 0.5f, 1.5f);
  a.k_norm = random_floats(s.d, 0.5f, 1.5f);
  std::uniform_real_distribution<float> key(-2.f, 2.f), value(-1.f, 1.f);
  a.K.assign(size_t(s.n_kv) * a.cap * s.d, kBf16Nan);
  a.V = a.K;
  for (int h = 0; h < s.n_kv; ++h)
    for (int64_t r = 0; r < pos; ++r)
      for (int j = 0; j < s.d; ++j) {
        const size_t at = (size_t(h) * a.cap + r) * s.d + j;
        a.K[at] = to_bf16_bits(key(rng)), a.V[at] = to_bf16_bits(value(rng));
      }
  return a;
}

// The naive reference: q and k normed and rotated (the angle in fp32, as the kernels compute it), the new row
// rounded to bf16 as the cache holds it, softmax over rows 0..pos in double, times σ(gate).
struct AttnRef {
  std::vector<float> mix, krow, vrow;  // mix [n_q·d]; the cache's row pos [n_kv·d] as bf16 values
};
std::vector<float> ref_norm_rope(const float* x, const std::vector<float>& w, int64_t p, int rot) {
  std::vector<float> y = rmsnorm(std::vector<float>(x, x + w.size()), w, kRmsEps);
  const int half = rot / 2;
  for (int f = 0; f < half; ++f) {
    const float ang = float(p) * (1.f / powf(kRopeTheta, float(2 * f) / float(rot)));
    const double c = std::cos(double(ang)), s = std::sin(double(ang)), a = y[f], b = y[f + half];
    y[f] = float(a * c - b * s), y[f + half] = float(b * c + a * s);
  }
  return y;
}
AttnRef ref_attention(const AttnData& a) {
  const AttnShape& s = a.s;
  const int d = s.d, G = s.n_q / s.n_kv;
  AttnRef r;
  r.mix.resize(size_t(s.n_q) * d), r.krow.resize(size_t(s.n_kv) * d), r.vrow.resize(size_t(s.n_kv) * d);
  for (int h = 0; h < s.n_kv; ++h) {
    const std::vector<float> kn = ref_norm_rope(&a.k[size_t(h) * d], a.k_norm, a.pos, s.rot);
    for (int j = 0; j < d; ++j)
      r.krow[h * d + j] = bf16_value(to_bf16_bits(kn[j])), r.vrow[h * d + j] = bf16_value(to_bf16_bits(a.v[h * d + j]));
  }
  for (int h = 0; h < s.n_q; ++h) {
    const int kvh = h / G;
    const std::vector<float> q = ref_norm_rope(&a.q_gate[size_t(2 * h) * d], a.q_norm, a.pos, s.rot);
    auto key = [&](int64_t row, int j) {
      return row == a.pos ? r.krow[kvh * d + j] : bf16_value(a.K[(size_t(kvh) * a.cap + row) * d + j]);
    };
    auto value = [&](int64_t row, int j) {
      return row == a.pos ? r.vrow[kvh * d + j] : bf16_value(a.V[(size_t(kvh) * a.cap + row) * d + j]);
    };
    std::vector<double> score(a.pos + 1), o(d, 0.0);
    double mx = -INFINITY, sum = 0;
    for (int64_t row = 0; row <= a.pos; ++row) {
      double dot = 0;
      for (int j = 0; j < d; ++j) dot += double(q[j]) * key(row, j);
      score[row] = dot / std::sqrt(double(d)), mx = std::max(mx, score[row]);
    }
    for (int64_t row = 0; row <= a.pos; ++row) {
      const double p = std::exp(score[row] - mx);
      sum += p;
      for (int j = 0; j < d; ++j) o[j] += p * value(row, j);
    }
    for (int j = 0; j < d; ++j)
      r.mix[size_t(h) * d + j] = float(o[j] / sum / (1.0 + std::exp(-double(a.q_gate[size_t(2 * h + 1) * d + j]))));
  }
  return r;
}

// The device side of an AttnData (each its own caches; qbuf, part and mix as the backend has them).
struct AttnDev {
  float *q_gate, *k, *v, *q_norm, *k_norm, *qbuf, *part, *mix;
  __nv_bfloat16 *K, *V;
  int64_t* pos;
  explicit AttnDev(const AttnData& a) {
    const AttnShape& s = a.s;
    q_gate = upload(a.q_gate), k = upload(a.k), v = upload(a.v), q_norm = upload(a.q_norm), k_norm = upload(a.k_norm);
    K = reinterpret_cast<__nv_bfloat16*>(upload(a.K)), V = reinterpret_cast<__nv_bfloat16*>(upload(a.V));
    pos = upload(std::vector<int64_t>{a.pos});
    CK(cudaMalloc(&qbuf, size_t(s.n_q) * s.d * 4));
    CK(cudaMalloc(&part, attention_part_floats(s.n_q, s.d) * 4));
    CK(cudaMalloc(&mix, size_t(s.n_q) * s.d * 4));
  }
  ~AttnDev() {
    for (void* p : std::initializer_list<void*>{q_gate, k, v, q_norm, k_norm, qbuf, part, mix, K, V, pos})
      cudaFree(p);
  }
};

// CudaBackend's attn_prepare (one row) and attn_decode: attn_prepare_kernel, the split kernel and the merge.
void launch_attn(const AttnShape& s, int64_t cap, const AttnDev& b) {
  launch(attn_prepare_kernel, dim3(1, (s.n_q + s.n_kv + kPrepareWarps - 1) / kPrepareWarps), kPrepareWarps * 32,
         kPrepareWarps * s.d * 4, b.q_gate, b.k, b.v, b.q_norm, b.k_norm, b.qbuf, b.K, b.V, cap, b.pos, s.n_q,
         s.n_kv, s.d, s.rot, kRopeTheta, kRmsEps);
  by_head_dim(s.d, [&](auto D) {
    launch(attention_kernel<D()>, s.n_kv * kDecodeSplits / kAttnWarps, kAttnWarps * 32, attn_smem_bytes<D()>(),
           (const float*)b.qbuf, (const __nv_bfloat16*)b.K, (const __nv_bfloat16*)b.V, cap, (const int64_t*)b.pos,
           s.n_q, s.n_kv, b.part);
  });
  launch(attention_combine_kernel, attention_combine_grid(s.n_q, s.d), kCombineWarps * 32, 0, b.part, s.d,
         b.q_gate, b.mix);
}

// mix (poisoned with NaN first: every element must be written) against the reference; the cache's row pos
// against the reference's, the other rows untouched. Twice: the second launch (mix poisoned again, the row at
// pos now in the cache) must give the same mix, bit for bit.
void attention_case(const AttnShape& s, int64_t pos) {
  const AttnData a = make_attn_data(s, pos);
  const AttnRef r = ref_attention(a);
  const std::string shape = s.name(pos);
  const AttnDev b(a);
  const size_t n_mix = size_t(s.n_q) * s.d;
  auto run = [&] {
    CK(cudaMemsetAsync(b.mix, 0xff, n_mix * 4, stream));
    launch_attn(s, a.cap, b);
    CK(cudaStreamSynchronize(stream));
    CK(cudaGetLastError());
    return download(b.mix, n_mix);
  };
  const std::vector<float> mix = run();
  // q and the probabilities as bf16 on the tensor cores, as in flash attention (prefill_kernels.cu's bounds)
  check("attn", shape, mix, r.mix, 1.5e-2, 4e-3);
  const std::vector<uint16_t> K = download(reinterpret_cast<const uint16_t*>(b.K), a.K.size());
  const std::vector<uint16_t> V = download(reinterpret_cast<const uint16_t*>(b.V), a.V.size());
  std::vector<float> row;
  bool others_kept = true;
  for (const auto* kv : {&K, &V})
    for (int h = 0; h < s.n_kv; ++h)
      for (int64_t t = 0; t < a.cap; ++t)
        for (int j = 0; j < s.d; ++j) {
          const size_t at = (size_t(h) * a.cap + t) * s.d + j;
          if (t == pos) row.push_back(bf16_value((*kv)[at]));
          else others_kept = others_kept && (*kv)[at] == (kv == &K ? a.K : a.V)[at];
        }
  std::vector<float> want = r.krow;
  want.insert(want.end(), r.vrow.begin(), r.vrow.end());
  check("kv row", shape, row, want, 1e-2);  // 1e-2: the rounding of an element may flip (the angle's powf)
  verdict("kv rest", shape, others_kept);
  verdict("again", shape + ": same mix", std::memcmp(run().data(), mix.data(), n_mix * 4) == 0);
}

// In a graph at pos over `layers` layers' caches (the model's 10 attention layers: 80 MB at 4K,
// mostly from DRAM like the step's), per layer.
void attention_time(const AttnShape& s, int64_t pos, int layers) {
  const AttnData a = make_attn_data(s, pos);
  std::vector<std::unique_ptr<AttnDev>> b;
  for (int l = 0; l < layers; ++l) b.push_back(std::make_unique<AttnDev>(a));
  const uint64_t bytes = uint64_t(s.n_kv) * (pos + 1) * s.d * 2 * 2;
  const double us = graph_us([&] {
    for (auto& bl : b) launch_attn(s, a.cap, *bl);
  }, layers);
  print_time("time", s.name(pos), us, bytes);
}

void attention_cases(const AttnShape& s, std::initializer_list<int64_t> positions) {
  for (int64_t pos : positions) attention_case(s, pos);
}

// ---------------------------------------------------------------- argmax

void argmax_case(int V) {
  int32_t* token = nullptr;
  ArgmaxSlot* slot = nullptr;
  CK(cudaMalloc(&token, 4));
  CK(cudaMalloc(&slot, sizeof(ArgmaxSlot)));
  CK(cudaMemset(slot, 0, sizeof(ArgmaxSlot)));
  bool ok = true;
  for (int round = 0; round < 3; ++round) {  // the slot resets itself between rows
    std::vector<float> l = random_floats(V, -30.f, 30.f);
    if (round == 2) l[V / 3] = l[V - 1] = 31.f;  // a tie: the lower id wins
    float* dl = upload(l);
    launch(argmax_kernel, std::min(sms, (V + 1023) / 1024), 1024, 0, (const float*)dl, V, slot, token);
    CK(cudaStreamSynchronize(stream));
    const int want = int(std::max_element(l.begin(), l.end()) - l.begin());
    ok = ok && download(token, 1)[0] == want;
    cudaFree(dl);
  }
  verdict("argmax", "V " + std::to_string(V), ok);
  cudaFree(token), cudaFree(slot);
}

// The tiles alone: gemv_kernel's ring with nothing computed, what the bulk copies themselves move.
__global__ void __launch_bounds__(kDecodeThreads, 2) stream_tiles_kernel(LinDev W, int tile_rows, int stages,
                                                                          uint32_t stage_bytes, float* sink) {
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ uint64_t full[kMaxStages];
  const int tiles = (W.rows + tile_rows - 1) / tile_rows;
  const TileRing ring{smem, stage_bytes, stages, (tiles - int(blockIdx.x) + int(gridDim.x) - 1) / int(gridDim.x),
                      full};
  auto issue = [&](int i) {
    const int r0 = ring.tile(i) * tile_rows, n = min(tile_rows, W.rows - r0);
    mbar_arm(ring.bar(i), tile_bytes(W, n));
    tile_load(W, 0, r0, n, ring.stage(i), ring.bar(i));
  };
  if (threadIdx.x == kIssuer) {
    ring.init();
    for (int i = 0; i < min(stages, ring.count); ++i) issue(i);
  }
  __syncthreads();
  float acc = 0.f;
  for (int i = 0; i < ring.count; ++i) {
    ring.wait(i);
    acc += reinterpret_cast<const float*>(ring.stage(i))[threadIdx.x];
    ring.refill(i, issue);
  }
  if (acc == 12345.f) *sink = acc;  // keeps the reads
}

// The tiles' copies alone, 10 launches chained as the step chains them, each on its own copy of the weights
// when `copies` (a layer's GEMV moves 5-14 MB, which one matrix launched again would serve from L2: the GDN
// in_proj's tiles 3.35 µs from L2 against 4.9 µs from DRAM, H200, docs/performance.md).
void stream_case(int rows, int cols, bool copies) {
  Weights w;
  make_weights(w, 1, rows, cols, 4, kBF16, kBF16, 64);
  std::vector<void*> owned;
  const std::vector<LinDev> c = copies ? copies_of(w.W, 10, owned) : std::vector<LinDev>(10, w.W);
  GemvJobs jobs;
  jobs.W[0] = w.W, jobs.n = 1;
  const uint32_t stage_bytes = plan_gemv(jobs, slots);
  const DecodeGrid g = decode_grid(jobs.tile_first[1], stage_bytes, gemv_row_bytes(cols), slots, "stream");
  float* sink = upload(std::vector<float>(1));
  const double us = graph_us([&] {
    for (int l = 0; l < 10; ++l)
      launch(stream_tiles_kernel, g.blocks, kDecodeThreads, g.smem, c[l], jobs.tile_rows, g.stages, stage_bytes, sink);
  }, 10);
  print_time("tiles", "rows " + std::to_string(rows) + " cols " + std::to_string(cols) + " copies only, " +
             std::to_string(g.blocks) + " blocks " + std::to_string(g.stages) + " stages", us, weight_bytes(w.W));
  for (void* p : owned) cudaFree(p);
  cudaFree(sink);
}

// ---------------------------------------------------------------- a step's projections and experts

// 40 layers of the GDN layer's projections (in_proj with its norm, out_proj into the residual, the router
// with its norm) and experts, each layer its own dense weights, then the logits' projection and argmax: the
// decode step without its recurrences and attention.
void step_case() {
  const int H = 2048, V = 248320, layers = 40;
  Experts ex;
  make_experts(ex, H, 512, 512, 256, 8);
  Weights base[6];
  make_weights(base[0], 1, 8192, H, 4, kBF16, kBF16, 64);  // qkv
  make_weights(base[1], 1, 4096, H, 4, kBF16, kBF16, 64);  // z
  make_weights(base[2], 1, 64, H, 4, kBF16, kBF16, 64);    // b, a
  make_weights(base[3], 1, H, 4096, 4, kBF16, kBF16, 64);  // out_proj
  make_weights(base[4], 1, 256, H, 8, kBF16, kBF16, 64);   // router
  make_weights(base[5], 1, 1, H, 8, kBF16, kBF16, 64);     // shared expert gate
  Weights lm;
  make_weights(lm, 1, V, H, 4, kBF16, kBF16, 64);
  std::vector<void*> owned;
  std::vector<std::vector<LinDev>> c;
  for (auto& w : base) c.push_back(copies_of(w.W, layers, owned));
  const MoeDecode md = ex.plan();
  auto buf = [&](size_t n) {
    float* p = upload(random_floats(n, -1.f, 1.f));
    owned.push_back(p);
    return p;
  };
  float *x = buf(H), *g = buf(H), *qkv = buf(8192), *z = buf(4096), *ba = buf(64), *mix = buf(4096);
  float *sgl = buf(1), *xn = buf(H), *logits = buf(V);
  MoeBuffers b{xn, nullptr, buf(9 * 512), buf(8), sgl, x, nullptr};
  CK(cudaMalloc(&b.ids, 8 * 4));
  owned.push_back(b.ids);
  CK(cudaMalloc(&b.count, kMoeCounts * sizeof(unsigned)));
  CK(cudaMemset(b.count, 0, kMoeCounts * sizeof(unsigned)));
  owned.push_back(b.count);
  b.norm = g;
  std::vector<float*> routers;
  for (int l = 0; l < layers; ++l) routers.push_back(buf(256));
  int32_t* token = nullptr;
  ArgmaxSlot* slot = nullptr;
  CK(cudaMalloc(&token, 4));
  CK(cudaMalloc(&slot, sizeof(ArgmaxSlot)));
  CK(cudaMemset(slot, 0, sizeof(ArgmaxSlot)));
  uint64_t bytes = weight_bytes(lm.W);
  for (auto& w : base) bytes += layers * weight_bytes(w.W);
  bytes += layers * (8 * (weight_bytes(ex.gate.W) + weight_bytes(ex.up.W) + weight_bytes(ex.down.W)) +
                     weight_bytes(ex.sgate.W) + weight_bytes(ex.sup.W) + weight_bytes(ex.sdown.W));
  auto one = [](const LinDev& W, float* out) {
    GemvJobs j;
    j.W[0] = W, j.out[0] = out, j.n = 1;
    return j;
  };
  const double us = graph_us([&] {
    for (int l = 0; l < layers; ++l) {
      GemvJobs in = one(c[0][l], qkv);
      in.W[1] = c[1][l], in.out[1] = z, in.W[2] = c[2][l], in.out[2] = ba, in.n = 3;
      launch_gemv(in, x, H, g, nullptr);
      GemvJobs out = one(c[3][l], x);
      out.accumulate = true;
      launch_gemv(out, mix, 4096, nullptr, nullptr);
      MoeDecode ml = md;  // the route inside the experts' gate/up kernel, as the backend runs it
      ml.router = c[4][l], ml.shared_router = c[5][l];
      MoeBuffers bl = b;
      bl.router = routers[l];
      launch_experts(ml, bl, H);
    }
    launch_gemv(one(lm.W, logits), x, H, g, nullptr);
    launch(argmax_kernel, std::min(sms, (V + 1023) / 1024), 1024, 0, (const float*)logits, V, slot, token);
  }, 1);
  std::printf("%-8s %-50s %8.1f us  %6.2f TB/s  (%d kernels)\n", "step", "40 layers' projections + experts, lm_head",
              us, bytes / us * 1e-6, layers * 4 + 2);
  for (void* p : owned) cudaFree(p);
  cudaFree(token), cudaFree(slot);
}

// The experts' kernel's timeline in the step's last replay (a build with -DLILY_DECODE_TRACE): for `layers` of
// its 40 launches from the 10th, each stamp's median and latest over the blocks that took it, in µs after the
// launch's first block entered (kernels.cuh, MoeTracer).
void print_moe_trace(int layers) {
#ifdef LILY_DECODE_TRACE
  static MoeTrace tr;
  CK(cudaMemcpyFromSymbol(&tr, g_moe_trace, sizeof tr));
  static const char* names[] = {"entry",  "waited",  "staged",  "route_tile", "route_counted", "poll",
                                "count_seen", "topk_first", "topk", "route", "routed0", "gate_up", "synced",
                                "h_staged", "down_tile", "down_summed", "exit"};
  static_assert(sizeof names / sizeof *names == int(MoeStamp::count), "a name a stamp");
  for (int l = 10; l < 10 + layers; ++l) {
    const auto& L = tr.t[(tr.launches[0] - 40 + l) % MoeTrace::kLaunches];
    unsigned long long t0 = ~0ull;
    for (const auto& b : L) if (b[0]) t0 = std::min(t0, b[0]);
    std::printf("trace layer %d:", l);
    for (int q = 0; q < int(MoeStamp::count); ++q) {
      std::vector<double> v;
      for (const auto& b : L) if (b[q] >= t0 && b[q]) v.push_back((b[q] - t0) * 1e-3);
      if (v.empty()) continue;
      std::sort(v.begin(), v.end());
      std::printf(" %s %.2f/%.2f (%zu)", names[q], v[v.size() / 2], v.back(), v.size());
    }
    std::printf("\n");
  }
#else
  (void)layers;
  std::printf("--trace: build with -DLILY_DECODE_TRACE\n");
  ++failures;
#endif
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  const bool small = mode == "--small";
  cudaDeviceProp p;
  CK(cudaGetDeviceProperties(&p, 0));
  sms = p.multiProcessorCount;
  // the backend's decode_slots: two blocks an SM unless $LILY_CUDA_DECODE_BLOCKS_PER_SM says one, as there
  const char* per_sm = std::getenv("LILY_CUDA_DECODE_BLOCKS_PER_SM");
  slots = decode_slots(sms, per_sm && *per_sm ? std::atoi(per_sm) : 2);
  std::printf("%s, %d SMs, decode blocks %d\n", p.name, sms, slots);
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  CK(allow_decode_smem());
  CK(allow_attention_decode_smem());
  if (!moe_decode_fits(moe_decode_kernel_for(2048, true), slots, sms) ||
      !moe_decode_fits(moe_decode_kernel_for(2048, false), slots, sms)) {
    std::printf("the experts' kernel: %d blocks do not fit at once: FAIL\n", slots);
    return 1;
  }
  CK(cudaFuncSetAttribute(stream_tiles_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kDecodeSmem)));
  if (mode == "--step") {  // the step chain alone, three times (A/B comparisons of builds)
    for (int i = 0; i < 3; ++i) step_case();
    return 0;
  }
  if (mode == "--trace") {  // the step chain once, then the experts' kernel's timeline in it
    step_case();
    print_moe_trace(4);
    return failures ? 1 : 0;
  }
  if (mode == "--profile") {  // the model's shapes once each, untimed: for ncu
    gemv_case({{8192, 4}, {4096, 4}, {32, 4}, {32, 4}}, 2048, true, false, false);
    gemv_case({{248320, 4}}, 2048, true, false, false);
    experts_case(2048, 512, 512, 256, 8, false, true);
    return failures ? 1 : 0;
  }
  // the tiny models' shapes and every format: partial tiles, jobs of a few rows, 8-bit, dense
  gemv_case({{96, 4}, {40, 4}, {8, 4}}, 64, true, false, false);
  gemv_case({{200, 4}}, 128, false, true, false);
  gemv_case({{33, 8}, {1, 8}}, 256, true, false, false);
  gemv_case({{72, 0}}, 96, false, false, false);
  gemv_case({{2112, 4}}, 128, true, false, false);
  for (const bool fused : {false, true}) {
    experts_case(64, 64, 128, 8, 2, false, fused);
    experts_case(256, 64, 64, 32, 8, false, fused);
    // the kernel for any format: dense bf16 (the HF checkpoint's), 8-bit experts with f32 scales, 4-bit with a
    // 4-bit router
    experts_case(64, 64, 128, 8, 2, false, fused, {0, 0, kBF16});
    experts_case(256, 64, 64, 32, 8, false, fused, {8, 8, kF32});
    experts_case(256, 64, 64, 32, 8, false, fused, {4, 4, kBF16});
  }
  argmax_case(2112);
  // attention: G = 2 with rot/2 < 32 lanes; G = 8 at d 32 (a lane a dimension); positions in the first block,
  // across blocks, and one whose split's block has empty blocks after it
  attention_cases({4, 2, 64, 16}, {0, 5, 77, 300});
  attention_cases({8, 1, 32, 8}, {0, 130, 301});
  if (!small || mode == "--attention") {
    // the model's (G = 8, d 256): pos 1003 is the 4th key of a split of 8, 4001 the 2nd of a split of 32 with
    // the last two splits empty, 4095 the last key of the last split
    attention_cases({16, 2, 256, 64}, {0, 5, 200, 1003, 4001, 4095});
    for (const int64_t p : {127, 1023, 4095}) attention_time({16, 2, 256, 64}, p, 10);
  }
  if (!small && mode != "--attention") {
    // the model's: GDN in_proj (qkv, z, b, a), attention's (q with its gate, k, v), out / o projection,
    // the router with the shared expert's gate (8-bit), the logits' projection (more tiles than stages)
    gemv_case({{8192, 4}, {4096, 4}, {32, 4}, {32, 4}}, 2048, true, false, true);
    gemv_case({{8192, 4}, {512, 4}, {512, 4}}, 2048, true, false, true);
    gemv_case({{2048, 4}}, 4096, false, true, true);
    gemv_case({{256, 8}, {1, 8}}, 2048, true, false, true);
    gemv_case({{248320, 4}}, 2048, true, false, true);
    experts_case(2048, 512, 512, 256, 8, true, false);
    experts_case(2048, 512, 512, 256, 8, true, true);
    argmax_case(248320);
    stream_case(248320, 2048, false);  // (286 MB: DRAM every launch)
    stream_case(12352, 2048, true);    // the GDN in_proj's tiles
    stream_case(2048, 4096, true);     // the out projection's
    step_case();
  }
  std::printf(failures ? "%d FAILED\n" : "all passed\n", failures);
  return failures ? 1 : 0;
}
