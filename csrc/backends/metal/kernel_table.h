// KernelId: one enumerator per row of metal/kernels.def (the X-macro table of every [[host_name]]
// instantiation). Host code selects kernels by id and never formats a name.
#pragma once
#include <cstdint>

namespace lily::metal {

enum class KernelId : uint16_t {
#define LILY_KERNEL(family, name, requires) name,
#include "kernels.def"
#undef LILY_KERNEL
  count
};

const char* kernel_name(KernelId id);
const char* kernel_family(KernelId id);
// The row's `requires` is tensor: the kernel exists only in an MSL 4.0 build on a device with tensor ops.
bool kernel_needs_tensor_ops(KernelId id);

}  // namespace lily::metal
