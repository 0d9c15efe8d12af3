// The name table behind KernelId (kernel_table.h, which expands metal/kernels.def). Previous hop: the
// encoders pick a KernelId; next hop: the Device looks the name up in its library (device_metal.mm:
// newFunctionWithName; device_emu.cpp: mslemu_find_kernel).
#include "kernel_table.h"

namespace lily::metal {

namespace {
bool valid(KernelId id) { return size_t(id) < size_t(KernelId::count); }
}  // namespace

// The rows' string_views are string literals, so .data() is NUL-terminated.
const char* kernel_name(KernelId id) { return valid(id) ? kKernelRows[size_t(id)].name.data() : "<invalid kernel id>"; }

const char* kernel_family(KernelId id) {
  return valid(id) ? kKernelRows[size_t(id)].family.data() : "<invalid kernel id>";
}

bool kernel_needs_tensor_ops(KernelId id) { return valid(id) && kKernelRows[size_t(id)].tensor_ops; }

}  // namespace lily::metal
