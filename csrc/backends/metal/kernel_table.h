// KernelId: one enumerator per row of metal/kernels.def (the X-macro table of every [[host_name]]
// instantiation). Host code selects kernels by id and never formats a name.
#pragma once
#include <cstdint>

namespace lily::metal {

enum class KernelId : uint16_t {
#define LILY_KERNEL(family, name) name,
#include "kernels.def"
#undef LILY_KERNEL
  count
};

const char* kernel_name(KernelId id);
const char* kernel_family(KernelId id);

}  // namespace lily::metal
