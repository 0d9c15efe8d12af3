// MSL atomics (metal_atomic). Work on device and threadgroup objects alike. Device atomics are real CPU
// atomics because threadgroups run on several worker threads at once; threadgroup atomics could be plain
// loads and stores (one worker owns a threadgroup) but share the code.
#pragma once
#include "mslemu/types.h"

namespace metal {
enum memory_order {
  memory_order_relaxed = __ATOMIC_RELAXED,
  memory_order_acquire = __ATOMIC_ACQUIRE,
  memory_order_release = __ATOMIC_RELEASE,
  memory_order_acq_rel = __ATOMIC_ACQ_REL,
  memory_order_seq_cst = __ATOMIC_SEQ_CST,
};
enum thread_scope { thread_scope_thread, thread_scope_simdgroup, thread_scope_threadgroup, thread_scope_device };

template <class T> struct atomic {
  static_assert(std::is_same_v<T, int> || std::is_same_v<T, uint> || std::is_same_v<T, bool> ||
                    std::is_same_v<T, ulong> || std::is_same_v<T, long>,
                "MSL atomics hold int, uint, bool, ulong or float");
  T v;
};
// Floats are stored as their bits so that compare-exchange loops work on an integer.
template <> struct atomic<float> { uint v; };
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
typedef atomic<bool> atomic_bool;
typedef atomic<ulong> atomic_ulong;
typedef atomic<float> atomic_float;

namespace detail {
template <class A> constexpr bool holds_float = std::is_same_v<remove_cv_t<remove_addrspace_t<A>>, atomic<float>>;
template <class A> constexpr bool in_device_memory = false;
template <class A> constexpr bool in_device_memory<__attribute__((address_space(1))) A> = true;
// Apple's compiler has atomic_float in device memory only (lower.py RULES['float-atomic']).
template <class A> constexpr bool allowed = !holds_float<A> || in_device_memory<A>;
#define MSLEMU_CHECK_ATOMIC(A)                                                                                \
  static_assert(::metal::detail::allowed<A>, "a threadgroup or thread atomic_float [MSL rule 'float-atomic': " \
                "atomic_float exists in device memory only (§2.6 Atomic Data Types, §6.15 Atomic Functions)]")
template <class A> using atomic_value_t = conditional_t<holds_float<A>, float, decltype(remove_cv_t<remove_addrspace_t<A>>::v)>;
template <class A, class F> inline atomic_value_t<A> update(A* o, F f) {  // CAS loop; returns the old value
  auto old = __atomic_load_n(&o->v, __ATOMIC_RELAXED);
  for (;;) {
    if constexpr (holds_float<A>) {
      uint want = as_type<uint>((float)f(as_type<float>(old)));
      if (__atomic_compare_exchange_n(&o->v, &old, want, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) return as_type<float>(old);
    } else {
      auto want = f(old);
      if (__atomic_compare_exchange_n(&o->v, &old, want, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) return old;
    }
  }
}
}  // namespace detail

template <class A, class C> inline void atomic_store_explicit(A* o, C desired, memory_order) {
  MSLEMU_CHECK_ATOMIC(A);
  if constexpr (detail::holds_float<A>) __atomic_store_n(&o->v, as_type<uint>((float)desired), __ATOMIC_RELAXED);
  else __atomic_store_n(&o->v, desired, __ATOMIC_RELAXED);
}
template <class A> inline detail::atomic_value_t<A> atomic_load_explicit(A* o, memory_order) {
  MSLEMU_CHECK_ATOMIC(A);
  if constexpr (detail::holds_float<A>) return as_type<float>(__atomic_load_n(&o->v, __ATOMIC_RELAXED));
  else return __atomic_load_n(&o->v, __ATOMIC_RELAXED);
}
template <class A, class C> inline detail::atomic_value_t<A> atomic_exchange_explicit(A* o, C desired, memory_order) {
  MSLEMU_CHECK_ATOMIC(A);
  if constexpr (detail::holds_float<A>) return as_type<float>(__atomic_exchange_n(&o->v, as_type<uint>((float)desired), __ATOMIC_RELAXED));
  else return __atomic_exchange_n(&o->v, desired, __ATOMIC_RELAXED);
}
template <class A, class E, class C>
inline bool atomic_compare_exchange_weak_explicit(A* o, E* expected, C desired, memory_order, memory_order) {
  MSLEMU_CHECK_ATOMIC(A);
  if constexpr (detail::holds_float<A>) {
    uint want = as_type<uint>((float)*expected), got = want;
    if (__atomic_compare_exchange_n(&o->v, &got, as_type<uint>((float)desired), false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) return true;
    *expected = as_type<float>(got);
    return false;
  } else {
    return __atomic_compare_exchange_n(&o->v, expected, desired, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
  }
}
template <class A, class E, class C>
inline bool atomic_compare_exchange_strong_explicit(A* o, E* expected, C desired, memory_order s, memory_order f) {
  return atomic_compare_exchange_weak_explicit(o, expected, desired, s, f);
}

#define MSLEMU_ATOMIC_RMW(name, builtin, op)                                                        \
  template <class A, class C> inline detail::atomic_value_t<A> name(A* o, C operand, memory_order) { \
    MSLEMU_CHECK_ATOMIC(A);                                                                        \
    if constexpr (detail::holds_float<A>) {                                                        \
      const float x = (float)operand;                                                              \
      return detail::update(o, [x](float old) { return op; });                                     \
    } else {                                                                                       \
      return builtin(&o->v, operand, __ATOMIC_RELAXED);                                            \
    }                                                                                              \
  }
MSLEMU_ATOMIC_RMW(atomic_fetch_add_explicit, __atomic_fetch_add, old + x)
MSLEMU_ATOMIC_RMW(atomic_fetch_sub_explicit, __atomic_fetch_sub, old - x)
#undef MSLEMU_ATOMIC_RMW
template <class A, class C> inline detail::atomic_value_t<A> atomic_fetch_and_explicit(A* o, C x, memory_order) { return __atomic_fetch_and(&o->v, x, __ATOMIC_RELAXED); }
template <class A, class C> inline detail::atomic_value_t<A> atomic_fetch_or_explicit(A* o, C x, memory_order) { return __atomic_fetch_or(&o->v, x, __ATOMIC_RELAXED); }
template <class A, class C> inline detail::atomic_value_t<A> atomic_fetch_xor_explicit(A* o, C x, memory_order) { return __atomic_fetch_xor(&o->v, x, __ATOMIC_RELAXED); }
template <class A, class C> inline detail::atomic_value_t<A> atomic_fetch_max_explicit(A* o, C x, memory_order) {
  MSLEMU_CHECK_ATOMIC(A);
  using V = detail::atomic_value_t<A>;
  return detail::update(o, [x](V old) { return old < (V)x ? (V)x : old; });
}
template <class A, class C> inline detail::atomic_value_t<A> atomic_fetch_min_explicit(A* o, C x, memory_order) {
  MSLEMU_CHECK_ATOMIC(A);
  using V = detail::atomic_value_t<A>;
  return detail::update(o, [x](V old) { return (V)x < old ? (V)x : old; });
}
}  // namespace metal
