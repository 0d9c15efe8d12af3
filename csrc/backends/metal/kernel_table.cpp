// The name table behind KernelId (kernel_table.h): both expand metal/kernels.def, so a host name is
// written exactly once, in that table. Previous hop: the encoders pick a KernelId; next hop: the Device
// looks the name up in its library (device_metal.mm: newFunctionWithName; device_emu.cpp: mslemu_find_kernel).
#include "kernel_table.h"

#include <cstddef>

namespace lily::metal {

namespace {
struct Row {
  const char* family;
  const char* name;
  bool tensor_ops;
};
constexpr bool requires_tensor(const char* r) { return r[0] == 't'; }  // "tensor" or "simd"
constexpr Row kRows[] = {
#define LILY_KERNEL(family, name, requires) {#family, #name, requires_tensor(#requires)},
#include "kernels.def"
#undef LILY_KERNEL
    {"", "", false}  // sentinel: keeps the array non-empty while kernels.def has no rows
};
static_assert(sizeof(kRows) / sizeof(kRows[0]) == size_t(KernelId::count) + 1);
}  // namespace

const char* kernel_name(KernelId id) {
  return size_t(id) < size_t(KernelId::count) ? kRows[size_t(id)].name : "<invalid kernel id>";
}

const char* kernel_family(KernelId id) {
  return size_t(id) < size_t(KernelId::count) ? kRows[size_t(id)].family : "<invalid kernel id>";
}

bool kernel_needs_tensor_ops(KernelId id) { return size_t(id) < size_t(KernelId::count) && kRows[size_t(id)].tensor_ops; }

}  // namespace lily::metal
