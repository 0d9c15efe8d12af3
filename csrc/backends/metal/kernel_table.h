// KernelId: one enumerator per row of metal/kernels.def (the X-macro table of every kernel the backend
// dispatches), and each row's kernel function and integral template arguments. Host code selects kernels
// by id and never formats a name; the encoders' lookup tables assert with table_instantiates that entry
// [format][mode] is the instantiation <format, mode>, so a reordered table fails to compile.
#pragma once
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <iterator>
#include <string_view>

#include "lily_args.h"  // the LILY_W_* / LILY_OUT_* template arguments the rows name

namespace lily::metal {

enum class KernelId : uint16_t {
#define LILY_KERNEL(family, name, req, fn, ...) name,
#define LILY_KERNEL_FN(family, name, req) name,
#include "kernels.def"
#undef LILY_KERNEL
#undef LILY_KERNEL_FN
  count
};

struct TemplateArgs {
  int value[4];
  int count;
};
template <class... A>
constexpr TemplateArgs template_args(A... a) {
  static_assert(sizeof...(A) <= 4, "a kernels.def row has more than 4 template arguments");
  return {{int(a)...}, int(sizeof...(A))};
}

struct KernelRow {
  std::string_view family, name;
  bool tensor_ops;             // requires = tensor
  std::string_view function;   // the kernel template, or for LILY_KERNEL_FN the kernel itself (= name)
  TemplateArgs targs;          // empty for LILY_KERNEL_FN
};

inline constexpr KernelRow kKernelRows[] = {
#define LILY_KERNEL(family, name, req, fn, ...) \
  {#family, #name, std::string_view(#req) == "tensor", #fn, template_args(__VA_ARGS__)},
#define LILY_KERNEL_FN(family, name, req) {#family, #name, std::string_view(#req) == "tensor", #name, {{}, 0}},
#include "kernels.def"
#undef LILY_KERNEL
#undef LILY_KERNEL_FN
};
static_assert(std::size(kKernelRows) == size_t(KernelId::count));

const char* kernel_name(KernelId id);
const char* kernel_family(KernelId id);
// The row's `requires` is tensor: the kernel exists only in an MSL 4.0 build on a device with tensor ops.
bool kernel_needs_tensor_ops(KernelId id);

// id is the row function<targs...>.
constexpr bool kernel_instantiates(KernelId id, std::string_view function, std::initializer_list<int> targs) {
  const KernelRow& row = kKernelRows[size_t(id)];
  if (row.function != function || size_t(row.targs.count) != targs.size()) return false;
  int i = 0;
  for (int v : targs)
    if (row.targs.value[i++] != v) return false;
  return true;
}

// Every table[i] is function<a[i]>.
template <size_t N>
constexpr bool table_instantiates(const KernelId (&table)[N], std::string_view function, const int (&a)[N]) {
  for (size_t i = 0; i < N; ++i)
    if (!kernel_instantiates(table[i], function, {a[i]})) return false;
  return true;
}

// Every table[i][j] is function<a[i], b[j]>.
template <size_t N, size_t M>
constexpr bool table_instantiates(const KernelId (&table)[N][M], std::string_view function, const int (&a)[N],
                                  const int (&b)[M]) {
  for (size_t i = 0; i < N; ++i)
    for (size_t j = 0; j < M; ++j)
      if (!kernel_instantiates(table[i][j], function, {a[i], b[j]})) return false;
  return true;
}

// The weight formats in LilyWeightFormat order: the first axis of every per-format table.
inline constexpr int kWeightFormats[] = {LILY_W_Q4, LILY_W_Q8, LILY_W_BF16};
static_assert(LILY_W_Q4 == 0 && LILY_W_Q8 == 1 && LILY_W_BF16 == 2, "tables are indexed by LilyWeightFormat");

}  // namespace lily::metal
