// EmuDevice: the Device interface (device.h) over the MSL-on-CPU emulator (csrc/mslemu). The emulated
// kernel library (lily/_metal_emu.so, every metal/*.metal built by clang) is loaded with dlopen and used only
// through the plain C ABI of csrc/mslemu/mslemu.h, so this gcc-built file never sees clang's code.
// Previous hop: the Encoder (device.cpp) records dispatches and derived barriers; next hop: mslemu_dispatch.
//
// What it adds over a GPU, for tests and performance evidence:
//   - Buffers come from mslemu_alloc: each one owns its pages (so the emulator's page-granular byte
//     counting is exact) and ends at an inaccessible page (so a read past the end is reported).
//   - Dispatches run at commit(), stage by stage (a stage = the dispatches between two barriers). Under
//     order reverse/random the dispatches inside a stage are permuted too: a missing barrier between two
//     dependent dispatches then changes the result.
//   - Counters: dispatches, stages, command buffers, CPU waits, and bytes read/written by buffer Role
//     (from the emulator's per-slot counts).
#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "../../mslemu/mslemu.h"
#include "device.h"

namespace lily::metal {

namespace {

// The emulated library's C ABI, resolved once per path. Libraries stay loaded for the process lifetime:
// buffers and kernels of several devices may refer to them.
struct EmuLibrary {
  std::string path;
  int (*abi_version)() = nullptr;
  const mslemu_kernel* (*find_kernel)(const char*) = nullptr;
  int (*kernel_count)() = nullptr;
  const char* (*kernel_name_at)(int) = nullptr;
  const char* (*library_error)() = nullptr;
  int (*dispatch)(const mslemu_kernel*, const mslemu_dispatch_desc*, char*, uint64_t) = nullptr;
  void* (*alloc)(uint64_t) = nullptr;
  void (*free)(void*, uint64_t) = nullptr;
};

const char* kInstallHint =
    "the emulated kernel library is built only when clang (>= 17) and boost.context (Debian: "
    "libboost-context-dev) are present at build time; install them and rebuild lily (pip install .)";

template <class F>
void resolve(void* handle, const std::string& path, const char* symbol, F& out) {
  out = reinterpret_cast<F>(dlsym(handle, symbol));
  if (!out) throw std::runtime_error("[metal-emu] " + path + " lacks the mslemu symbol " + symbol);
}

const EmuLibrary& load_library(const std::string& path) {
  static std::mutex mu;
  static std::map<std::string, EmuLibrary> loaded;
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = loaded.find(path); it != loaded.end()) return it->second;
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!handle)
    throw std::runtime_error("[metal-emu] cannot load the emulated kernel library '" + path + "': " + dlerror() +
                             "; " + kInstallHint);
  EmuLibrary lib;
  lib.path = path;
  resolve(handle, path, "mslemu_abi_version", lib.abi_version);
  resolve(handle, path, "mslemu_find_kernel", lib.find_kernel);
  resolve(handle, path, "mslemu_kernel_count", lib.kernel_count);
  resolve(handle, path, "mslemu_kernel_name", lib.kernel_name_at);
  resolve(handle, path, "mslemu_library_error", lib.library_error);
  resolve(handle, path, "mslemu_dispatch", lib.dispatch);
  resolve(handle, path, "mslemu_alloc", lib.alloc);
  resolve(handle, path, "mslemu_free", lib.free);
  if (lib.abi_version() != MSLEMU_ABI_VERSION)
    throw std::runtime_error("[metal-emu] " + path + " has mslemu ABI " + std::to_string(lib.abi_version()) +
                             ", this build expects " + std::to_string(MSLEMU_ABI_VERSION) + "; rebuild lily");
  if (const char* err = lib.library_error())
    throw std::runtime_error(std::string("[metal-emu] ") + path + " is unusable: " + err);
  return loaded.emplace(path, lib).first->second;
}

class EmuBuffer final : public Buffer {
 public:
  EmuBuffer(const EmuLibrary& lib, void* ptr, uint64_t alloc_bytes, bool owned)
      : lib_(lib), ptr_(ptr), alloc_bytes_(alloc_bytes), owned_(owned) {}
  ~EmuBuffer() override {
    if (owned_) lib_.free(ptr_, alloc_bytes_);
  }
  void* contents() override { return ptr_; }

 private:
  const EmuLibrary& lib_;
  void* ptr_;
  uint64_t alloc_bytes_;
  bool owned_;
};

struct Recorded {
  KernelId kernel;
  Grid threadgroups, threads;
  std::vector<uint8_t> args;
  std::vector<Binding> bindings;
  uint32_t threadgroup_bytes;
};

class EmuDevice;

class EmuEncoder final : public Encoder {
 public:
  std::vector<std::vector<Recorded>> stages{1};
  uint32_t limit = 1024;  // EmuOptions::max_threads
  uint32_t max_threads(gpu::KernelIndex) const override { return limit; }

 protected:
  void do_dispatch(gpu::KernelIndex kernel, Grid threadgroups, Grid threads, const void* args, size_t args_size,
                   const std::vector<Binding>& bindings, uint32_t threadgroup_bytes) override {
    if (size_t(kernel) >= size_t(KernelId::count))
      throw std::invalid_argument("[metal-emu] invalid kernel id " + std::to_string(int(kernel)));
    const auto* a = static_cast<const uint8_t*>(args);
    stages.back().push_back({KernelId(kernel), threadgroups, threads, std::vector<uint8_t>(a, a + args_size), bindings,
                             threadgroup_bytes});
  }
  void do_barrier() override { stages.emplace_back(); }
};

class EmuCommandBuffer final : public CommandBuffer {
 public:
  explicit EmuCommandBuffer(EmuDevice& dev);
  Encoder& encoder() override { return encoder_; }
  void commit() override;
  void wait() override;

 private:
  EmuDevice& dev_;
  EmuEncoder encoder_;
  bool committed_ = false;
};

// Argument structs are small (a few dozen bytes); one page holds the one in flight.
constexpr uint64_t kArgsPage = 4096;

// Its libraries (libraries.h) are the kernels.def families: the emulated library holds every kernel, built at
// MSL 4.0, so "compiling" a family at 3.1 leaves out its tensor kernels, and $LILY_METAL_FAIL_LIBRARY makes a
// family fail as a Mac's compiler could.
class EmuDevice final : public Device, private KernelLibraries {
 public:
  EmuDevice(const std::string& library, const EmuOptions& options) : lib_(load_library(library)), options_(options) {
    if (options_.workers <= 0) options_.workers = int(std::max(1u, std::thread::hardware_concurrency()));
    if (options_.tensor_ops < 0) {
      const char* env = std::getenv("LILY_METAL_EMU_TENSOR_OPS");
      options_.tensor_ops = env && *env && std::strcmp(env, "0") != 0 ? 1 : 0;
    }
    std::string missing;
    int n_missing = 0;
    for (size_t i = 0; i < size_t(KernelId::count); ++i) {
      const char* name = kernel_name(KernelId(i));
      kernels_[i] = lib_.find_kernel(name);
      if (!kernels_[i]) {
        missing += (n_missing++ ? ", " : "") + std::string(name);
      }
    }
    if (n_missing)
      throw std::runtime_error("[metal-emu] " + std::to_string(n_missing) + " kernel(s) of metal/kernels.def missing from " +
                               library + ": " + missing + " (each needs a [[host_name]] instantiation in metal/<family>.metal)");
    args_page_ = lib_.alloc(kArgsPage);
    if (!args_page_) throw std::bad_alloc();
    init_libraries(options_.tensor_ops > 0);
    compile_all();
  }
  ~EmuDevice() override { lib_.free(args_page_, kArgsPage); }

  std::string name() const override { return "metal-emu"; }

  std::shared_ptr<Buffer> alloc(uint64_t bytes, Role role, const std::string& label) override {
    const uint64_t n = std::max<uint64_t>(bytes, 16);
    void* p = lib_.alloc(n);
    if (!p) throw std::runtime_error("[metal-emu] cannot allocate " + std::to_string(bytes) + " bytes for '" + label + "'");
    return tracked(std::make_shared<EmuBuffer>(lib_, p, n, true), bytes, role, label);
  }

  std::shared_ptr<Buffer> wrap(const void* data, uint64_t bytes, Role role, const std::string& label) override {
    // No copy: the kernels read the mapping itself (page-aligned when it is a whole mmap'd file).
    return labelled(std::make_shared<EmuBuffer>(lib_, const_cast<void*>(data), bytes, false), bytes, role, label);
  }

  std::unique_ptr<CommandBuffer> command_buffer() override { return std::make_unique<EmuCommandBuffer>(*this); }
  bool has_bf16() const override { return true; }
  bool has_tensor_ops() const override { return tensor_ops(); }  // EmuOptions::tensor_ops, unless a library failed
  DeviceFacts facts() const override {
    DeviceFacts f;
    f.name = name();
    f.gpu = "the MSL emulator (csrc/mslemu) on the CPU: " + lib_.path;
    f.gpu_family = "emulated (simdgroups of 32)";
    f.msl_version = msl_version();
    f.bf16 = true;
    f.tensor_ops = tensor_ops();
    return f;
  }
  std::vector<LibraryStatus> build_libraries() override { return build_all(); }
  uint32_t max_threads_option() const { return options_.max_threads; }
  void execute(EmuEncoder& enc) {
    Counters c = enc.recorded();
    for (auto& stage : enc.stages) {
      std::vector<size_t> order(stage.size());
      for (size_t i = 0; i < order.size(); ++i) order[i] = i;
      if (options_.order == MSLEMU_ORDER_REVERSE) std::reverse(order.begin(), order.end());
      if (options_.order == MSLEMU_ORDER_RANDOM) {
        std::mt19937_64 rng(options_.seed ^ (0x9e3779b97f4a7c15ull * ++shuffles_));
        std::shuffle(order.begin(), order.end(), rng);
      }
      for (size_t i : order) run(stage[i], c);
    }
    count(c);
  }

  void count_wait() {
    Counters c;
    c.cpu_waits = 1;
    count(c);
  }

 private:
  std::vector<std::string> library_names() const override {
    std::vector<std::string> families;
    for (size_t i = 0; i < size_t(KernelId::count); ++i)
      if (std::find(families.begin(), families.end(), kernel_family(KernelId(i))) == families.end())
        families.push_back(kernel_family(KernelId(i)));
    return families;
  }
  std::string compile_library(const std::string& family, bool msl4) override {
    compiled_[family] = msl4 ? 2 : 1;
    return "";
  }
  std::string library_of(KernelId k) const override {
    auto it = compiled_.find(kernel_family(k));
    if (it == compiled_.end() || it->second == 0 || (kernel_needs_tensor_ops(k) && it->second < 2)) return "";
    return it->first;
  }
  std::string build_pipeline(KernelId k) override {
    return kernels_[size_t(k)] ? "" : std::string("not in the emulated library ") + lib_.path;
  }

  void run(const Recorded& d, Counters& c) {
    const char* name = kernel_name(d.kernel);
    require(d.kernel);
    if (d.args.size() > kArgsPage)
      throw std::invalid_argument(std::string("[metal-emu] ") + name + ": args struct of " + std::to_string(d.args.size()) +
                                  " bytes exceeds " + std::to_string(kArgsPage));
    std::memcpy(args_page_, d.args.data(), d.args.size());
    int nbuffers = 1;
    for (const Binding& b : d.bindings) nbuffers = std::max(nbuffers, b.slot + 1);
    if (nbuffers > 31) throw std::invalid_argument(std::string("[metal-emu] ") + name + ": buffer slot above 30");
    std::vector<mslemu_buffer> buffers(size_t(nbuffers), mslemu_buffer{nullptr, 0});
    buffers[0] = {args_page_, uint64_t(d.args.size())};
    for (const Binding& b : d.bindings) {
      // The slot's extent is the declared range when there is one: slots over one buffer (a weight file's
      // codes, scales and biases) then count their own bytes only.
      buffers[size_t(b.slot)] = {static_cast<uint8_t*>(b.buffer->contents()) + b.offset,
                                 b.bytes ? b.bytes : b.buffer->size - b.offset};
    }
    const uint32_t tg_len = (d.threadgroup_bytes + 15u) & ~15u;
    std::vector<uint64_t> rd(size_t(nbuffers), 0), wr(size_t(nbuffers), 0);
    mslemu_dispatch_desc desc;
    std::memset(&desc, 0, sizeof desc);
    desc.threadgroups[0] = d.threadgroups.x, desc.threadgroups[1] = d.threadgroups.y, desc.threadgroups[2] = d.threadgroups.z;
    desc.threads[0] = d.threads.x, desc.threads[1] = d.threads.y, desc.threads[2] = d.threads.z;
    desc.buffers = buffers.data();
    desc.nbuffers = nbuffers;
    desc.threadgroup_lengths = tg_len ? &tg_len : nullptr;
    desc.nthreadgroup = tg_len ? 1 : 0;
    desc.order = options_.order;
    desc.seed = options_.seed + 0x632be59bd9b4e019ull * ++launches_;
    desc.workers = options_.workers;
    desc.count_bytes = options_.count_bytes ? 1 : 0;
    desc.bytes_read = rd.data();
    desc.bytes_written = wr.data();
    char err[2048] = {0};
    if (lib_.dispatch(kernels_[size_t(d.kernel)], &desc, err, sizeof err) != 0)
      throw std::runtime_error(std::string("[metal-emu] ") + name + " failed: " + err);
    if (options_.count_bytes)
      for (const Binding& b : d.bindings) {
        c.bytes_read[size_t(b.buffer->role)] += rd[size_t(b.slot)];
        c.bytes_written[size_t(b.buffer->role)] += wr[size_t(b.slot)];
      }
  }

  const EmuLibrary& lib_;
  EmuOptions options_;
  const mslemu_kernel* kernels_[size_t(KernelId::count) + 1] = {};
  void* args_page_ = nullptr;
  uint64_t shuffles_ = 0, launches_ = 0;
  std::map<std::string, int> compiled_;  // family -> 0 failed, 1 MSL 3.1 (no tensor kernels), 2 MSL 4.0
};

EmuCommandBuffer::EmuCommandBuffer(EmuDevice& dev) : dev_(dev) {
  encoder_.tensor_ops = dev.has_tensor_ops();
  encoder_.limit = dev.max_threads_option();
}

void EmuCommandBuffer::commit() {
  if (committed_) throw std::logic_error("[metal-emu] command buffer committed twice");
  committed_ = true;
  dev_.execute(encoder_);
}

void EmuCommandBuffer::wait() {
  if (!committed_) throw std::logic_error("[metal-emu] wait on a command buffer that was not committed");
  dev_.count_wait();
}

}  // namespace

std::vector<std::string> emu_library_kernels(const std::string& library) {
  const EmuLibrary& lib = load_library(library);
  std::vector<std::string> names;
  for (int i = 0, n = lib.kernel_count(); i < n; ++i) names.emplace_back(lib.kernel_name_at(i));
  return names;
}

std::unique_ptr<Device> make_emu_device(const std::string& library, const EmuOptions& options) {
  return std::make_unique<EmuDevice>(library, options);
}

}  // namespace lily::metal
