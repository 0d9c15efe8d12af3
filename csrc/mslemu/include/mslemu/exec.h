// mslemu execution interface: what a lowered kernel translation unit shares with runtime.cpp.
//
// Included by msl.h before any MSL keyword macro (device, constant, threadgroup, thread) exists, so it is
// ordinary C++. Everything here is internal to a kernel library built by lower.py; the outside world sees
// only the C ABI in mslemu.h.
//
// Execution model: one OS worker runs one threadgroup at a time. The threadgroup's threads are fibers that
// leave the CPU only at threadgroup_barrier and simd_* collectives (`block`), so between two sync points a
// thread runs alone and every schedule is deterministic.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <tuple>
#include <type_traits>
#include <utility>

namespace mslemu {

constexpr int kSimdWidth = 32;
constexpr uint32_t kMaxThreadsPerThreadgroup = 1024;
constexpr uint32_t kMaxThreadgroupMemory = 32768;  // static + dynamic, as on Apple GPUs
constexpr int kMaxBufferSlots = 31;                // Metal's buffer argument table
constexpr int kMaxThreadgroupSlots = 31;
constexpr uint32_t kMaxFunctionConstants = 1024;   // indices accepted by [[function_constant(i)]]
constexpr size_t kLaneSlotBytes = 64;              // largest value one lane passes through a collective

// Source position of a sync point. Collectives and barriers take it as a defaulted argument, which clang
// evaluates at the call site; return addresses would not do, because the optimizer duplicates calls.
struct Site {
  const char* file;
  unsigned line, column;
};
#define MSLEMU_HERE ::mslemu::Site{__builtin_FILE(), __builtin_LINE(), __builtin_COLUMN()}
inline bool same_site(const Site& a, const Site& b) {
  return a.line == b.line && a.column == b.column && (a.file == b.file || std::strcmp(a.file, b.file) == 0);
}

enum class Wait : uint8_t { running, simd, barrier, done };

struct SimdGroup {
  int nlanes;        // lanes that exist (the last simdgroup of a threadgroup may be partial)
  int active;        // lanes that have not returned
  int arrived;       // lanes waiting in the current collective
  uint32_t present;  // mask of those lanes
  uint64_t gen;      // completed collectives; a waiting lane resumes once it moves
  const char* op[kSimdWidth];
  Site site[kSimdWidth];
  uint32_t param[kSimdWidth];
  alignas(64) unsigned char slot[kSimdWidth][kLaneSlotBytes];
};

struct Launch;

struct Group {
  const Launch* launch;
  uint32_t position[3];  // threadgroup_position_in_grid
  uint32_t size[3];      // threads_per_threadgroup (smaller at the edge of a dispatchThreads grid)
  int nthreads, active, arrived, nsimd;
  uint64_t gen;          // completed barriers
  Site barrier_site;
  unsigned char* dynamic_memory[kMaxThreadgroupSlots];  // [[threadgroup(i)]] parameters
};

struct Thread {
  uint32_t position_in_grid[3], position_in_threadgroup[3];
  uint32_t index_in_threadgroup, lane, simdgroup;
  Group* group;
  SimdGroup* sg;
  Wait wait;
  uint64_t wait_gen;
  void* context;  // suspended fiber
};

// Which value a kernel parameter receives, from its MSL attribute.
enum class Bind : uint8_t {
  buffer, threadgroup_memory,
  thread_position_in_grid, thread_position_in_threadgroup, threadgroup_position_in_grid,
  threads_per_threadgroup, threadgroups_per_grid, threads_per_grid, dispatch_threads_per_threadgroup,
  thread_index_in_threadgroup, thread_index_in_simdgroup, simdgroup_index_in_threadgroup,
  threads_per_simdgroup, simdgroups_per_threadgroup, thread_index_in_quadgroup, quadgroup_index_in_threadgroup,
};

// What the runtime validates before a dispatch: slot `index` must be bound, with at least `size` bytes for a
// reference parameter (a `constant Args&`); size 0 for pointers, whose extent the kernel alone knows.
struct SlotUse {
  Bind kind;
  int index;
  uint32_t size;
};

struct KernelInfo {
  const char* name;  // host name
  void (*invoke)(Thread*);
  const SlotUse* uses;
  int nuses;
  uint32_t max_threads;  // [[max_total_threads_per_threadgroup(n)]], else the hardware limit
  const char* file;
  int line;
};

struct Launch {
  const KernelInfo* kernel;
  uint32_t threadgroups[3];  // threadgroups_per_grid
  uint32_t threads[3];       // nominal threads_per_threadgroup
  uint32_t grid[3];          // threads_per_grid
  void* buffers[kMaxBufferSlots];
  uint64_t sizes[kMaxBufferSlots];
  uint32_t dynamic_lengths[kMaxThreadgroupSlots];
};

// One `threadgroup T x[N];` declaration; lower.py gives each a mutable static (so no two share an address).
struct TgDecl {
  uint32_t size, align;
  const char* name;
};

// ---- provided by runtime.cpp ----
extern __thread Thread* t_self;                                       // the fiber running on this worker
[[noreturn]] void fail(const char* fmt, ...) __attribute__((format(printf, 1, 2)));  // ends the dispatch
void block(Thread* t);                                                // back to the scheduler
void* threadgroup_static(TgDecl* decl);                               // this threadgroup's copy, poisoned
uint64_t function_constant_bits(uint32_t index, const char* name);    // fails if not set
bool function_constant_defined(uint32_t index);
void register_kernel(const KernelInfo* k);

// ---------------------------------------------------------------------------------------------------------
// Parameter binding. lower.py emits, per host kernel, Entry<&f, P<kind, index>...>; the parameter types come
// from the function type, so every instantiation of a templated kernel binds correctly.
// ---------------------------------------------------------------------------------------------------------
template <class F> struct fn_traits;
template <class R, class... A> struct fn_traits<R (*)(A...)> {
  using args = std::tuple<A...>;
};

template <class T> struct vector_info {
  static constexpr int n = 0;
  using elem = T;
};
template <class T, int N> struct vector_info<T __attribute__((ext_vector_type(N)))> {
  static constexpr int n = N;
  using elem = T;
};

template <Bind K, int I> struct P {
  template <class T> static constexpr SlotUse use() {
    if constexpr (std::is_reference_v<T>) return {K, I, (uint32_t)sizeof(std::remove_reference_t<T>)};
    else return {K, I, 0};
  }
  template <class T> static T bind(Thread* t);
};

template <Bind K, int I> template <class T> inline T P<K, I>::bind(Thread* t) {
  const Launch& L = *t->group->launch;
  if constexpr (K == Bind::buffer) {
    static_assert(std::is_pointer_v<T> || std::is_reference_v<T>, "[[buffer(n)]] parameter must be a pointer or reference");
    static_assert(I >= 0 && I < kMaxBufferSlots, "[[buffer(n)]] index out of range (0..30)");
    if constexpr (std::is_pointer_v<T>) return (T)L.buffers[I];
    else return *(std::remove_reference_t<T>*)L.buffers[I];
  } else if constexpr (K == Bind::threadgroup_memory) {
    static_assert(std::is_pointer_v<T>, "[[threadgroup(n)]] parameter must be a pointer");
    static_assert(I >= 0 && I < kMaxThreadgroupSlots, "[[threadgroup(n)]] index out of range (0..30)");
    return (T)t->group->dynamic_memory[I];
  } else {
    using V = std::remove_cv_t<T>;
    using E = typename vector_info<V>::elem;
    constexpr int n = vector_info<V>::n;
    static_assert(std::is_same_v<E, unsigned int> || std::is_same_v<E, unsigned short>,
                  "position and index attributes take uint or ushort (or their vectors)");
    const Group& g = *t->group;
    const uint32_t* v3 = nullptr;
    uint32_t v1 = 0;
    if constexpr (K == Bind::thread_position_in_grid) v3 = t->position_in_grid;
    else if constexpr (K == Bind::thread_position_in_threadgroup) v3 = t->position_in_threadgroup;
    else if constexpr (K == Bind::threadgroup_position_in_grid) v3 = g.position;
    else if constexpr (K == Bind::threads_per_threadgroup) v3 = g.size;
    else if constexpr (K == Bind::threadgroups_per_grid) v3 = L.threadgroups;
    else if constexpr (K == Bind::threads_per_grid) v3 = L.grid;
    else if constexpr (K == Bind::dispatch_threads_per_threadgroup) v3 = L.threads;
    else if constexpr (K == Bind::thread_index_in_threadgroup) v1 = t->index_in_threadgroup;
    else if constexpr (K == Bind::thread_index_in_simdgroup) v1 = t->lane;
    else if constexpr (K == Bind::simdgroup_index_in_threadgroup) v1 = t->simdgroup;
    else if constexpr (K == Bind::threads_per_simdgroup) v1 = kSimdWidth;
    else if constexpr (K == Bind::simdgroups_per_threadgroup) v1 = (uint32_t)g.nsimd;
    else if constexpr (K == Bind::thread_index_in_quadgroup) v1 = t->lane & 3;
    else if constexpr (K == Bind::quadgroup_index_in_threadgroup) v1 = t->index_in_threadgroup / 4;
    if constexpr (n == 0) {
      return (V)(v3 ? v3[0] : v1);
    } else {
      static_assert(n <= 3, "position attributes have at most 3 components");
      V r;
      for (int i = 0; i < n; ++i) r[i] = (E)(v3 ? v3[i] : (i == 0 ? v1 : 0));
      return r;
    }
  }
}

template <auto K, class... Ps> struct Entry {
  using Args = typename fn_traits<decltype(K)>::args;
  static_assert(sizeof...(Ps) == std::tuple_size_v<Args>, "lowering saw a different parameter count");
  template <size_t... I> static void call(Thread* t, std::index_sequence<I...>) {
    K(Ps::template bind<std::tuple_element_t<I, Args>>(t)...);
  }
  static void invoke(Thread* t) { call(t, std::index_sequence_for<Ps...>{}); }
  template <size_t... I> static constexpr std::array<SlotUse, sizeof...(Ps)> collect(std::index_sequence<I...>) {
    return {{Ps::template use<std::tuple_element_t<I, Args>>()...}};
  }
  static constexpr std::array<SlotUse, sizeof...(Ps)> uses = collect(std::index_sequence_for<Ps...>{});
};

// MSL gives a pointer parameter without [[buffer(n)]] the lowest index no other parameter claims.
constexpr int auto_buffer_index(int ordinal, std::initializer_list<int> claimed) {
  for (int slot = 0;; ++slot) {
    bool taken = false;
    for (int c : claimed) taken = taken || c == slot;
    if (!taken && ordinal-- == 0) return slot;
  }
}
constexpr bool all_distinct(std::initializer_list<int> v) {
  for (const int* a = v.begin(); a != v.end(); ++a)
    for (const int* b = a + 1; b != v.end(); ++b)
      if (*a == *b) return false;
  return true;
}

struct Registrar {
  explicit Registrar(const KernelInfo* k) { register_kernel(k); }
};

// `constant T name [[function_constant(i)]];` becomes FunctionConstant<T, i>: its value is read from the
// dispatch each time, as a pipeline specialises it in Metal.
template <class T, uint32_t I> struct FunctionConstant {
  static_assert(I < kMaxFunctionConstants, "function constant index too large for mslemu");
  static_assert(sizeof(T) <= 8, "function constants are scalars");
  const char* name;
  operator T() const {
    uint64_t bits = function_constant_bits(I, name);
    T v;
    std::memcpy(&v, &bits, sizeof(T));
    return v;
  }
};
// A program-scope constant whose initializer reads a function constant: evaluated on every use.
template <class T> struct DerivedConstant {
  T (*eval)();
  operator T() const { return eval(); }
};

}  // namespace mslemu

namespace mslemu {
// ---- synchronisation, implemented in runtime.cpp ----
void barrier(const Site& site);
// This lane's input is in sg->slot[lane]. Returns once every lane that has not returned reached the same call;
// `combine` (run by the last lane to arrive) leaves each lane's result in its slot.
using Combine = void (*)(SimdGroup*);
void simd_collective(const char* op, const Site& site, uint32_t param, Combine combine);
}  // namespace mslemu
