// The Metal flavour of the GPU Device interface (backends/gpu/device.h): kernels named by KernelId (one per
// metal/kernels.def row), and the device's Metal capabilities. Two implementations: device_metal.mm (Apple's
// Metal; the only Apple-only file) and device_emu.cpp (the same .metal sources run by csrc/mslemu).
// Everything above this header (the family files' encoders and ops) is portable C++ that CI runs.
#pragma once
#include <memory>
#include <string>

#include "../gpu/device.h"
#include "kernel_table.h"
#include "libraries.h"

namespace lily::metal {

using gpu::Access;
using gpu::Binding;
using gpu::Buffer;
using gpu::Counters;
using gpu::Grid;
using gpu::Memory;
using gpu::Role;
using gpu::View;
using gpu::role_name;
static_assert(size_t(KernelId::count) <= gpu::kMaxKernels, "kernels.def has more rows than gpu::kMaxKernels");

// The device's encoder. Its devices implement gpu::Encoder's do_dispatch, max_threads and
// static_threadgroup_bytes themselves: a gpu::KernelIndex is a KernelId's row.
class Encoder : public gpu::Encoder {
 public:
  const char* kernel_label(gpu::KernelIndex k) const final { return kernel_name(KernelId(k)); }
};

class CommandBuffer : public gpu::CommandBuffer {
 public:
  Encoder& encoder() override = 0;
};

// What a device is and can do, for `lily doctor` and error messages; 0 / "" where a device has no such notion.
struct DeviceFacts {
  std::string name, gpu, gpu_family, msl_version, os;
  bool bf16 = false, tensor_ops = false;
  uint64_t working_set = 0;  // recommendedMaxWorkingSetSize: what the GPU may keep resident without paging
  uint64_t max_buffer = 0;   // maxBufferLength
  uint64_t wired_limit = 0;  // sysctl iogpu.wired_limit_mb (0: the macOS default)
};

class Device : public gpu::Device {
 public:
  virtual std::unique_ptr<CommandBuffer> command_buffer() = 0;
  std::unique_ptr<gpu::CommandBuffer> new_command_buffer() final { return command_buffer(); }
  virtual bool has_bf16() const = 0;
  virtual bool has_tensor_ops() const = 0;  // Metal 4 matmul2d (M5 Neural Accelerators)
  virtual DeviceFacts facts() const = 0;
  // Compiles every kernel library and builds every pipeline (libraries.h): what `lily doctor` reports.
  virtual std::vector<LibraryStatus> build_libraries() = 0;
};

// The emulated device: `library` is the path of the emulated kernel library (lily/_metal_emu.so).
struct EmuOptions {
  int order = 0;          // 0 forward, 1 reverse, 2 random (threads, threadgroups and dispatches of a stage)
  uint64_t seed = 0;
  int workers = 0;        // 0 = hardware threads
  bool count_bytes = true;
  // has_tensor_ops(): -1 = $LILY_METAL_EMU_TENSOR_OPS (unset or "0": no), 0 no, 1 yes (the library is built at
  // MSL 4.0, so both matrix paths exist; tests run each).
  int tensor_ops = -1;
  uint32_t max_threads = 1024;  // Encoder::max_threads of every kernel (tests lower it, as a heavy pipeline would)
};
std::unique_ptr<Device> make_emu_device(const std::string& library, const EmuOptions& options);
#ifdef __APPLE__
std::unique_ptr<Device> make_metal_device();
#endif

}  // namespace lily::metal
