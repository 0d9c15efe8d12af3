// KernelLibraries: how a device turns its kernel libraries into pipelines, written once for MetalDevice and
// EmuDevice so that CI exercises the policy a Mac runs. Previous hop: the device's Encoder asks for a kernel's
// pipeline (require); next hop: the device's own compile / pipeline calls (the three virtual hooks).
//
// - Each library compiles on its own (MetalDevice: one per metal/*.metal file; EmuDevice: one per kernels.def
//   family), all at the first request, and a failure is recorded, not thrown: a kernel of a library that
//   failed is refused with that library's error when it is requested, and the other libraries keep working.
// - Where the device reports Metal 4 tensor ops, the libraries compile at MSL 4.0 and every `tensor` row of
//   kernels.def must build its pipeline (a probe of the real kernels' shapes). A library that fails at 4.0 is
//   compiled again at 3.1; a missing or failing tensor kernel turns tensor ops off with one warning, and the
//   encoders then pick the MSL 3.1 simdgroup kernels.
// - $LILY_METAL_FAIL_LIBRARY=<library>[@4.0] makes that library's compile fail (at MSL 4.0 only with the
//   suffix): how the tests and `lily doctor` exercise the fallback without a broken compiler.
#pragma once
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "kernel_table.h"

namespace lily::metal {

// One library as the device built it: the MSL version it compiled at, its pipelines, or why it failed.
struct LibraryStatus {
  std::string library;
  std::string msl_version;  // "3.1" or "4.0"
  std::vector<std::string> families;  // kernels.def families of the kernels it holds
  int kernels = 0, pipelines = 0;
  std::string error;  // empty when compiled and every pipeline built
};

class KernelLibraries {
 public:
  virtual ~KernelLibraries() = default;
  // Compiles every library (once) and settles tensor ops; then the tensor-op decision is final.
  void compile_all();
  // Throws, naming the kernel, its family and the failed library, when `k` cannot be run.
  void require(KernelId k);
  // Every library compiled and every pipeline it holds built: what `lily doctor` reports.
  std::vector<LibraryStatus> build_all();
  bool tensor_ops() const { return tensor_; }
  std::string msl_version() const { return tensor_ ? "4.0" : "3.1"; }

 protected:
  // tensor_wanted: the device reports tensor ops (hardware and OS); libraries compile at 4.0 then.
  void init_libraries(bool tensor_wanted);
  // The device's names of its libraries.
  virtual std::vector<std::string> library_names() const = 0;
  // Compiles `library` at MSL 4.0 (msl4) or 3.1: "" on success, else the compiler's message. The device keeps
  // what it compiled; a later call for the same library replaces it.
  virtual std::string compile_library(const std::string& library, bool msl4) = 0;
  // The library holding `k`, or "" when no compiled library has it.
  virtual std::string library_of(KernelId k) const = 0;
  // Builds k's pipeline (k is in a compiled library): "" on success, else the message.
  virtual std::string build_pipeline(KernelId k) = 0;
  // One line to stderr, once per distinct message.
  void warn(const std::string& message);

 private:
  std::string compile_one(const std::string& library, bool msl4);
  std::string forced_failure(const std::string& library, bool msl4) const;

  bool tensor_ = false, compiled_ = false;
  std::string fail_library_;  // $LILY_METAL_FAIL_LIBRARY
  std::vector<LibraryStatus> status_;
  std::vector<std::string> warned_;
  std::recursive_mutex mu_;
};

}  // namespace lily::metal
