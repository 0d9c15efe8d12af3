// MSL math, common, integer, relational and geometric functions (metal_math, metal_common, ...).
//
// Overloads exist for float and half (half computes in float and rounds once) and elementwise for their
// vectors. Like Metal's own metal_stdlib there are no bfloat overloads: kernels convert bfloat to float for
// math, and an emulator that accepted exp(bfloat) would pass code the Metal compiler rejects.
#pragma once
#include "mslemu/types.h"

namespace metal {
namespace detail {
template <class T> constexpr bool is_math_scalar_v = std::is_same_v<T, float> || std::is_same_v<T, half>;
template <class T> constexpr bool is_msl_scalar_v = std::is_integral_v<T> || is_math_scalar_v<T>;
template <class T, int N, class F> inline vec<T, N> map(vec<T, N> a, F f) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = f((T)a[i]);
  return r;
}
template <class T, int N, class F> inline vec<T, N> map(vec<T, N> a, vec<T, N> b, F f) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = f((T)a[i], (T)b[i]);
  return r;
}
template <class T, int N, class F> inline vec<T, N> map(vec<T, N> a, vec<T, N> b, vec<T, N> c, F f) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = f((T)a[i], (T)b[i], (T)c[i]);
  return r;
}
}  // namespace detail

#define MSLEMU_MATH1(name, expr)                                                                   \
  inline float name(float x) { return expr; }                                                      \
  inline half name(half x) { return (half)name((float)x); }                                        \
  template <class T, int N, class = enable_if_t<detail::is_math_scalar_v<T>>>                      \
  inline vec<T, N> name(vec<T, N> v) { return detail::map(v, [](T x) { return name(x); }); }
#define MSLEMU_MATH2(name, expr)                                                                   \
  inline float name(float x, float y) { return expr; }                                             \
  inline half name(half x, half y) { return (half)name((float)x, (float)y); }                      \
  template <class T, int N, class = enable_if_t<detail::is_math_scalar_v<T>>>                      \
  inline vec<T, N> name(vec<T, N> a, vec<T, N> b) { return detail::map(a, b, [](T x, T y) { return name(x, y); }); }

MSLEMU_MATH1(exp, __builtin_expf(x))
MSLEMU_MATH1(exp2, __builtin_exp2f(x))
MSLEMU_MATH1(exp10, __builtin_powf(10.0f, x))
MSLEMU_MATH1(log, __builtin_logf(x))
MSLEMU_MATH1(log2, __builtin_log2f(x))
MSLEMU_MATH1(log10, __builtin_log10f(x))
MSLEMU_MATH1(sqrt, __builtin_sqrtf(x))
MSLEMU_MATH1(rsqrt, 1.0f / __builtin_sqrtf(x))
MSLEMU_MATH1(sin, __builtin_sinf(x))
MSLEMU_MATH1(cos, __builtin_cosf(x))
MSLEMU_MATH1(tan, __builtin_tanf(x))
MSLEMU_MATH1(asin, __builtin_asinf(x))
MSLEMU_MATH1(acos, __builtin_acosf(x))
MSLEMU_MATH1(atan, __builtin_atanf(x))
MSLEMU_MATH1(sinh, __builtin_sinhf(x))
MSLEMU_MATH1(cosh, __builtin_coshf(x))
MSLEMU_MATH1(tanh, __builtin_tanhf(x))
MSLEMU_MATH1(asinh, __builtin_asinhf(x))
MSLEMU_MATH1(acosh, __builtin_acoshf(x))
MSLEMU_MATH1(atanh, __builtin_atanhf(x))
MSLEMU_MATH1(fabs, __builtin_fabsf(x))
MSLEMU_MATH1(floor, __builtin_floorf(x))
MSLEMU_MATH1(ceil, __builtin_ceilf(x))
MSLEMU_MATH1(round, __builtin_roundf(x))
MSLEMU_MATH1(rint, __builtin_rintf(x))
MSLEMU_MATH1(trunc, __builtin_truncf(x))
MSLEMU_MATH1(fract, __builtin_fminf(x - __builtin_floorf(x), 0x1.fffffep-1f))
MSLEMU_MATH1(saturate, __builtin_fminf(__builtin_fmaxf(x, 0.0f), 1.0f))
MSLEMU_MATH1(sign, x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : (x != x ? 0.0f : x)))
MSLEMU_MATH2(pow, __builtin_powf(x, y))
MSLEMU_MATH2(powr, __builtin_powf(x, y))
MSLEMU_MATH2(atan2, __builtin_atan2f(x, y))
MSLEMU_MATH2(fmod, __builtin_fmodf(x, y))
MSLEMU_MATH2(fmax, __builtin_fmaxf(x, y))
MSLEMU_MATH2(fmin, __builtin_fminf(x, y))
MSLEMU_MATH2(fdim, __builtin_fdimf(x, y))
MSLEMU_MATH2(copysign, __builtin_copysignf(x, y))
MSLEMU_MATH2(nextafter, __builtin_nextafterf(x, y))
MSLEMU_MATH2(divide, x / y)
#undef MSLEMU_MATH1
#undef MSLEMU_MATH2

inline float fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
inline half fma(half a, half b, half c) { return (half)__builtin_fmaf((float)a, (float)b, (float)c); }
template <class T, int N, class = enable_if_t<detail::is_math_scalar_v<T>>>
inline vec<T, N> fma(vec<T, N> a, vec<T, N> b, vec<T, N> c) {
  return detail::map(a, b, c, [](T x, T y, T z) { return fma(x, y, z); });
}
inline float ldexp(float x, int e) { return __builtin_ldexpf(x, e); }
inline half ldexp(half x, int e) { return (half)__builtin_ldexpf((float)x, e); }

// ---- min / max / clamp / abs for every MSL scalar and vector ----
template <class T> inline enable_if_t<detail::is_msl_scalar_v<T>, T> max(T a, T b) {
  if constexpr (detail::is_math_scalar_v<T>) return (T)__builtin_fmaxf((float)a, (float)b);
  else return a > b ? a : b;
}
template <class T> inline enable_if_t<detail::is_msl_scalar_v<T>, T> min(T a, T b) {
  if constexpr (detail::is_math_scalar_v<T>) return (T)__builtin_fminf((float)a, (float)b);
  else return a < b ? a : b;
}
template <class T, int N> inline vec<T, N> max(vec<T, N> a, vec<T, N> b) { return detail::map(a, b, [](T x, T y) { return max(x, y); }); }
template <class T, int N> inline vec<T, N> min(vec<T, N> a, vec<T, N> b) { return detail::map(a, b, [](T x, T y) { return min(x, y); }); }
template <class T, int N> inline vec<T, N> max(vec<T, N> a, T b) { return max(a, vec<T, N>(b)); }
template <class T, int N> inline vec<T, N> min(vec<T, N> a, T b) { return min(a, vec<T, N>(b)); }
template <class T> inline enable_if_t<detail::is_msl_scalar_v<T>, T> max3(T a, T b, T c) { return max(max(a, b), c); }
template <class T> inline enable_if_t<detail::is_msl_scalar_v<T>, T> min3(T a, T b, T c) { return min(min(a, b), c); }
template <class T> inline enable_if_t<detail::is_msl_scalar_v<T>, T> median3(T a, T b, T c) {
  return max(min(a, b), min(max(a, b), c));
}
template <class T> inline enable_if_t<detail::is_msl_scalar_v<T>, T> clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }
template <class T, int N> inline vec<T, N> clamp(vec<T, N> x, vec<T, N> lo, vec<T, N> hi) { return min(max(x, lo), hi); }
template <class T, int N> inline vec<T, N> clamp(vec<T, N> x, T lo, T hi) { return min(max(x, vec<T, N>(lo)), vec<T, N>(hi)); }

template <class T> inline enable_if_t<detail::is_msl_scalar_v<T>, T> abs(T x) {
  if constexpr (detail::is_math_scalar_v<T>) return (T)__builtin_fabsf((float)x);
  else if constexpr (std::is_signed_v<T>) return x < 0 ? T(-x) : x;
  else return x;
}
template <class T, int N> inline vec<T, N> abs(vec<T, N> v) { return detail::map(v, [](T x) { return abs(x); }); }
template <class T> inline enable_if_t<std::is_integral_v<T>, make_unsigned_t<T>> absdiff(T a, T b) {
  return a > b ? make_unsigned_t<T>(a - b) : make_unsigned_t<T>(b - a);
}

template <class T, class U> inline T mix(T x, T y, U a) { return x + (y - x) * a; }
template <class T> inline T step(T edge, T x) { return x < edge ? T(0) : T(1); }
template <class T> inline T smoothstep(T e0, T e1, T x) {
  T t = clamp((x - e0) / (e1 - e0), T(0), T(1));
  return t * t * (T(3) - T(2) * t);
}

// ---- relational ----
template <class T> inline enable_if_t<detail::is_math_scalar_v<T>, bool> isnan(T x) { return __builtin_isnan((float)x); }
template <class T> inline enable_if_t<detail::is_math_scalar_v<T>, bool> isinf(T x) { return __builtin_isinf((float)x); }
template <class T> inline enable_if_t<detail::is_math_scalar_v<T>, bool> isfinite(T x) { return __builtin_isfinite((float)x); }
template <class T> inline enable_if_t<detail::is_math_scalar_v<T>, bool> isnormal(T x) { return __builtin_isnormal((float)x); }
template <class T> inline enable_if_t<detail::is_math_scalar_v<T>, bool> signbit(T x) { return __builtin_signbit((float)x); }
template <class T, int N> inline vec<bool, N> isnan(vec<T, N> v) { vec<bool, N> r; for (int i = 0; i < N; ++i) r[i] = isnan((T)v[i]); return r; }
template <class T, int N> inline vec<bool, N> isinf(vec<T, N> v) { vec<bool, N> r; for (int i = 0; i < N; ++i) r[i] = isinf((T)v[i]); return r; }
template <class T, int N> inline vec<bool, N> isfinite(vec<T, N> v) { vec<bool, N> r; for (int i = 0; i < N; ++i) r[i] = isfinite((T)v[i]); return r; }
template <class V> inline bool all(V v) {
  if constexpr (is_vector_v<V>) {
    for (int i = 0; i < vec_elements<V>::value; ++i)
      if (!v[i]) return false;
    return true;
  } else {
    return (bool)v;
  }
}
template <class V> inline bool any(V v) {
  if constexpr (is_vector_v<V>) {
    for (int i = 0; i < vec_elements<V>::value; ++i)
      if (v[i]) return true;
    return false;
  } else {
    return (bool)v;
  }
}
template <class T> inline enable_if_t<!is_vector_v<T>, T> select(T a, T b, bool c) { return c ? b : a; }
template <class T, int N, class M> inline vec<T, N> select(vec<T, N> a, vec<T, N> b, M c) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = c[i] ? b[i] : a[i];
  return r;
}

// ---- geometric ----
template <class T, int N> inline T dot(vec<T, N> a, vec<T, N> b) {
  T s = T(0);
  for (int i = 0; i < N; ++i) s += a[i] * b[i];
  return s;
}
template <class T, int N> inline T length(vec<T, N> a) { return sqrt(dot(a, a)); }
template <class T, int N> inline T distance(vec<T, N> a, vec<T, N> b) { return length(a - b); }
template <class T, int N> inline vec<T, N> normalize(vec<T, N> a) { return a * rsqrt(dot(a, a)); }
template <class T> inline vec<T, 3> cross(vec<T, 3> a, vec<T, 3> b) { return a.yzx * b.zxy - a.zxy * b.yzx; }

// ---- integer ----
template <class T> constexpr int bit_width_v = 8 * (int)sizeof(T);
template <class T> inline enable_if_t<std::is_integral_v<T>, T> popcount(T x) {
  return (T)__builtin_popcountll((unsigned long long)make_unsigned_t<T>(x));
}
template <class T> inline enable_if_t<std::is_integral_v<T>, T> clz(T x) {
  auto u = (unsigned long long)make_unsigned_t<T>(x);
  return u ? T(__builtin_clzll(u) - (64 - bit_width_v<T>)) : T(bit_width_v<T>);
}
template <class T> inline enable_if_t<std::is_integral_v<T>, T> ctz(T x) {
  auto u = (unsigned long long)make_unsigned_t<T>(x);
  return u ? T(__builtin_ctzll(u)) : T(bit_width_v<T>);
}
inline uint mulhi(uint a, uint b) { return (uint)(((uint64_t)a * b) >> 32); }
inline int mulhi(int a, int b) { return (int)(((int64_t)a * b) >> 32); }
template <class T> inline enable_if_t<std::is_integral_v<T>, T> rotate(T v, T n) {
  using U = make_unsigned_t<T>;
  const int w = bit_width_v<T>, s = (int)(U(n) % w);
  return s == 0 ? v : T((U(v) << s) | (U(v) >> (w - s)));
}
template <class T> inline enable_if_t<std::is_integral_v<T>, T> extract_bits(T x, uint offset, uint bits) {
  using U = make_unsigned_t<T>;
  if (bits == 0) return T(0);
  U field = U(U(x) >> offset);
  if (bits < (uint)bit_width_v<T>) field &= U((U(1) << bits) - 1);
  if constexpr (std::is_signed_v<T>) {  // signed results are sign-extended from the field's top bit
    const int sh = bit_width_v<T> - (int)bits;
    return T(T(field << sh) >> sh);
  } else {
    return T(field);
  }
}
template <class T> inline enable_if_t<std::is_integral_v<T>, T> insert_bits(T base, T insert, uint offset, uint bits) {
  using U = make_unsigned_t<T>;
  const U mask = bits >= (uint)bit_width_v<T> ? U(~U(0)) : U(U((U(1) << bits) - 1) << offset);
  return T((U(base) & U(~mask)) | (U(U(insert) << offset) & mask));
}
template <class T> inline enable_if_t<std::is_integral_v<T>, T> reverse_bits(T x) {
  using U = make_unsigned_t<T>;
  U u = U(x), r = 0;
  for (int i = 0; i < bit_width_v<T>; ++i) r = U(r | U(((u >> i) & 1u) << (bit_width_v<T> - 1 - i)));
  return T(r);
}
template <class T, int N> inline vec<T, N> popcount(vec<T, N> v) { return detail::map(v, [](T x) { return popcount(x); }); }

// fast:: and precise:: select accuracy on the GPU; here both are the float implementation above.
namespace fast {
using metal::clamp;
using metal::cos;
using metal::divide;
using metal::exp;
using metal::exp10;
using metal::exp2;
using metal::fabs;
using metal::fmax;
using metal::fmin;
using metal::log;
using metal::log10;
using metal::log2;
using metal::max;
using metal::min;
using metal::pow;
using metal::powr;
using metal::rsqrt;
using metal::sin;
using metal::sqrt;
using metal::tan;
using metal::tanh;
}  // namespace fast
namespace precise {
using namespace fast;
}  // namespace precise
}  // namespace metal

#define MAXFLOAT 0x1.fffffep+127f
#define HUGE_VALF __builtin_huge_valf()
#define INFINITY __builtin_inff()
#define NAN __builtin_nanf("")
#define FLT_MAX 0x1.fffffep+127f
#define FLT_MIN 0x1p-126f
#define FLT_EPSILON 0x1p-23f
#define HALF_MAX ((half)65504.0f)
#define HALF_MIN ((half)6.103515625e-05f)
#define HALF_EPSILON ((half)0.0009765625f)
#define M_E_F 2.71828182845904523536f
#define M_LOG2E_F 1.44269504088896340736f
#define M_LOG10E_F 0.434294481903251827651f
#define M_LN2_F 0.693147180559945309417f
#define M_LN10_F 2.30258509299404568402f
#define M_PI_F 3.14159265358979323846f
#define M_PI_2_F 1.57079632679489661923f
#define M_PI_4_F 0.785398163397448309616f
#define M_1_PI_F 0.318309886183790671538f
#define M_2_PI_F 0.636619772367581343076f
#define M_2_SQRTPI_F 1.12837916709551257390f
#define M_SQRT2_F 1.41421356237309504880f
#define M_SQRT1_2_F 0.707106781186547524401f
