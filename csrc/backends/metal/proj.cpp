// The proj family (metal/proj.metal): decode RMSNorm fused into the projections that share its output, in one
// dispatch — the encoder, and MetalBackend's norm_project / norm_lm_head (moe.cpp's moe_norm_route uses it too).
// Previous hop: the schedule, in decode under Fusions::norm_project (tests: csrc/bindings/kernels_dense.cpp);
// next hop: Encoder::dispatch.
#include <stdexcept>
#include <string>

#include "metal_backend.h"

namespace lily::metal {

static_assert(sizeof(ProjArgs) == 144, "ProjArgs: 8 int32/float + 3 x 4 int32 + 2 x 4 uint64");

void encode_norm_project(Encoder& enc, View x, const DeviceVec& w, float eps, int H, const ProjTarget* targets, int n,
                         bool f32_out, View xn) {
  if (n < 1 || n > LILY_PROJ_MAX_MATRICES)
    throw std::invalid_argument("[proj_norm] " + std::to_string(n) + " matrices (1 to 4)");
  if (H <= 0 || H % LILY_QGEMV_VALUES || H > LILY_PROJ_MAX_COLS || w.size != H)
    throw std::invalid_argument("[proj_norm] H " + std::to_string(H) + " (a multiple of 16 up to 4096) with a norm of " +
                                std::to_string(w.size));
  ProjArgs args{};
  args.n = n, args.cols = H, args.write_xn = xn.buffer ? 1 : 0, args.eps = eps;
  int total = 0;
  MatrixBindings mb[LILY_PROJ_MAX_MATRICES];
  Binding out[LILY_PROJ_MAX_MATRICES];
  const Binding dummy{0, x.buffer, x.offset, Access::read, 16};
  for (int m = 0; m < LILY_PROJ_MAX_MATRICES; ++m) {
    const int i = m < n ? m : 0;
    const DeviceMatrix& W = *targets[i].W;
    if (!W.w || W.cols != H || W.rows <= 0 || W.experts > 1)
      throw std::invalid_argument("[proj_norm] matrix " + std::to_string(i) + " [" + std::to_string(W.rows) + ", " +
                                  std::to_string(W.cols) + "] does not take the H = " + std::to_string(H) + " row");
    if (m < n) {
      mb[m] = bind_matrix(W, LILY_PROJ_W0 + 3 * m, LILY_PROJ_W0 + 3 * m + 1, LILY_PROJ_W0 + 3 * m + 2);
      args.rows[m] = W.rows, args.begin[m] = total, args.format[m] = W.format;
      args.w_row_bytes[m] = W.w_row_bytes, args.s_row_bytes[m] = W.s_row_bytes;
      total += W.rows;
      out[m] = {LILY_PROJ_OUT0 + m, targets[m].out.buffer, targets[m].out.offset, Access::write,
                uint64_t(W.rows) * (f32_out ? 4 : 2)};
    } else {
      // Unused matrix and output slots are bound (Metal wants every declared buffer) to 16 bytes never read,
      // so that the byte counters do not charge the pages of a real binding to them too.
      for (int j = 0; j < 3; ++j) {
        Binding& b = j == 0 ? mb[m].w : j == 1 ? mb[m].s : mb[m].b;
        b = dummy, b.slot = LILY_PROJ_W0 + 3 * m + j;
      }
      out[m] = dummy, out[m].slot = LILY_PROJ_OUT0 + m;
    }
  }
  args.total_rows = total;
  Binding bxn = dummy;
  bxn.slot = LILY_PROJ_XN;
  if (xn.buffer) bxn = {LILY_PROJ_XN, xn.buffer, xn.offset, Access::write, uint64_t(H) * 2};
  const int per_group = LILY_PROJ_ROWS * LILY_PROJ_SIMDGROUPS;
  enc.dispatch(f32_out ? KernelId::proj_norm_f32 : KernelId::proj_norm_bf16,
               Grid{uint32_t((total + per_group - 1) / per_group), 1, 1},
               Grid{uint32_t(LILY_PROJ_SIMDGROUPS * LILY_SIMD_WIDTH), 1, 1}, args,
               {{LILY_PROJ_X, x.buffer, x.offset, Access::read, uint64_t(H) * 4},
                {LILY_PROJ_NORM_W, w.buffer, w.offset, Access::read, uint64_t(H) * 4}, bxn,
                mb[0].w, mb[0].s, mb[0].b, mb[1].w, mb[1].s, mb[1].b, mb[2].w, mb[2].s, mb[2].b, mb[3].w, mb[3].s,
                mb[3].b, out[0], out[1], out[2], out[3]});
}

// ---------------------------------------------------------------- MetalBackend's fused decode norm + projections (metal_backend.h)

// proj_norm holds the normed row in threadgroup memory and sweeps it 16 columns a lane.
bool MetalBackend::proj_fits() const { return c_.hidden % LILY_QGEMV_VALUES == 0 && c_.hidden <= LILY_PROJ_MAX_COLS; }

void MetalBackend::norm_project(Act in, const Vec& w, std::initializer_list<Projection> ps) {
  if (!proj_fits() || in != Act::x || ps.size() > size_t(LILY_PROJ_MAX_MATRICES)) return Backend::norm_project(in, w, ps);
  const DeviceMatrix* src[LILY_PROJ_MAX_MATRICES];
  DeviceMatrix m[LILY_PROJ_MAX_MATRICES];
  ProjTarget t[LILY_PROJ_MAX_MATRICES];
  int n = 0;
  for (const Projection& p : ps) {
    src[n] = &matrix_of(*p.W);
    t[n] = {&m[n], view(p.out)};
    ++n;
  }
  decode_matrices(src, n, m);
  encode_norm_project(enc(), view(Act::x), vec_of(w), c_.rms_eps, c_.hidden, t, n, false);
}

void MetalBackend::norm_lm_head(int row) {
  if (!proj_fits()) return lm_head(row, 1);
  const DeviceMatrix head = lm_head_matrix();
  const ProjTarget t{&head, logits_rows(1)};
  encode_norm_project(enc(), view(Act::x).at(uint64_t(row) * c_.hidden * 4), norm_, c_.rms_eps, c_.hidden, &t, 1, true);
}

}  // namespace lily::metal
