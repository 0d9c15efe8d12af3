// MSL scalar and vector types, Metal-style vector construction, type traits, as_type.
#pragma once
#include <cstdint>
#include <limits>
#include <type_traits>

#include "mslemu/exec.h"

typedef _Float16 half;
typedef __bf16 bfloat;
typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong;

namespace metal {
using ::bfloat;
using ::half;
using ::uchar;
using ::uint;
using ::ulong;
using ::ushort;
using std::int16_t;
using std::int32_t;
using std::int64_t;
using std::int8_t;
using std::ptrdiff_t;
using std::size_t;
using std::uint16_t;
using std::uint32_t;
using std::uint64_t;
using std::uint8_t;

template <class T, int N> using vec = T __attribute__((ext_vector_type(N)));
}  // namespace metal

// Vector types are built into MSL, so they live in the global namespace (and in metal::).
#define MSLEMU_VECTORS(T, P)                                                                      \
  typedef metal::vec<T, 2> P##2;                                                                  \
  typedef metal::vec<T, 3> P##3;                                                                  \
  typedef metal::vec<T, 4> P##4;                                                                  \
  /* packed 2/4-vectors have the element's alignment; a packed 3-vector is 3 elements long */     \
  typedef T packed_##P##2 __attribute__((ext_vector_type(2), aligned(alignof(T))));              \
  typedef T packed_##P##4 __attribute__((ext_vector_type(4), aligned(alignof(T))));              \
  typedef metal::packed_vec3<T> packed_##P##3;                                                    \
  namespace metal {                                                                               \
  using ::P##2;                                                                                   \
  using ::P##3;                                                                                   \
  using ::P##4;                                                                                   \
  using ::packed_##P##2;                                                                          \
  using ::packed_##P##3;                                                                          \
  using ::packed_##P##4;                                                                          \
  }

namespace metal {
// A packed 3-vector is a struct (ext_vector_type(3) is 4 elements long). Read one from device or constant
// memory with the explicit constructor, float3(p[i]): an implicit conversion would need a member function
// callable on an object in another address space, which C++ cannot express.
template <class T> struct packed_vec3 {
  T x, y, z;
  packed_vec3() = default;
  packed_vec3(vec<T, 3> v) : x(v.x), y(v.y), z(v.z) {}
  operator vec<T, 3>() const { return vec<T, 3>{x, y, z}; }
  T& operator[](int i) { return (&x)[i]; }
  const T& operator[](int i) const { return (&x)[i]; }
};
}  // namespace metal

MSLEMU_VECTORS(float, float)
MSLEMU_VECTORS(half, half)
MSLEMU_VECTORS(bfloat, bfloat)
MSLEMU_VECTORS(char, char)
MSLEMU_VECTORS(uchar, uchar)
MSLEMU_VECTORS(short, short)
MSLEMU_VECTORS(ushort, ushort)
MSLEMU_VECTORS(int, int)
MSLEMU_VECTORS(uint, uint)
MSLEMU_VECTORS(long, long)
MSLEMU_VECTORS(ulong, ulong)
typedef metal::vec<bool, 2> bool2;
typedef metal::vec<bool, 3> bool3;
typedef metal::vec<bool, 4> bool4;
namespace metal {
using ::bool2;
using ::bool3;
using ::bool4;
}  // namespace metal
#undef MSLEMU_VECTORS

namespace metal {
// ---- type traits (metal_type_traits) ----
using std::bool_constant;
using std::conditional;
using std::conditional_t;
using std::decay_t;
using std::declval;
using std::enable_if;
using std::enable_if_t;
using std::false_type;
using std::integral_constant;
using std::is_convertible_v;
using std::is_integral;
using std::is_integral_v;
using std::is_pointer_v;
using std::is_same;
using std::is_same_v;
using std::is_signed;
using std::is_signed_v;
using std::is_unsigned;
using std::is_unsigned_v;
using std::make_signed_t;
using std::make_unsigned_t;
using std::remove_cv;
using std::remove_cv_t;
using std::remove_pointer_t;
using std::remove_reference;
using std::remove_reference_t;
using std::true_type;

template <class T> struct is_floating_point
    : bool_constant<std::is_floating_point_v<T> || std::is_same_v<T, half> || std::is_same_v<T, bfloat>> {};
template <class T> constexpr bool is_floating_point_v = is_floating_point<remove_cv_t<T>>::value;
template <class T> struct is_arithmetic : bool_constant<is_integral_v<T> || is_floating_point_v<T>> {};
template <class T> constexpr bool is_arithmetic_v = is_arithmetic<T>::value;
template <class T> struct is_vector : bool_constant<(mslemu::vector_info<remove_cv_t<T>>::n > 0)> {};
template <class T> constexpr bool is_vector_v = is_vector<T>::value;
template <class T> struct vec_elements : integral_constant<int, mslemu::vector_info<remove_cv_t<T>>::n> {};
template <class T> using vec_element_t = typename mslemu::vector_info<remove_cv_t<T>>::elem;

template <class T> struct remove_addrspace { using type = T; };
template <class T> struct remove_addrspace<__attribute__((address_space(1))) T> { using type = T; };
template <class T> struct remove_addrspace<__attribute__((address_space(2))) T> { using type = T; };
template <class T> struct remove_addrspace<__attribute__((address_space(3))) T> { using type = T; };
template <class T> using remove_addrspace_t = typename remove_addrspace<T>::type;

// ---- numeric_limits (metal_limits) ----
template <class T> struct numeric_limits : std::numeric_limits<T> {};
template <class T, uint16_t Max, uint16_t Lowest, uint16_t Min, uint16_t Eps, uint16_t Inf, uint16_t Nan>
struct limits16 {
  static constexpr bool is_specialized = true;
  static constexpr bool has_infinity = true;
  static constexpr bool has_quiet_NaN = true;
  static constexpr T max() { return __builtin_bit_cast(T, Max); }
  static constexpr T lowest() { return __builtin_bit_cast(T, Lowest); }
  static constexpr T min() { return __builtin_bit_cast(T, Min); }
  static constexpr T epsilon() { return __builtin_bit_cast(T, Eps); }
  static constexpr T infinity() { return __builtin_bit_cast(T, Inf); }
  static constexpr T quiet_NaN() { return __builtin_bit_cast(T, Nan); }
};
template <> struct numeric_limits<half> : limits16<half, 0x7BFF, 0xFBFF, 0x0400, 0x1400, 0x7C00, 0x7E00> {};
template <> struct numeric_limits<bfloat> : limits16<bfloat, 0x7F7F, 0xFF7F, 0x0080, 0x3C00, 0x7F80, 0x7FC0> {};

template <class T, size_t N> struct array {
  T elems[N];
  T& operator[](size_t i) { return elems[i]; }
  const T& operator[](size_t i) const { return elems[i]; }
  static constexpr size_t size() { return N; }
};

template <class To, class From> inline To as_type(const From& from) {
  static_assert(sizeof(To) == sizeof(From), "as_type: source and destination differ in size");
  return __builtin_bit_cast(To, from);
}

// ---- Metal-style vector construction: float4(x), float4(a, b, c, d), float4(f2, f2), float4(half4) ----
namespace detail {
template <class T, int N, class A> inline void append(vec<T, N>& r, int& i, const A& a) {
  if constexpr (mslemu::vector_info<A>::n > 0) {
    for (int k = 0; k < mslemu::vector_info<A>::n; ++k) r[i++] = (T)a[k];
  } else if constexpr (std::is_class_v<A>) {  // packed_vec3, possibly in another address space
    r[i++] = (T)a.x, r[i++] = (T)a.y, r[i++] = (T)a.z;
  } else {
    r[i++] = (T)a;
  }
}
template <class A> constexpr int width() {
  if constexpr (mslemu::vector_info<A>::n > 0) return mslemu::vector_info<A>::n;
  else if constexpr (std::is_class_v<A>) return 3;
  else return 1;
}
}  // namespace detail

template <class V, class... A> inline V make_vector(const A&... a) {
  using T = typename mslemu::vector_info<V>::elem;
  constexpr int N = mslemu::vector_info<V>::n;
  if constexpr (sizeof...(A) == 0) {
    return V(T(0));
  } else if constexpr (sizeof...(A) == 1 && ((detail::width<A>() == 1) && ...)) {
    return V((T)(a, ...));  // splat
  } else if constexpr (sizeof...(A) == 1 && ((mslemu::vector_info<A>::n == N) && ...)) {
    return __builtin_convertvector((a, ...), V);
  } else {
    static_assert((detail::width<A>() + ...) == N, "vector constructor: component count does not match");
    V r;
    int i = 0;
    (detail::append<T, N>(r, i, a), ...);
    return r;
  }
}
}  // namespace metal

// ext_vector types have no constructors, so `float4(...)` is spelled as a function-like macro; a bare
// `float4` (declarations, template arguments, casts) is untouched.
#define float2(...) metal::make_vector<::float2>(__VA_ARGS__)
#define float3(...) metal::make_vector<::float3>(__VA_ARGS__)
#define float4(...) metal::make_vector<::float4>(__VA_ARGS__)
#define half2(...) metal::make_vector<::half2>(__VA_ARGS__)
#define half3(...) metal::make_vector<::half3>(__VA_ARGS__)
#define half4(...) metal::make_vector<::half4>(__VA_ARGS__)
#define bfloat2(...) metal::make_vector<::bfloat2>(__VA_ARGS__)
#define bfloat3(...) metal::make_vector<::bfloat3>(__VA_ARGS__)
#define bfloat4(...) metal::make_vector<::bfloat4>(__VA_ARGS__)
#define char2(...) metal::make_vector<::char2>(__VA_ARGS__)
#define char3(...) metal::make_vector<::char3>(__VA_ARGS__)
#define char4(...) metal::make_vector<::char4>(__VA_ARGS__)
#define uchar2(...) metal::make_vector<::uchar2>(__VA_ARGS__)
#define uchar3(...) metal::make_vector<::uchar3>(__VA_ARGS__)
#define uchar4(...) metal::make_vector<::uchar4>(__VA_ARGS__)
#define short2(...) metal::make_vector<::short2>(__VA_ARGS__)
#define short3(...) metal::make_vector<::short3>(__VA_ARGS__)
#define short4(...) metal::make_vector<::short4>(__VA_ARGS__)
#define ushort2(...) metal::make_vector<::ushort2>(__VA_ARGS__)
#define ushort3(...) metal::make_vector<::ushort3>(__VA_ARGS__)
#define ushort4(...) metal::make_vector<::ushort4>(__VA_ARGS__)
#define int2(...) metal::make_vector<::int2>(__VA_ARGS__)
#define int3(...) metal::make_vector<::int3>(__VA_ARGS__)
#define int4(...) metal::make_vector<::int4>(__VA_ARGS__)
#define uint2(...) metal::make_vector<::uint2>(__VA_ARGS__)
#define uint3(...) metal::make_vector<::uint3>(__VA_ARGS__)
#define uint4(...) metal::make_vector<::uint4>(__VA_ARGS__)
#define long2(...) metal::make_vector<::long2>(__VA_ARGS__)
#define long3(...) metal::make_vector<::long3>(__VA_ARGS__)
#define long4(...) metal::make_vector<::long4>(__VA_ARGS__)
#define ulong2(...) metal::make_vector<::ulong2>(__VA_ARGS__)
#define ulong3(...) metal::make_vector<::ulong3>(__VA_ARGS__)
#define ulong4(...) metal::make_vector<::ulong4>(__VA_ARGS__)
