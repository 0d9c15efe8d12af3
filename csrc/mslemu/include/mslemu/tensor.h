// Metal 4 tensors and the MetalPerformancePrimitives matmul2d subset (<metal_tensor>,
// <MetalPerformancePrimitives/MetalPerformancePrimitives.h>), as documented in Apple's MPPTensorOpsMatMul2d.h
// and used by MLX (steel/gemm/nax) and llama.cpp (kernel_mul_mm with GGML_METAL_HAS_TENSOR).
//
// Included by msl.h when lower.py sees a kernel file include either header (it then defines MSLEMU_TENSOR
// and compiles the unit as C++20: matmul2d takes its descriptor as a class-type template argument, which
// the Metal compiler accepts and clang's C++17 does not).
//
// What is emulated:
//   - extents<I, E...> / dextents<I, R>, dynamic_extent, dynamic_length_v;
//   - tensor<T, Extents, tensor_inline> over a device / threadgroup / thread pointer with packed or explicit
//     strides (stride 1 along dimension 0), .extents(), .get_extent(d), .slice(origin...) and
//     .slice<E...>(origin...) (tensor_offset views). Index order is Metal's: dimension 0 is the contiguous
//     one, so a row-major M x K matrix has extents (K, M). A view's bounds are its parent's extents minus
//     the origin (static slice extents clip to them): reads outside are 0, writes outside are dropped, which
//     is the documented edge handling of matmul2d.
//   - mpp::tensor_ops::matmul2d_descriptor(m, n, k, transpose_left, transpose_right, relaxed_precision, mode)
//     and matmul2d<desc, execution_thread | execution_simdgroup | execution_simdgroups<N>>::run(left, right,
//     destination) with left and right tensors and a tensor or cooperative_tensor destination;
//     get_destination_cooperative_tensor<L, R, T>() with get_capacity, operator[], is_valid_element /
//     get_mask, get_multidimensional_index, load and store.
//   - Numerics: every product of the (bf16 / half / float) inputs is exact in fp32 and accumulated by fma in k
//     order starting from the destination (multiply_accumulate) or 0 (multiply), rounded once to the
//     destination type. relaxed_precision is accepted and ignored.
//
// What cannot be vouched for (README.md): the cooperative_tensor layout is implementation defined, so this
// one is deliberately scrambled (element i of scope thread p is tile element ((i * P + p) * mul) mod (m * n)
// for a multiplier coprime with m * n, with invalid tail elements) and a kernel that assumes any layout
// instead of asking get_multidimensional_index gives wrong results here; GPU accumulation order and
// precision; performance. Not emulated: tensor_handle kernel parameters (MTLTensor bindings), cooperative
// tensors as left / right inputs (get_left/right_input_cooperative_tensor), reductions, convolution2d.
#pragma once
#if __cplusplus < 202002L
#error "mslemu: Metal 4 tensor kernels are compiled as C++20 (lower.py does this when it sees <metal_tensor>)"
#endif
#include "mslemu/simd.h"

namespace metal {

inline constexpr size_t dynamic_extent = size_t(-1);
template <class T> inline constexpr T dynamic_length_v = T(-1);

template <class I, size_t... E> struct extents {
  static_assert(std::is_integral_v<I>, "extents index type must be integral");
  using index_type = I;
  static constexpr size_t rank_ = sizeof...(E);
  static constexpr size_t static_[sizeof...(E)] = {E...};
  static constexpr size_t rank_dynamic_ = ((E == dynamic_extent ? 1 : 0) + ... + 0);
  I e[sizeof...(E)];

  constexpr extents() : e{(E == dynamic_extent ? I(0) : I(E))...} {}
  // Either every extent, or (as std::extents) only the dynamic ones.
  template <class... A, class = enable_if_t<sizeof...(A) != 0 && (std::is_integral_v<A> && ...) &&
                                                (sizeof...(A) == rank_ || sizeof...(A) == rank_dynamic_)>>
  constexpr extents(A... a) : e{} {
    const I v[] = {I(a)...};
    if constexpr (sizeof...(A) == rank_) {
      for (size_t d = 0; d < rank_; ++d) e[d] = v[d];
    } else {
      size_t j = 0;
      for (size_t d = 0; d < rank_; ++d) e[d] = static_[d] == dynamic_extent ? v[j++] : I(static_[d]);
    }
  }
  static constexpr size_t rank() { return rank_; }
  static constexpr size_t rank_dynamic() { return rank_dynamic_; }
  static constexpr size_t static_extent(size_t d) { return static_[d]; }
  constexpr I extent(size_t d) const { return e[d]; }
};

namespace detail {
template <class I, class Seq> struct dextents_of;
template <class I, size_t... S> struct dextents_of<I, std::index_sequence<S...>> {
  using type = extents<I, ((void)S, dynamic_extent)...>;
};
}  // namespace detail
template <class I, size_t R> using dextents = typename detail::dextents_of<I, std::make_index_sequence<R>>::type;

// Layout tags. tensor_handle (an MTLTensor bound to the kernel) is not emulated.
struct tensor_handle {};
struct tensor_offset {};
struct tensor_inline {};

template <class T> using __remove_addrspace_t = remove_addrspace_t<T>;

template <class ElementType, class Extents, class Layout = tensor_handle> struct tensor {
  static_assert(!std::is_same_v<Layout, tensor_handle>,
                "mslemu: tensor_handle (an MTLTensor kernel argument) is not emulated; build a tensor_inline view "
                "over a buffer pointer");
  using element_type = ElementType;
  using value_type = remove_cv_t<remove_addrspace_t<ElementType>>;
  using extents_type = Extents;
  using index_type = typename Extents::index_type;
  using layout = Layout;
  static constexpr size_t R = Extents::rank();

  ElementType* data_ = nullptr;
  Extents ext_;
  array<index_type, R> strides_;
  index_type bounds_[R];  // valid index range per dimension (edge handling)

  tensor() = default;
  tensor(ElementType* p, const Extents& e) : data_(p), ext_(e) {
    index_type s = 1;
    for (size_t d = 0; d < R; ++d) strides_[d] = s, s *= e.extent(d), bounds_[d] = e.extent(d);
  }
  tensor(ElementType* p, const Extents& e, const array<index_type, R>& strides) : data_(p), ext_(e), strides_(strides) {
    if (strides[0] != 1) mslemu::fail("tensor: the stride of dimension 0 must be 1 (got %lld)", (long long)strides[0]);
    for (size_t d = 0; d < R; ++d) bounds_[d] = e.extent(d);
  }

  Extents extents() const { return ext_; }
  index_type get_extent(size_t d) const { return ext_.extent(d); }
  index_type get_stride(size_t d) const { return strides_[d]; }
  ElementType* data() const { return data_; }

  // A view whose element (i0, i1, ...) is this tensor's (o0 + i0, o1 + i1, ...).
  template <class... O, class = enable_if_t<sizeof...(O) == R && (std::is_integral_v<O> && ...)>>
  tensor<ElementType, dextents<index_type, R>, tensor_offset> slice(O... origin) const {
    return sliced<dextents<index_type, R>>(origin...);
  }
  template <size_t... E, class... O,
            class = enable_if_t<sizeof...(E) == R && sizeof...(O) == R && (std::is_integral_v<O> && ...)>>
  tensor<ElementType, metal::extents<index_type, E...>, tensor_offset> slice(O... origin) const {
    return sliced<metal::extents<index_type, E...>>(origin...);
  }

  // ---- emulator access (not MSL API): edge-checked element load / store at (i0, i1, ...) ----
  bool in_bounds(const index_type* i) const {
    for (size_t d = 0; d < R; ++d)
      if (i[d] < 0 || i[d] >= bounds_[d]) return false;
    return true;
  }
  long offset_of(const index_type* i) const {
    long o = 0;
    for (size_t d = 0; d < R; ++d) o += long(i[d]) * long(strides_[d]);
    return o;
  }
  float load_f(const index_type* i) const { return in_bounds(i) ? float(data_[offset_of(i)]) : 0.0f; }
  template <class V> void store_v(const index_type* i, V v) const {
    static_assert(!std::is_const_v<remove_addrspace_t<ElementType>>, "tensor: store into a const tensor");
    if (in_bounds(i)) data_[offset_of(i)] = value_type(v);
  }

 private:
  template <class E2, class... O> tensor<ElementType, E2, tensor_offset> sliced(O... origin) const {
    const index_type o[] = {index_type(origin)...};
    tensor<ElementType, E2, tensor_offset> r;
    r.data_ = data_ + offset_of(o);
    r.strides_ = strides_;
    index_type full[R];
    for (size_t d = 0; d < R; ++d) {
      const index_type rem = bounds_[d] - o[d] > 0 ? bounds_[d] - o[d] : 0;
      full[d] = E2::static_extent(d) == dynamic_extent ? rem : index_type(E2::static_extent(d));
      r.bounds_[d] = full[d] < rem ? full[d] : rem;
    }
    r.ext_ = [&]<size_t... D>(std::index_sequence<D...>) { return E2(full[D]...); }(std::make_index_sequence<R>{});
    return r;
  }
  template <class, class, class> friend struct tensor;
};

// Execution scopes of tensor operations.
struct execution_thread {
  static constexpr int threads = 1;
};
struct execution_simdgroup {
  static constexpr int threads = mslemu::kSimdWidth;
};
template <int N> struct execution_simdgroups {
  static_assert(N > 0, "execution_simdgroups<N>: N must be positive");
  static constexpr int threads = N * mslemu::kSimdWidth;
  static constexpr int simdgroups = N;
};

namespace detail {
template <class S> struct is_scope : false_type {};
template <> struct is_scope<execution_thread> : true_type {};
template <> struct is_scope<execution_simdgroup> : true_type {};
template <int N> struct is_scope<execution_simdgroups<N>> : true_type {};
template <class S> struct scope_groups { static constexpr int value = 0; };
template <int N> struct scope_groups<execution_simdgroups<N>> { static constexpr int value = N; };

// This thread's index in the scope, checking the threadgroup matches the scope (the header calls a mismatch
// undefined behaviour).
template <class Scope> inline int scope_index(const char* what) {
  mslemu::Thread* t = mslemu::t_self;
  if constexpr (std::is_same_v<Scope, execution_thread>) {
    return 0;
  } else if constexpr (std::is_same_v<Scope, execution_simdgroup>) {
    return int(t->lane);
  } else {
    if (t->group->nsimd != scope_groups<Scope>::value || t->group->nthreads != Scope::threads)
      mslemu::fail("%s: the op's scope is execution_simdgroups<%d> (%d threads) but the threadgroup has %d "
                   "threads in %d simdgroups", what, scope_groups<Scope>::value, Scope::threads, t->group->nthreads,
                   t->group->nsimd);
    return int(t->index_in_threadgroup);
  }
}

constexpr int gcd_(int a, int b) { return b ? gcd_(b, a % b) : a; }
// The smallest multiplier > m * n / 3 that is coprime with m * n: scrambles the tile (see the top).
constexpr int scramble(int count) {
  if (count <= 2) return 1;
  for (int c = count / 3 + 1;; ++c)
    if (gcd_(c, count) == 1) return c;
}
}  // namespace detail

// The emulator's layout of an M x N cooperative destination over a scope of P threads.
template <int M, int N, class Scope> struct cooperative_matmul_layout {
  static constexpr int count = M * N;
  static constexpr int P = Scope::threads;
  static constexpr int capacity = (count + P - 1) / P;
  static constexpr int mul = detail::scramble(count);
  using scope = Scope;
  // Tile element (row-major m * N + n) of element i of scope thread p, or -1.
  static int element(int p, int i) {
    const long lin = long(i) * P + p;
    return lin < count ? int(lin * mul % count) : -1;
  }
};

template <class ElementType, class Extents, class Layout> struct cooperative_tensor {
  static_assert(std::is_same_v<ElementType, remove_cv_t<remove_addrspace_t<ElementType>>>,
                "cooperative_tensor elements are thread-private values");
  using element_type = ElementType;
  using value_type = ElementType;
  using extents_type = Extents;
  using index_type = typename Extents::index_type;
  static constexpr int M = int(Extents::static_extent(1)), N = int(Extents::static_extent(0));

  ElementType v[Layout::capacity];
  int p = detail::scope_index<typename Layout::scope>("cooperative_tensor");

  static constexpr uint16_t get_capacity() { return uint16_t(Layout::capacity); }
  ElementType& operator[](uint16_t i) { return v[check(i)]; }
  const ElementType& operator[](uint16_t i) const { return v[check(i)]; }
  bool is_valid_element(uint16_t i) const { return Layout::element(p, check(i)) >= 0; }
  bool get_mask(uint16_t i) const { return is_valid_element(i); }
  // (column n, row m) of element i in the tile (dimension 0 first, as tensor indices).
  array<index_type, 2> get_multidimensional_index(uint16_t i) const {
    const int e = Layout::element(p, check(i));
    if (e < 0) mslemu::fail("cooperative_tensor: get_multidimensional_index(%d) of an invalid element", int(i));
    return array<index_type, 2>{{index_type(e % N), index_type(e / N)}};
  }
  // This thread's elements to / from the tile at the tensor's origin (edge-checked).
  template <class T, class E, class L> void store(const tensor<T, E, L>& t) const {
    for (int i = 0; i < Layout::capacity; ++i) {
      const int e = Layout::element(p, i);
      if (e < 0) continue;
      const typename tensor<T, E, L>::index_type at[2] = {e % N, e / N};
      t.store_v(at, v[i]);
    }
  }
  template <class T, class E, class L> void load(const tensor<T, E, L>& t) {
    for (int i = 0; i < Layout::capacity; ++i) {
      const int e = Layout::element(p, i);
      if (e < 0) continue;
      const typename tensor<T, E, L>::index_type at[2] = {e % N, e / N};
      v[i] = ElementType(t.load_f(at));
    }
  }

 private:
  static int check(int i) {
    if (i < 0 || i >= Layout::capacity)
      mslemu::fail("cooperative_tensor: element %d outside its capacity %d", i, Layout::capacity);
    return i;
  }
};

}  // namespace metal

namespace mpp {
namespace tensor_ops {

struct matmul2d_descriptor {
  enum class mode { multiply, multiply_accumulate };
  int m, n, k;
  bool transpose_left, transpose_right;
  bool relaxed_precision;
  mode matmul_mode;
  constexpr matmul2d_descriptor(int m_, int n_, int k_ = static_cast<int>(metal::dynamic_extent),
                                bool transpose_left_ = false, bool transpose_right_ = false,
                                bool relaxed_precision_ = false, mode matmul_mode_ = mode::multiply)
      : m(m_), n(n_), k(k_), transpose_left(transpose_left_), transpose_right(transpose_right_),
        relaxed_precision(relaxed_precision_), matmul_mode(matmul_mode_) {}
};

namespace detail {
template <class T> struct is_tensor : std::false_type {};
template <class T, class E, class L> struct is_tensor<metal::tensor<T, E, L>> : std::true_type {};
template <class T> struct is_coop : std::false_type {};
template <class T, class E, class L> struct is_coop<metal::cooperative_tensor<T, E, L>> : std::true_type {};
template <class T> using bare = metal::remove_cv_t<metal::remove_addrspace_t<T>>;
template <class T> constexpr bool is_input_type =
    std::is_same_v<T, float> || std::is_same_v<T, half> || std::is_same_v<T, bfloat>;
inline void nothing(const uint32_t*, uint32_t*, uint32_t, const uint32_t*) {}
}  // namespace detail

template <matmul2d_descriptor Descriptor, class Scope, class... Args> class matmul2d {
  static_assert(metal::detail::is_scope<Scope>::value, "Scope template argument should be of op_scope type");
  static_assert(Descriptor.m > 0 && Descriptor.n > 0, "matmul2d_descriptor: m and n must be static and positive");
  static_assert(Descriptor.k > 0 || Descriptor.k == static_cast<int>(metal::dynamic_extent),
                "matmul2d_descriptor: k must be positive or dynamic_extent");

 public:
  static constexpr matmul2d_descriptor descriptor = Descriptor;
  using scope = Scope;
  using layout = metal::cooperative_matmul_layout<Descriptor.m, Descriptor.n, Scope>;

  matmul2d() = default;

  template <class L, class R, class T, class CoordType = int>
  using cooperative_tensor_destination_t =
      metal::cooperative_tensor<T, metal::extents<CoordType, size_t(Descriptor.n), size_t(Descriptor.m)>, layout>;

  template <class L, class R, class T, class CoordType = int>
  cooperative_tensor_destination_t<L, R, T, CoordType> get_destination_cooperative_tensor() const {
    static_assert(detail::is_tensor<detail::bare<L>>::value && detail::is_tensor<detail::bare<R>>::value,
                  "mslemu emulates matmul2d with tensor (not cooperative_tensor) left and right operands");
    static_assert(std::is_same_v<T, float> || std::is_same_v<T, half> || std::is_same_v<T, bfloat>,
                  "matmul2d destination element type: float, half or bfloat");
    cooperative_tensor_destination_t<L, R, T, CoordType> c;
    for (auto& x : c.v) x = mslemu::poison<T>();  // uninitialised until the kernel writes it
    return c;
  }

  // destination (op)= left x right for the descriptor's m x n tile. All threads of the scope must call it
  // (checked per simdgroup: it is a simdgroup-uniform call, as on the GPU); it is not a barrier.
  template <class L, class R, class D>
  void run(L& left, R& right, D& destination, mslemu::Site site = MSLEMU_HERE) const {
    static_assert(detail::is_tensor<L>::value && detail::is_tensor<R>::value,
                  "mslemu emulates matmul2d with tensor (not cooperative_tensor) left and right operands");
    static_assert(detail::is_tensor<D>::value || detail::is_coop<D>::value,
                  "matmul2d destination: a tensor or a cooperative_tensor");
    static_assert(L::R == 2 && R::R == 2, "matmul2d operands are rank-2 tensors");
    using A = typename L::value_type;
    using B = typename R::value_type;
    static_assert(detail::is_input_type<A> && detail::is_input_type<B>,
                  "mslemu emulates matmul2d inputs of float, half and bfloat");
    const int p = metal::detail::scope_index<Scope>("matmul2d::run");
    if constexpr (!std::is_same_v<Scope, metal::execution_thread>)
      (void)mslemu::collective<uint32_t, detail::nothing>("matmul2d::run", 0, 0, site);

    constexpr int M = Descriptor.m, N = Descriptor.n;
    // K: the descriptor's, else the operands' (which must agree).
    const int kl = int(Descriptor.transpose_left ? left.bounds_[1] : left.bounds_[0]);
    const int kr = int(Descriptor.transpose_right ? right.bounds_[0] : right.bounds_[1]);
    int K = Descriptor.k;
    if (K == static_cast<int>(metal::dynamic_extent)) {
      if (kl != kr) mslemu::fail("matmul2d::run: dynamic k but the left operand has k = %d and the right %d", kl, kr);
      K = kl;
    }
    using I = typename L::index_type;
    using J = typename R::index_type;
    auto a = [&](int m, int k) {
      const I at[2] = {I(Descriptor.transpose_left ? m : k), I(Descriptor.transpose_left ? k : m)};
      return left.load_f(at);
    };
    auto b = [&](int k, int n) {
      const J at[2] = {J(Descriptor.transpose_right ? k : n), J(Descriptor.transpose_right ? n : k)};
      return right.load_f(at);
    };
    auto dot = [&](int m, int n, float acc) {
      for (int k = 0; k < K; ++k) acc = __builtin_fmaf(a(m, k), b(k, n), acc);
      return acc;
    };
    constexpr bool accumulate = Descriptor.matmul_mode == matmul2d_descriptor::mode::multiply_accumulate;
    for (int i = 0; i < layout::capacity; ++i) {
      const int e = layout::element(p, i);
      if (e < 0) continue;
      const int m = e / N, n = e % N;
      if constexpr (detail::is_coop<D>::value) {
        static_assert(D::M == M && D::N == N, "matmul2d::run: the cooperative destination is of another op");
        destination.v[i] = typename D::value_type(dot(m, n, accumulate ? float(destination.v[i]) : 0.0f));
      } else {
        using DI = typename D::index_type;
        const DI at[2] = {DI(n), DI(m)};
        if (!destination.in_bounds(at)) continue;
        destination.store_v(at, dot(m, n, accumulate ? destination.load_f(at) : 0.0f));
      }
    }
  }
};

}  // namespace tensor_ops
}  // namespace mpp
