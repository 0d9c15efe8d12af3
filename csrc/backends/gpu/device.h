// The Device interface under every GPU backend: buffers (with the roles the counters and the memory ledger
// report), kernels by index into the backend's kernel table, command buffers with one concurrent compute
// encoder, completion waits. A GPU backend implements Device, CommandBuffer and Encoder's do_dispatch /
// do_barrier for its API (backends/metal: device_metal.mm on Apple's Metal, device_emu.cpp through the MSL
// emulator; backends/cuda: device.cu, whose kernels go on a stream in order and need no Encoder); everything
// else here (derived barriers, counters, the ledger) is shared. docs/design.md.
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
#include <type_traits>
#include <vector>

namespace lily::gpu {

// A kernel: its row in the backend's kernel table (metal: KernelId, one per metal/kernels.def row).
using KernelIndex = uint16_t;
constexpr size_t kMaxKernels = 256;  // rows a kernel table may have (the per-kernel counters are an array)

// What a buffer holds: the counters report bytes by role.
enum class Role : uint8_t { weights, kv, state, activations, io, count };
const char* role_name(Role r);

class MemoryLedger;

class Buffer {
 public:
  virtual ~Buffer();
  // CPU-visible pointer: unified memory on Apple silicon; null where the device's memory is its own (CUDA), whose
  // Device moves bytes with write / read / copy / zero instead.
  virtual void* contents() = 0;
  uint64_t size = 0;
  Role role = Role::activations;
  std::string label;
  std::shared_ptr<MemoryLedger> ledger;  // set for memory the device allocated (not for wrapped mappings)
};

// Device memory the Device allocated, by role: live now and the most live at once since the last reset.
struct Memory {
  uint64_t live[size_t(Role::count)] = {}, peak[size_t(Role::count)] = {};
  uint64_t live_total = 0, peak_total = 0;
  uint64_t cached = 0;  // freed by its buffers or allocated ahead, kept by the device for reuse (CUDA's BlockCache)
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

// A buffer plus a byte offset into it.
struct View {
  Buffer* buffer = nullptr;
  uint64_t offset = 0;
  View at(uint64_t bytes) const { return {buffer, offset + bytes}; }
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
  uint64_t kernel_dispatches[kMaxKernels] = {};  // dispatches of each kernel table row
  void add(const Counters& o);
  Counters since(const Counters& earlier) const;  // this − earlier (counters are cumulative)
};

class Encoder {
 public:
  virtual ~Encoder() = default;
  // Records a dispatch of `threadgroups` × `threads`. The argument struct is copied (setBytes, slot 0).
  // threadgroup_bytes: dynamic [[threadgroup(0)]] memory. Inserts a barrier first if a binding depends
  // on an earlier write in the current stage.
  void dispatch(KernelIndex kernel, Grid threadgroups, Grid threads, const void* args, size_t args_size,
                std::initializer_list<Binding> bindings, uint32_t threadgroup_bytes = 0);
  // A backend's kernel enum (metal::KernelId) names the kernel.
  template <class Kernel, class Args, class = std::enable_if_t<std::is_enum_v<Kernel>>>
  void dispatch(Kernel kernel, Grid threadgroups, Grid threads, const Args& args,
                std::initializer_list<Binding> bindings, uint32_t threadgroup_bytes = 0) {
    dispatch(KernelIndex(kernel), threadgroups, threads, &args, sizeof(Args), bindings, threadgroup_bytes);
  }
  void barrier();  // explicit barrier (rarely needed: dependencies are tracked)
  // The most threads a threadgroup of `kernel` may have: Metal's 1024 unless the device says less (a pipeline
  // whose register use lowers its maxTotalThreadsPerThreadgroup; EmuOptions::max_threads). dispatch() refuses
  // more; encoders of kernels that adapt to fewer threads (sample_token) size their threadgroups by it.
  virtual uint32_t max_threads(KernelIndex kernel) const;
  template <class Kernel, class = std::enable_if_t<std::is_enum_v<Kernel>>>
  uint32_t max_threads(Kernel kernel) const { return max_threads(KernelIndex(kernel)); }
  // Threadgroup memory per threadgroup, static + set by the host: dispatch() refuses more than the limit
  // (Apple's 32 KB on every Apple GPU; a device with more overrides it). static_threadgroup_bytes: what the
  // kernel declares itself (0 where the device cannot tell before running it).
  virtual uint64_t max_threadgroup_memory() const { return 32768; }
  virtual uint32_t static_threadgroup_bytes(KernelIndex kernel) const;
  virtual const char* kernel_label(KernelIndex kernel) const = 0;  // for messages
  uint64_t dispatches() const { return dispatches_; }
  bool tensor_ops = false;  // the device's has_tensor_ops(), set by its command buffer (encoders pick kernels)
  uint64_t barriers() const { return barriers_; }
  // What this encoder recorded, as counters of one command buffer: dispatches (also per kernel) and
  // dependency stages (barriers + 1 when anything was dispatched).
  Counters recorded() const;

 protected:
  virtual void do_dispatch(KernelIndex kernel, Grid threadgroups, Grid threads, const void* args, size_t args_size,
                           const std::vector<Binding>& bindings, uint32_t threadgroup_bytes) = 0;
  virtual void do_barrier() = 0;

 private:
  struct Range { const Buffer* buffer; uint64_t begin, end; };
  std::vector<Range> stage_reads_, stage_writes_;
  uint64_t dispatches_ = 0, barriers_ = 0;
  uint64_t per_kernel_[kMaxKernels] = {};
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
  Memory memory() const {
    Memory m = ledger_->memory();
    m.cached = cached_bytes();
    return m;
  }
  virtual uint64_t cached_bytes() const { return 0; }
  void reset_peak_memory() { ledger_->reset_peak(); }

  virtual std::string name() const = 0;
  virtual std::shared_ptr<Buffer> alloc(uint64_t bytes, Role role, const std::string& label) = 0;
  // A buffer over existing memory (mmap'd weights) without copying where the platform allows.
  virtual std::shared_ptr<Buffer> wrap(const void* data, uint64_t bytes, Role role, const std::string& label) = 0;
  virtual std::unique_ptr<CommandBuffer> new_command_buffer() = 0;
  // Called before the weights are mapped with what the model will hold (the KV cache at `context` tokens):
  // MetalDevice compares it with the GPU's working-set limit and says what will happen and the remedy.
  virtual void plan_memory(uint64_t /*weight_bytes*/, uint64_t /*kv_bytes*/, uint64_t /*context*/) {}

  // Bytes between the CPU and buffers, for what lies outside the command buffers (prompt ids, penalty tables,
  // session files, logits). write, copy and zero come before whatever the device is given after them; read
  // returns once the bytes are here, and sees what was written before it that has completed (callers wait for
  // the command buffer that wrote them). The defaults use contents() (unified memory); a device whose memory
  // is its own overrides all four.
  virtual void write(View dst, const void* src, uint64_t bytes);
  virtual void read(View src, void* dst, uint64_t bytes);
  virtual void copy(View dst, View src, uint64_t bytes);
  virtual void zero(View dst, uint64_t bytes);

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

}  // namespace lily::gpu
