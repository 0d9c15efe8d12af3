// The Gated DeltaNet family (metal/gdn.metal): prefill as gdn_conv → gdn_scan → gdn_gated_norm (two barriers,
// derived from the bindings), decode as the single fused gdn_step — the encoders, and MetalBackend's gdn_scan /
// gdn_step. Previous hop: the schedule (csrc/schedule/schedule.cpp; tests: csrc/bindings/kernels_gdn.cpp);
// next hop: Encoder::dispatch.
#include <cmath>
#include <stdexcept>
#include <string>

#include "metal_backend.h"

namespace lily::metal {

static_assert(sizeof(GdnArgs) == 8 * 4, "GdnArgs: 6 int32 + 2 float, no padding");

// Prefill intermediates for max_rows rows, allocated once (the chunk size bounds them).
struct GdnScratch {
  std::shared_ptr<Buffer> qkvc;   // bf16 [max_rows, C]: conv + SiLU, q/k l2-normalised
  std::shared_ptr<Buffer> gates;  // f32 [max_rows, n_v, 2]: (β, α)
  std::shared_ptr<Buffer> o;      // f32 [max_rows, n_v·d_v]: scan output before the gated norm
  int max_rows = 0;
};

namespace {

int conv_channels(const GdnDevice& G) { return 2 * G.nk * G.dk + G.nv * G.dv; }

void check(const GdnDevice& G) {
  const auto fail = [&](const std::string& why) {
    throw std::invalid_argument("[gdn] " + why + " (n_k " + std::to_string(G.nk) + ", n_v " + std::to_string(G.nv) +
                                ", d_k " + std::to_string(G.dk) + ", d_v " + std::to_string(G.dv) + ", k_c " +
                                std::to_string(G.conv_kernel) + ")");
  };
  if (G.nk <= 0 || G.nv <= 0 || G.nv % G.nk) fail("n_v must be a positive multiple of n_k");
  if (G.nv / G.nk > LILY_GDN_MAX_GROUP) fail("n_v / n_k above LILY_GDN_MAX_GROUP");
  for (int d : {G.dk, G.dv})
    if (d <= 0 || d % LILY_SIMD_WIDTH || d > LILY_GDN_MAX_HEAD_DIM) fail("head dims must be multiples of 32 up to 128");
  if (G.dv % LILY_GDN_SCAN_COLUMNS) fail("d_v must be a multiple of LILY_GDN_SCAN_COLUMNS");
  if (G.conv_kernel != LILY_GDN_CONV_KERNEL) fail("the kernels are built for k_c = LILY_GDN_CONV_KERNEL");
  const int C = conv_channels(G);
  if (G.conv.size != C * G.conv_kernel || G.A_log.size != G.nv || G.dt_bias.size != G.nv || G.norm.size != G.dv)
    fail("parameter vector sizes do not match the dims");
}

GdnArgs make_args(const GdnDevice& G, int T) {
  return GdnArgs{
      .T = T,
      .nk = G.nk,
      .nv = G.nv,
      .dk = G.dk,
      .dv = G.dv,
      .C = conv_channels(G),
      .q_scale = 1.f / std::sqrt(float(G.dk)),
      .eps = G.eps,
  };
}

Binding vec(int slot, const DeviceVec& v) {
  return {slot, v.buffer, v.offset, Access::read, uint64_t(v.size) * 4};
}
Binding view(int slot, View v, Access access, uint64_t bytes) { return {slot, v.buffer, v.offset, access, bytes}; }

uint32_t div_up(int a, int b) { return uint32_t((a + b - 1) / b); }

}  // namespace

std::shared_ptr<GdnScratch> make_gdn_scratch(Device& dev, const GdnDevice& G, int max_rows) {
  check(G);
  if (max_rows <= 0) throw std::invalid_argument("[gdn] max_rows must be positive");
  auto s = std::make_shared<GdnScratch>();
  const uint64_t rows = uint64_t(max_rows);
  s->qkvc = dev.alloc(rows * conv_channels(G) * 2, Role::activations, "gdn.qkvc");
  s->gates = dev.alloc(rows * G.nv * 2 * 4, Role::activations, "gdn.gates");
  s->o = dev.alloc(rows * G.nv * G.dv * 4, Role::activations, "gdn.o");
  s->max_rows = max_rows;
  return s;
}

void encode_gdn_prefill(Encoder& enc, GdnScratch& s, const GdnDevice& G, View qkv, View z, View beta, View alpha,
                        int T, const GdnStates& st, View out) {
  check(G);
  if (T <= 0 || T > s.max_rows)
    throw std::invalid_argument("[gdn] prefill of " + std::to_string(T) + " rows, scratch holds " +
                                std::to_string(s.max_rows));
  const GdnArgs args = make_args(G, T);
  const uint64_t C = uint64_t(args.C), V = uint64_t(G.nv) * G.dv, rows = uint64_t(T);
  const uint64_t conv_bytes = uint64_t(G.conv_kernel - 1) * C * 4;
  const uint64_t state_bytes = uint64_t(G.nv) * G.dk * G.dv * 4;
  const View qkvc{s.qkvc.get(), 0}, gates{s.gates.get(), 0}, o{s.o.get(), 0};
  const uint32_t sg = LILY_SIMD_WIDTH;

  enc.dispatch(KernelId::gdn_conv_bf16, Grid{div_up(2 * G.nk + G.nv, LILY_GDN_CONV_HEADS), div_up(T, LILY_GDN_CONV_ROWS)},
               Grid{LILY_GDN_CONV_HEADS * sg}, args,
               {view(GDN_QKV, qkv, Access::read, rows * C * 2), view(GDN_B, beta, Access::read, rows * G.nv * 2),
                view(GDN_A, alpha, Access::read, rows * G.nv * 2), vec(GDN_CONV_W, G.conv), vec(GDN_A_LOG, G.A_log),
                vec(GDN_DT_BIAS, G.dt_bias), view(GDN_CONV_STATE, st.conv_in, Access::read, conv_bytes),
                view(GDN_CONV_STATE_OUT, st.conv_out, Access::write, conv_bytes),
                view(GDN_QKVC, qkvc, Access::write, rows * C * 2),
                view(GDN_GATES, gates, Access::write, rows * G.nv * 8)});
  enc.dispatch(KernelId::gdn_scan_bf16, Grid{uint32_t(G.dv / LILY_GDN_SCAN_COLUMNS), uint32_t(G.nv)},
               Grid{LILY_GDN_SCAN_COLUMNS * sg}, args,
               {view(GDN_QKVC, qkvc, Access::read, rows * C * 2), view(GDN_GATES, gates, Access::read, rows * G.nv * 8),
                view(GDN_REC_STATE, st.rec_in, Access::read, state_bytes),
                view(GDN_REC_STATE_OUT, st.rec_out, Access::write, state_bytes),
                view(GDN_O, o, Access::write, rows * V * 4)});
  enc.dispatch(KernelId::gdn_gated_norm_bf16, Grid{div_up(G.nv, LILY_GDN_NORM_HEADS), uint32_t(T)},
               Grid{LILY_GDN_NORM_HEADS * sg}, args,
               {view(GDN_O, o, Access::read, rows * V * 4), view(GDN_Z, z, Access::read, rows * V * 2),
                vec(GDN_NORM_W, G.norm), view(GDN_OUT, out, Access::write, rows * V * 2)});
}

void encode_gdn_decode(Encoder& enc, GdnScratch& s, const GdnDevice& G, View qkv, View z, View beta, View alpha,
                       const GdnStates& st, View out) {
  check(G);
  (void)s;  // decode keeps every intermediate on chip
  const GdnArgs args = make_args(G, 1);
  const uint64_t C = uint64_t(args.C), V = uint64_t(G.nv) * G.dv;
  const uint64_t conv_bytes = uint64_t(G.conv_kernel - 1) * C * 4, state_bytes = uint64_t(G.nv) * G.dk * G.dv * 4;
  enc.dispatch(KernelId::gdn_step_bf16, Grid{uint32_t(G.nk)}, Grid{LILY_GDN_STEP_SIMDGROUPS * LILY_SIMD_WIDTH}, args,
               {view(GDN_QKV, qkv, Access::read, C * 2), view(GDN_Z, z, Access::read, V * 2),
                view(GDN_B, beta, Access::read, uint64_t(G.nv) * 2), view(GDN_A, alpha, Access::read, uint64_t(G.nv) * 2),
                vec(GDN_CONV_W, G.conv), vec(GDN_A_LOG, G.A_log), vec(GDN_DT_BIAS, G.dt_bias), vec(GDN_NORM_W, G.norm),
                view(GDN_CONV_STATE, st.conv_in, Access::read, conv_bytes),
                view(GDN_REC_STATE, st.rec_in, Access::read, state_bytes), view(GDN_OUT, out, Access::write, V * 2),
                view(GDN_CONV_STATE_OUT, st.conv_out, Access::write, conv_bytes),
                view(GDN_REC_STATE_OUT, st.rec_out, Access::write, state_bytes)});
}

// ---------------------------------------------------------------- MetalBackend's Gated DeltaNet ops (metal_backend.h)

void MetalBackend::gdn_scan(int layer, int T) {
  encode_gdn_prefill(enc(), *gdn_scratch_, gdn_[layer], view(Act::qkv), view(Act::z), view(Act::beta),
                     view(Act::alpha), T, gdn_states(layer), view(Act::mix));
}

void MetalBackend::gdn_step(int layer) {
  encode_gdn_decode(enc(), *gdn_scratch_, gdn_[layer], view(Act::qkv), view(Act::z), view(Act::beta),
                    view(Act::alpha), gdn_states(layer), view(Act::mix));
}

}  // namespace lily::metal
