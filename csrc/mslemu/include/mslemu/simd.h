// Barriers, simdgroup collectives (simd_*, quad_*) and simdgroup_matrix (metal_compute, metal_simdgroup,
// metal_simdgroup_matrix).
//
// A collective is computed once all lanes of the simdgroup that have not returned reach it; lanes that
// returned are inactive, as on the GPU, and reading an inactive lane's value yields poison (all bits set:
// NaN or ~0). Lanes reaching different collective calls are reported as divergence, which is stricter than
// the hardware (see README.md).
#pragma once
#include "mslemu/atomic.h"
#include "mslemu/math.h"

namespace mslemu {
template <class T> inline T poison() {
  T r;
  std::memset((void*)&r, 0xFF, sizeof r);
  return r;
}
template <class T> using CombineFn = void (*)(const T* in, T* out, uint32_t mask, const uint32_t* param);

template <class T, CombineFn<T> F> void combine(SimdGroup* sg) {
  T in[kSimdWidth], out[kSimdWidth];
  const uint32_t mask = sg->present;
  for (int l = 0; l < kSimdWidth; ++l) {
    if (mask >> l & 1) std::memcpy((void*)&in[l], sg->slot[l], sizeof(T));
    else in[l] = poison<T>();
  }
  F(in, out, mask, sg->param);
  for (int l = 0; l < kSimdWidth; ++l)
    if (mask >> l & 1) std::memcpy(sg->slot[l], (const void*)&out[l], sizeof(T));
}

template <class T, CombineFn<T> F> inline T collective(const char* op, const T& x, uint32_t param, const Site& site) {
  static_assert(sizeof(T) <= kLaneSlotBytes && std::is_trivially_copyable_v<T>, "value too large for a simd collective");
  Thread* t = t_self;
  unsigned char* slot = t->sg->slot[t->lane];
  std::memcpy(slot, (const void*)&x, sizeof(T));
  simd_collective(op, site, param, &combine<T, F>);
  T r;
  std::memcpy((void*)&r, slot, sizeof(T));
  return r;
}
inline int first_lane(uint32_t mask) { return __builtin_ctz(mask); }
}  // namespace mslemu

namespace metal {
enum class mem_flags : uint {
  mem_none = 0,
  mem_device = 1,
  mem_threadgroup = 2,
  mem_texture = 4,
  mem_threadgroup_imageblock = 8,
  mem_object_data = 16,
};
constexpr mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags((uint)a | (uint)b); }
constexpr mem_flags operator&(mem_flags a, mem_flags b) { return mem_flags((uint)a & (uint)b); }

// Fibers of a threadgroup interleave only at sync points, so every barrier orders all memory; the flags
// cannot be checked for sufficiency (see README.md).
inline void threadgroup_barrier(mem_flags, mslemu::Site site = MSLEMU_HERE) { mslemu::barrier(site); }
inline void atomic_thread_fence(mem_flags, memory_order, thread_scope = thread_scope_device) {
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
}

namespace detail {
template <class T> T op_add(T a, T b) { return a + b; }
template <class T> T op_mul(T a, T b) { return a * b; }
template <class T> T op_max(T a, T b) { return max(a, b); }
template <class T> T op_min(T a, T b) { return min(a, b); }
template <class T> T op_and(T a, T b) { return a & b; }
template <class T> T op_or(T a, T b) { return a | b; }
template <class T> T op_xor(T a, T b) { return a ^ b; }

// Reductions run in lane order; a group of Size lanes (32 for simd_*, 4 for quad_*) reduces separately.
template <class T, T (*Op)(T, T), int Size> void reduce(const T* in, T* out, uint32_t mask, const uint32_t*) {
  for (int g = 0; g < mslemu::kSimdWidth; g += Size) {
    const uint32_t m = (mask >> g) & (Size == 32 ? ~0u : (1u << (Size % 32)) - 1);
    if (!m) continue;
    const int f = g + mslemu::first_lane(m);
    T acc = in[f];
    for (int l = f + 1; l < g + Size; ++l)
      if (mask >> l & 1) acc = Op(acc, in[l]);
    for (int l = g; l < g + Size; ++l) out[l] = acc;
  }
}
template <class T, T (*Op)(T, T), int Identity, bool Inclusive>
void prefix(const T* in, T* out, uint32_t mask, const uint32_t*) {
  T acc = T(Identity);
  for (int l = 0; l < mslemu::kSimdWidth; ++l) {
    if (!(mask >> l & 1)) continue;
    if (!Inclusive) out[l] = acc;
    acc = Op(acc, in[l]);
    if (Inclusive) out[l] = acc;
  }
}
// Data movement: Src(lane, param) names the source lane; -1 keeps the lane's own value.
template <class T, int (*Src)(int, uint32_t)> void shuffle(const T* in, T* out, uint32_t mask, const uint32_t* param) {
  for (int l = 0; l < mslemu::kSimdWidth; ++l) {
    if (!(mask >> l & 1)) continue;
    const int s = Src(l, param[l]);
    out[l] = s < 0 ? in[l] : (s < mslemu::kSimdWidth && (mask >> s & 1)) ? in[s] : mslemu::poison<T>();
  }
}
inline int src_index(int, uint32_t p) { return (int)p; }
inline int src_xor(int l, uint32_t p) { return (int)(l ^ p); }
inline int src_up(int l, uint32_t p) { return l - (int)p < 0 ? -1 : l - (int)p; }
inline int src_down(int l, uint32_t p) { return l + (int)p >= mslemu::kSimdWidth ? -1 : l + (int)p; }
inline int src_rotate_up(int l, uint32_t p) { return (int)((l + 32u - p % 32u) % 32u); }
inline int src_rotate_down(int l, uint32_t p) { return (int)((l + p) % 32u); }
inline int src_quad_index(int l, uint32_t p) { return (l & ~3) | (int)(p & 3); }
inline int src_quad_xor(int l, uint32_t p) { return (l & ~3) | ((l ^ (int)p) & 3); }
inline int src_quad_up(int l, uint32_t p) { return (l & 3) - (int)p < 0 ? -1 : l - (int)p; }
inline int src_quad_down(int l, uint32_t p) { return (l & 3) + (int)p >= 4 ? -1 : l + (int)p; }

template <class T> void broadcast_uniform(const T* in, T* out, uint32_t mask, const uint32_t* param) {
  const int f = mslemu::first_lane(mask);
  for (int l = 0; l < mslemu::kSimdWidth; ++l)
    if ((mask >> l & 1) && param[l] != param[f])
      mslemu::fail("simd_broadcast: lane %d asks for lane %u but lane %d for lane %u; the lane index must be uniform", l,
                   param[l], f, param[f]);
  shuffle<T, src_index>(in, out, mask, param);
}
template <class T> void broadcast_first(const T* in, T* out, uint32_t mask, const uint32_t*) {
  for (int l = 0; l < mslemu::kSimdWidth; ++l) out[l] = in[mslemu::first_lane(mask)];
}
// Result: the vote in the low 32 bits, the lanes that voted in the high 32 bits.
inline void ballot(const uint64_t* in, uint64_t* out, uint32_t mask, const uint32_t*) {
  uint64_t v = (uint64_t)mask << 32;
  for (int l = 0; l < mslemu::kSimdWidth; ++l)
    if ((mask >> l & 1) && in[l]) v |= 1u << l;
  for (int l = 0; l < mslemu::kSimdWidth; ++l) out[l] = v;
}
inline void is_first(const uint32_t*, uint32_t* out, uint32_t mask, const uint32_t*) {
  for (int l = 0; l < mslemu::kSimdWidth; ++l) out[l] = l == mslemu::first_lane(mask);
}
inline void nothing(const uint32_t*, uint32_t*, uint32_t, const uint32_t*) {}
}  // namespace detail

#define MSLEMU_SIMD_REDUCE(name, OP, SIZE)                                                          \
  template <class T> inline T name(T x, mslemu::Site site = MSLEMU_HERE) {                         \
    return mslemu::collective<T, detail::reduce<T, detail::OP<T>, SIZE>>(#name, x, 0, site);        \
  }
MSLEMU_SIMD_REDUCE(simd_sum, op_add, 32)
MSLEMU_SIMD_REDUCE(simd_product, op_mul, 32)
MSLEMU_SIMD_REDUCE(simd_max, op_max, 32)
MSLEMU_SIMD_REDUCE(simd_min, op_min, 32)
MSLEMU_SIMD_REDUCE(simd_and, op_and, 32)
MSLEMU_SIMD_REDUCE(simd_or, op_or, 32)
MSLEMU_SIMD_REDUCE(simd_xor, op_xor, 32)
MSLEMU_SIMD_REDUCE(quad_sum, op_add, 4)
MSLEMU_SIMD_REDUCE(quad_product, op_mul, 4)
MSLEMU_SIMD_REDUCE(quad_max, op_max, 4)
MSLEMU_SIMD_REDUCE(quad_min, op_min, 4)
MSLEMU_SIMD_REDUCE(quad_and, op_and, 4)
MSLEMU_SIMD_REDUCE(quad_or, op_or, 4)
MSLEMU_SIMD_REDUCE(quad_xor, op_xor, 4)
#undef MSLEMU_SIMD_REDUCE

#define MSLEMU_SIMD_PREFIX(name, OP, IDENTITY, INCLUSIVE)                                           \
  template <class T> inline T name(T x, mslemu::Site site = MSLEMU_HERE) {                         \
    return mslemu::collective<T, detail::prefix<T, detail::OP<T>, IDENTITY, INCLUSIVE>>(#name, x, 0, site); \
  }
MSLEMU_SIMD_PREFIX(simd_prefix_exclusive_sum, op_add, 0, false)
MSLEMU_SIMD_PREFIX(simd_prefix_inclusive_sum, op_add, 0, true)
MSLEMU_SIMD_PREFIX(simd_prefix_exclusive_product, op_mul, 1, false)
MSLEMU_SIMD_PREFIX(simd_prefix_inclusive_product, op_mul, 1, true)
#undef MSLEMU_SIMD_PREFIX

#define MSLEMU_SIMD_SHUFFLE(name, SRC)                                                              \
  template <class T> inline T name(T x, ushort p, mslemu::Site site = MSLEMU_HERE) {               \
    return mslemu::collective<T, detail::shuffle<T, detail::SRC>>(#name, x, p, site);               \
  }
MSLEMU_SIMD_SHUFFLE(simd_shuffle, src_index)
MSLEMU_SIMD_SHUFFLE(simd_shuffle_xor, src_xor)
MSLEMU_SIMD_SHUFFLE(simd_shuffle_up, src_up)
MSLEMU_SIMD_SHUFFLE(simd_shuffle_down, src_down)
MSLEMU_SIMD_SHUFFLE(simd_shuffle_rotate_up, src_rotate_up)
MSLEMU_SIMD_SHUFFLE(simd_shuffle_rotate_down, src_rotate_down)
MSLEMU_SIMD_SHUFFLE(quad_shuffle, src_quad_index)
MSLEMU_SIMD_SHUFFLE(quad_broadcast, src_quad_index)
MSLEMU_SIMD_SHUFFLE(quad_shuffle_xor, src_quad_xor)
MSLEMU_SIMD_SHUFFLE(quad_shuffle_up, src_quad_up)
MSLEMU_SIMD_SHUFFLE(quad_shuffle_down, src_quad_down)
#undef MSLEMU_SIMD_SHUFFLE

template <class T> inline T simd_broadcast(T x, ushort lane, mslemu::Site site = MSLEMU_HERE) {
  return mslemu::collective<T, detail::broadcast_uniform<T>>("simd_broadcast", x, lane, site);
}
template <class T> inline T simd_broadcast_first(T x, mslemu::Site site = MSLEMU_HERE) {
  return mslemu::collective<T, detail::broadcast_first<T>>("simd_broadcast_first", x, 0, site);
}

struct simd_vote {
  typedef ulong vote_t;
  vote_t v;
  vote_t lanes;  // lanes that were active when the vote was taken
  template <class U, class = enable_if_t<is_integral_v<U>>> explicit constexpr operator U() const { return (U)v; }
  constexpr bool all() const { return v == lanes; }
  constexpr bool any() const { return v != 0; }
};
namespace detail {
inline simd_vote vote(const char* op, bool b, const mslemu::Site& site) {
  const uint64_t r = mslemu::collective<uint64_t, ballot>(op, b, 0, site);
  return simd_vote{r & 0xFFFFFFFFu, r >> 32};
}
}  // namespace detail
inline simd_vote simd_ballot(bool b, mslemu::Site site = MSLEMU_HERE) { return detail::vote("simd_ballot", b, site); }
inline simd_vote simd_active_threads_mask(mslemu::Site site = MSLEMU_HERE) {
  return detail::vote("simd_active_threads_mask", true, site);
}
inline bool simd_all(bool b, mslemu::Site site = MSLEMU_HERE) { return detail::vote("simd_all", b, site).all(); }
inline bool simd_any(bool b, mslemu::Site site = MSLEMU_HERE) { return detail::vote("simd_any", b, site).any(); }
inline bool simd_is_first(mslemu::Site site = MSLEMU_HERE) {
  return mslemu::collective<uint32_t, detail::is_first>("simd_is_first", 0, 0, site);
}
inline void simdgroup_barrier(mem_flags, mslemu::Site site = MSLEMU_HERE) {
  (void)mslemu::collective<uint32_t, detail::nothing>("simdgroup_barrier", 0, 0, site);
}

// ---------------------------------------------------------------------------------------------------------
// simdgroup_matrix<T, 8, 8>: each lane holds 2 elements, (row, col) and (row, col + 1), in the lane layout
// of Apple GPUs (taken from MLX steel/gemm/mma.h get_coord; not documented by Apple), so that code using
// thread_elements() sees the elements it would on the hardware.
// ---------------------------------------------------------------------------------------------------------
namespace detail {
inline int sgm_row(uint lane) { return (int)(((lane / 4) & 4) + ((lane / 2) % 4)); }
inline int sgm_col(uint lane) { return (int)(((lane / 4) & 2) * 2 + (lane % 2) * 2); }
}  // namespace detail

template <class T, int Cols, int Rows> struct simdgroup_matrix {
  static_assert(Cols == 8 && Rows == 8, "mslemu emulates 8x8 simdgroup matrices only");
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, half> || std::is_same_v<T, bfloat>,
                "simdgroup_matrix element type must be float, half or bfloat");
  vec<T, 2> elements;
  simdgroup_matrix() = default;
  explicit simdgroup_matrix(T diagonal) {
    const uint lane = mslemu::t_self->lane;
    const int r = detail::sgm_row(lane), c = detail::sgm_col(lane);
    elements[0] = r == c ? diagonal : T(0);
    elements[1] = r == c + 1 ? diagonal : T(0);
  }
  vec<T, 2>& thread_elements() { return elements; }
  const vec<T, 2>& thread_elements() const { return elements; }
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;

template <class T, int C, int R> inline simdgroup_matrix<T, C, R> make_filled_simdgroup_matrix(T value) {
  simdgroup_matrix<T, C, R> m;
  m.elements = vec<T, 2>(value);
  return m;
}

// matrix_origin is (column, row) of the matrix's first element in memory; transpose_matrix loads (stores)
// the transpose of the 8x8 block found there.
template <class T, class E>
inline void simdgroup_load(simdgroup_matrix<T, 8, 8>& d, const E* src, ulong elements_per_row = 8,
                           ulong2 matrix_origin = ulong2(0), bool transpose_matrix = false) {
  static_assert(std::is_same_v<remove_cv_t<remove_addrspace_t<E>>, T>, "simdgroup_load: pointer and matrix element types differ");
  const uint lane = mslemu::t_self->lane;
  for (int j = 0; j < 2; ++j) {
    ulong r = (ulong)detail::sgm_row(lane), c = (ulong)detail::sgm_col(lane) + j;
    if (transpose_matrix) std::swap(r, c);
    d.elements[j] = src[(matrix_origin.y + r) * elements_per_row + matrix_origin.x + c];
  }
}
template <class T, class E>
inline void simdgroup_store(const simdgroup_matrix<T, 8, 8>& a, E* dst, ulong elements_per_row = 8,
                            ulong2 matrix_origin = ulong2(0), bool transpose_matrix = false) {
  static_assert(std::is_same_v<remove_cv_t<remove_addrspace_t<E>>, T>, "simdgroup_store: pointer and matrix element types differ");
  const uint lane = mslemu::t_self->lane;
  for (int j = 0; j < 2; ++j) {
    ulong r = (ulong)detail::sgm_row(lane), c = (ulong)detail::sgm_col(lane) + j;
    if (transpose_matrix) std::swap(r, c);
    dst[(matrix_origin.y + r) * elements_per_row + matrix_origin.x + c] = a.elements[j];
  }
}

namespace detail {
template <class TD, class TA, class TB, class TC> struct mma_lane {
  vec<TA, 2> a;
  vec<TB, 2> b;
  vec<TC, 2> c;
  vec<TD, 2> d;
};
// Products accumulate in float with fma in k order, then round once to the destination type; the GPU's
// internal precision for half/bfloat operands is not documented.
template <class TD, class TA, class TB, class TC>
void mma(const mma_lane<TD, TA, TB, TC>* in, mma_lane<TD, TA, TB, TC>* out, uint32_t mask, const uint32_t*) {
  if (mask != ~0u)
    mslemu::fail("simdgroup_multiply_accumulate needs all 32 lanes of the simdgroup (active lanes 0x%08x)", mask);
  float A[8][8], B[8][8], C[8][8];
  for (uint l = 0; l < 32; ++l)
    for (int j = 0; j < 2; ++j) {
      const int r = sgm_row(l), c = sgm_col(l) + j;
      A[r][c] = (float)in[l].a[j];
      B[r][c] = (float)in[l].b[j];
      C[r][c] = (float)in[l].c[j];
    }
  for (uint l = 0; l < 32; ++l)
    for (int j = 0; j < 2; ++j) {
      const int r = sgm_row(l), c = sgm_col(l) + j;
      float s = C[r][c];
      for (int k = 0; k < 8; ++k) s = __builtin_fmaf(A[r][k], B[k][c], s);
      out[l].d[j] = (TD)s;
    }
}
}  // namespace detail

template <class TD, class TA, class TB, class TC>
inline void simdgroup_multiply_accumulate(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                                          const simdgroup_matrix<TB, 8, 8>& b, const simdgroup_matrix<TC, 8, 8>& c,
                                          mslemu::Site site = MSLEMU_HERE) {
  using L = detail::mma_lane<TD, TA, TB, TC>;
  L in{a.elements, b.elements, c.elements, vec<TD, 2>(TD(0))};
  d.elements = mslemu::collective<L, detail::mma<TD, TA, TB, TC>>("simdgroup_multiply_accumulate", in, 0, site).d;
}
template <class TD, class TA, class TB>
inline void simdgroup_multiply(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                               const simdgroup_matrix<TB, 8, 8>& b, mslemu::Site site = MSLEMU_HERE) {
  simdgroup_multiply_accumulate(d, a, b, make_filled_simdgroup_matrix<TD, 8, 8>(TD(0)), site);
}
}  // namespace metal
