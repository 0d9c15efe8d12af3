// The Device interface under the Metal backend: buffers, compute pipelines by kernel id, command buffers
// with a concurrent compute encoder, completion waits. Two implementations: device_metal.mm (Apple's
// Metal; the only Apple-only file) and device_emu.cpp (the same .metal sources run by csrc/mslemu).
// Everything above this header (encoders, the backend's schedule glue) is portable C++ that CI runs.
//
// Barriers are derived, not written by hand: every dispatch declares how it uses each bound range
// (read / write), and Encoder inserts a barrier only when a dispatch touches a range that an earlier
// dispatch since the last barrier wrote (or writes a range one of them read). The number of barriers
// + 1 is the number of dependency stages the counters report.
#pragma once
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "kernel_table.h"

namespace lily::metal {

// What a buffer holds: the counters report bytes by role.
enum class Role : uint8_t { weights, kv, state, activations, io, count };
const char* role_name(Role r);

class MemoryLedger;

class Buffer {
 public:
  virtual ~Buffer();
  virtual void* contents() = 0;  // CPU-visible pointer (unified memory on Apple silicon)
  uint64_t size = 0;
  Role role = Role::activations;
  std::string label;
  std::shared_ptr<MemoryLedger> ledger;  // set for memory the device allocated (not for wrapped mappings)
};

// Device memory the Device allocated, by role: live now and the most live at once since the last reset.
struct Memory {
  uint64_t live[size_t(Role::count)] = {}, peak[size_t(Role::count)] = {};
  uint64_t live_total = 0, peak_total = 0;
};

class MemoryLedger {
 public:
  void add(Role r, uint64_t bytes);
  void release(Role r, uint64_t bytes);
  Memory memory() const;
  void reset_peak();  // peaks restart from what is live

 private:
  mutable std::mutex mu_;
  Memory m_;
};

enum class Access : uint8_t { read, write, read_write };

// One buffer argument: [[buffer(slot)]] bound at `offset` bytes; `bytes` is the range the kernel may touch
// (0 = to the end of the buffer), used for dependency tracking.
struct Binding {
  int slot;
  Buffer* buffer;
  uint64_t offset = 0;
  Access access = Access::read;
  uint64_t bytes = 0;
};

struct Grid {
  uint32_t x = 1, y = 1, z = 1;
};

// Per-command-buffer (or cumulative) counts: what a GPU would spend.
struct Counters {
  uint64_t dispatches = 0;
  uint64_t stages = 0;      // dependency stages: barriers + 1 per non-empty encoder
  uint64_t cpu_waits = 0;   // waits for the GPU (command buffer completion, reads of results)
  uint64_t cpu_waits_in_step = 0;  // of those, waits while a step was being recorded (the backend counts them)
  uint64_t cpu_waits_drained = 0;  // of those, waits that left no command buffer queued: the GPU then idles
                                   // until the CPU commits again (the backend counts them)
  uint64_t command_buffers = 0;
  uint64_t bytes_read[size_t(Role::count)] = {};
  uint64_t bytes_written[size_t(Role::count)] = {};
  uint64_t kernel_dispatches[size_t(KernelId::count)] = {};  // dispatches of each kernels.def row
  void add(const Counters& o);
  Counters since(const Counters& earlier) const;  // this − earlier (counters are cumulative)
};

class Encoder {
 public:
  virtual ~Encoder() = default;
  // Records a dispatch of `threadgroups` × `threads`. The argument struct is copied (setBytes, slot 0).
  // threadgroup_bytes: dynamic [[threadgroup(0)]] memory. Inserts a barrier first if a binding depends
  // on an earlier write in the current stage.
  void dispatch(KernelId kernel, Grid threadgroups, Grid threads, const void* args, size_t args_size,
                std::initializer_list<Binding> bindings, uint32_t threadgroup_bytes = 0);
  template <class Args>
  void dispatch(KernelId kernel, Grid threadgroups, Grid threads, const Args& args,
                std::initializer_list<Binding> bindings, uint32_t threadgroup_bytes = 0) {
    dispatch(kernel, threadgroups, threads, &args, sizeof(Args), bindings, threadgroup_bytes);
  }
  void barrier();  // explicit barrier (rarely needed: dependencies are tracked)
  // The most threads a threadgroup of `kernel` may have: Metal's 1024 unless the device says less (a pipeline
  // whose register use lowers its maxTotalThreadsPerThreadgroup; EmuOptions::max_threads). dispatch() refuses
  // more; encoders of kernels that adapt to fewer threads (sample_token) size their threadgroups by it.
  virtual uint32_t max_threads(KernelId kernel) const;
  static constexpr uint64_t kMaxThreadgroupMemory = 32768;  // static + dynamic, per threadgroup, every Apple GPU
  // The static threadgroup memory of `kernel` (a Metal pipeline's staticThreadgroupMemoryLength; 0 where the
  // device cannot tell before running it). dispatch() refuses static + threadgroup_bytes above Apple's 32 KB.
  virtual uint32_t static_threadgroup_bytes(KernelId kernel) const;
  uint64_t dispatches() const { return dispatches_; }
  bool tensor_ops = false;  // the device's has_tensor_ops(), set by its command buffer (encoders pick kernels)
  uint64_t barriers() const { return barriers_; }
  // What this encoder recorded, as counters of one command buffer: dispatches (also per kernel) and
  // dependency stages (barriers + 1 when anything was dispatched).
  Counters recorded() const;

 protected:
  virtual void do_dispatch(KernelId kernel, Grid threadgroups, Grid threads, const void* args, size_t args_size,
                           const std::vector<Binding>& bindings, uint32_t threadgroup_bytes) = 0;
  virtual void do_barrier() = 0;

 private:
  struct Range { const Buffer* buffer; uint64_t begin, end; };
  std::vector<Range> stage_reads_, stage_writes_;
  uint64_t dispatches_ = 0, barriers_ = 0;
  uint64_t per_kernel_[size_t(KernelId::count)] = {};
};

class CommandBuffer {
 public:
  virtual ~CommandBuffer() = default;
  virtual Encoder& encoder() = 0;  // one concurrent compute encoder per command buffer
  virtual void commit() = 0;       // submit; returns at once on a GPU
  virtual void wait() = 0;         // block until complete (a CPU wait)
};

class Device {
 public:
  virtual ~Device() = default;
  // Counters accumulated since the last reset: the implementations feed them (EmuDevice everything,
  // MetalDevice dispatches, stages, command buffers and waits).
  Counters counters() const;
  void reset_counters();
  Memory memory() const { return ledger_->memory(); }
  void reset_peak_memory() { ledger_->reset_peak(); }

  virtual std::string name() const = 0;
  virtual std::shared_ptr<Buffer> alloc(uint64_t bytes, Role role, const std::string& label) = 0;
  // A buffer over existing memory (mmap'd weights) without copying where the platform allows.
  virtual std::shared_ptr<Buffer> wrap(const void* data, uint64_t bytes, Role role, const std::string& label) = 0;
  virtual std::unique_ptr<CommandBuffer> command_buffer() = 0;
  virtual bool has_bf16() const = 0;
  virtual bool has_tensor_ops() const = 0;  // Metal 4 matmul2d (M5 Neural Accelerators)

 protected:
  void count(const Counters& c);
  // An allocation of alloc(): entered in the memory ledger, left when the buffer is destroyed.
  std::shared_ptr<Buffer> tracked(std::shared_ptr<Buffer> b, uint64_t bytes, Role role, const std::string& label);
  std::shared_ptr<Buffer> labelled(std::shared_ptr<Buffer> b, uint64_t bytes, Role role, const std::string& label);

 private:
  mutable std::mutex mu_;
  Counters counters_;
  std::shared_ptr<MemoryLedger> ledger_ = std::make_shared<MemoryLedger>();
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
