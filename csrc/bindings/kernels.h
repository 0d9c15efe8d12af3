// The shared test harness of the Metal encoders: each csrc/bindings/kernels_<family>.cpp entry point makes a
// KernelRun (on the device kernels.set_device chose: an EmuDevice running lily/_metal_emu.so under the
// schedule the test asks for, or on a Mac the real MetalDevice, where order and seed mean nothing), uploads its
// numpy inputs, encodes its family's encoder(s) into one command buffer, and returns numpy outputs plus the
// Counters. Previous hop: tests/test_<family>.py; next hop: the encoders (csrc/backends/metal/<family>.cpp).
//
//   KernelRun run(order, seed);
//   Buffer* x = run.upload(x_np);                        // f32 / uint16 (bf16) / int32 / uint32, c-contiguous
//   Buffer* y = run.alloc(T * n * 2, Role::activations, "y");   // poisoned (0xFF bytes: NaN) until written
//   run.encode([&](Encoder& enc) { encode_rmsnorm(enc, {x}, w, {y}, T, n, eps); });
//   nb::dict d; d["y"] = run.download<uint16_t>(y, {T, n}); d["counters"] = run.counters();
#pragma once
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "../backends/metal/device.h"
#include "../backends/metal/encoders.h"

namespace lily::metal {

// The path of the emulated kernel library: $LILY_METAL_EMU if set, else <dir of the lily package>/_metal_emu.so.
std::string emu_library_path();
// Host names in an emulated library (device_emu.cpp), sorted.
std::vector<std::string> emu_library_kernels(const std::string& library);
// The device KernelRun makes: "metal-emu" (default) or "metal" (kernels.set_device).
const std::string& kernel_device();
// A new device of that kind; the EmuOptions apply to metal-emu only.
std::unique_ptr<Device> make_kernel_device(const EmuOptions& options);
// Counters as {"dispatches", "stages", "cpu_waits", "command_buffers", "bytes_read": {role: n},
// "bytes_written": {role: n}, "kernels": {name: n}}; `label` names a kernel index (default: metal's KernelId).
nanobind::dict counters_dict(const Counters& c, const std::function<const char*(gpu::KernelIndex)>& label = {});

// A test's GEMM path by name: "auto", "simdgroup" or "tensor" (encoders.h GemmPath).
GemmPath gemm_path(const std::string& name);

template <class T>
using HostArray = nanobind::ndarray<const T, nanobind::c_contig, nanobind::device::cpu>;
template <class T>
using NumpyArray = nanobind::ndarray<nanobind::numpy, T>;

// A numpy array of `shape` that owns `v`.
template <class T>
NumpyArray<T> numpy_of(std::vector<T>&& v, const std::vector<size_t>& shape) {
  auto* heap = new std::vector<T>(std::move(v));
  nanobind::capsule owner(heap, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return NumpyArray<T>(heap->data(), shape.size(), shape.data(), owner);
}

class KernelRun {
 public:
  // tensor_ops: the EmuDevice's has_tensor_ops (EmuOptions; -1 = its default); max_threads: EmuOptions::max_threads.
  explicit KernelRun(int order = 0, uint64_t seed = 0, int workers = 0, bool count_bytes = true, int tensor_ops = -1,
                     uint32_t max_threads = 1024);
  Device& device() { return *device_; }

  // A device buffer holding a copy of `a` (bf16 travels as uint16).
  template <class T>
  Buffer* upload(const HostArray<T>& a, Role role = Role::activations, const std::string& label = "input") {
    Buffer* b = alloc(a.nbytes(), role, label, 0);
    if (a.nbytes()) std::memcpy(b->contents(), a.data(), a.nbytes());
    return b;
  }
  // A device buffer of `bytes` filled with `fill` (0xFF: NaN in f32 and bf16, so unwritten outputs show).
  Buffer* alloc(uint64_t bytes, Role role = Role::activations, const std::string& label = "output", int fill = 0xFF);
  // Weights for a test: copied like upload(), because numpy memory shares pages with other heap data and
  // the emulator's byte counting makes every bound page inaccessible during a dispatch. (The backend wraps
  // whole mmap'd files, which own their pages, without copying.)
  template <class T>
  Buffer* wrap(const HostArray<T>& a, Role role = Role::weights, const std::string& label = "weights") {
    return upload(a, role, label);
  }

  // Records `body` into one command buffer, commits it and waits (one CPU wait).
  void encode(const std::function<void(Encoder&)>& body);

  // A numpy copy of `shape` elements of T starting `offset` bytes into `b`.
  template <class T>
  NumpyArray<T> download(Buffer* b, std::vector<size_t> shape, uint64_t offset = 0) {
    size_t n = 1;
    for (size_t s : shape) n *= s;
    if (offset + n * sizeof(T) > b->size) throw std::out_of_range("[kernels] download past the end of '" + b->label + "'");
    std::vector<T> host(n);
    if (n) std::memcpy(host.data(), static_cast<const uint8_t*>(b->contents()) + offset, n * sizeof(T));
    return numpy_of(std::move(host), shape);
  }

  nanobind::dict counters() const { return counters_dict(device_->counters()); }

 private:
  std::unique_ptr<Device> device_;
  std::vector<std::shared_ptr<Buffer>> buffers_;
};

}  // namespace lily::metal
