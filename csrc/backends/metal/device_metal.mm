// MetalDevice: the Device interface (device.h) on Apple's Metal, the only Apple-only file (Objective-C++,
// ARC). Previous hop: the Encoder (device.cpp) with its derived barriers; next hop: the GPU.
// scripts/check-objc compiles this file against Apple's SDK headers (or the project's declaration header,
// tools/apple-decls/, in CI); tests/test_objc.py runs it.
//
// - Capabilities are checked up front, each refusal naming its requirement: macOS 14 (MSL 3.1, bfloat) and an
//   Apple-silicon GPU family (Apple7: M1 or later).
// - Shaders: metal/*.metal are embedded in the extension as source (metal_sources.h) and compiled with
//   newLibraryWithSource, fast math off, one MTLLibrary per file, all when the device is made; a file that
//   fails leaves the others usable, and its kernels are refused with its error (libraries.h has the policy).
// - Metal 4 tensor ops (matmul2d; the qgemm_tensor_* / moe_gemm_*_tensor_* kernels): wanted where the GPU has
//   Neural Accelerators, decided at run time as MLX gates its NAX kernels (macOS 26.2+, the Metal4 family,
//   architecture generation >= 17, >= 18 for the 'p' parts; $LILY_METAL_TENSOR=0 / 1 overrides the
//   architecture test), then confirmed by building the pipeline of every tensor kernel itself, compiled at
//   MSL 4.0 (a probe of the real shapes: llama.cpp's small probe passed where a macOS 26.2 header broke its
//   whole library). Any failure there turns them off with one warning: the MSL 3.1 simdgroup kernels run.
//   The enumerator values are Apple's (MTLGPUFamilyMetal4 = 5002, MTLLanguageVersion4_0 = 4 << 16), so the
//   build SDK's version does not decide it.
// - Weights: the mmap'd checkpoint files are wrapped with newBufferWithBytesNoCopy (page-aligned mappings),
//   so the GPU reads the page cache directly; a mapping longer than maxBufferLength becomes overlapping views
//   (a binding uses the view that holds its whole range). On macOS 15+ they join one MTLResidencySet attached
//   to the queue. Before mapping, plan_memory compares weights + KV cache with recommendedMaxWorkingSetSize.
// - One concurrent compute encoder per command buffer (MTLDispatchTypeConcurrent): dispatches of a stage may
//   overlap, and the Encoder's derived barriers become memoryBarrierWithScope:MTLBarrierScopeBuffers. The
//   encoder ends in its destructor when an error interrupts recording (no "released without endEncoding").
// - Every entry point that creates Objective-C objects drains its own @autoreleasepool, so a long generation
//   on a thread without a run loop (Python's) accumulates nothing: a step or chunk records through them only.
// - Arguments: each kernel's <Family>Args struct goes by setBytes at slot 0.
#import <Foundation/Foundation.h>
#import <Metal/Metal.h>

#include <mach/vm_page_size.h>
#include <sys/sysctl.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "device.h"
#include "metal_sources.h"

namespace lily::metal {

namespace {

constexpr MTLGPUFamily kFamilyMetal4 = MTLGPUFamily(5002);
constexpr MTLLanguageVersion kLanguage4_0 = MTLLanguageVersion(4 << 16);
constexpr MTLGPUFamily kFamilyApple7 = MTLGPUFamily(1007);  // M1: bfloat and simdgroup_matrix at full rate

std::string describe(NSError* e) { return e ? std::string(e.localizedDescription.UTF8String) : "unknown error"; }

std::string gb(uint64_t bytes) {
  char s[32];
  std::snprintf(s, sizeof s, "%.1f GB", double(bytes) / 1e9);
  return s;
}

NSString* ns(const std::string& s) { return [NSString stringWithUTF8String:s.c_str()]; }

// A buffer, or a long mapping as views of at most maxBufferLength bytes that overlap by half a view: a range
// of up to half a view (every tensor of the model) lies wholly inside one of them.
class MetalBuffer final : public Buffer {
 public:
  struct View {
    uint64_t begin;
    id<MTLBuffer> buffer;
  };
  MetalBuffer(void* base, std::vector<View> views) : base_(base), views_(std::move(views)) {}
  ~MetalBuffer() override {
    if (@available(macOS 15.0, *)) {
      if (!residency) return;
      id<MTLResidencySet> set = residency;
      for (const View& v : views_) [set removeAllocation:(id<MTLAllocation>)v.buffer];
      [set commit];
    }
  }
  void* contents() override { return base_; }
  // The view holding [offset, offset + bytes) (bytes 0: to the end) and the offset into it.
  std::pair<id<MTLBuffer>, uint64_t> bind(uint64_t offset, uint64_t bytes) const {
    const uint64_t end = bytes ? offset + bytes : size;
    for (const View& v : views_)
      if (offset >= v.begin && end <= v.begin + v.buffer.length) return {v.buffer, offset - v.begin};
    throw std::runtime_error("[metal] '" + label + "': the range [" + std::to_string(offset) + ", " + std::to_string(end) +
                             ") lies in no view of at most maxBufferLength bytes; a tensor this large cannot be bound");
  }
  const std::vector<View>& views() const { return views_; }
  id residency = nil;  // the MTLResidencySet the views joined (macOS 15+)

 private:
  void* base_;
  std::vector<View> views_;
};

class MetalDevice;

class MetalEncoder final : public Encoder {
 public:
  MetalEncoder(MetalDevice& dev, id<MTLComputeCommandEncoder> enc) : dev_(dev), enc_(enc) {}
  ~MetalEncoder() override { end(); }
  void end() {
    if (ended_) return;
    ended_ = true;
    [enc_ endEncoding];
  }
  uint32_t max_threads(gpu::KernelIndex kernel) const override;
  uint32_t static_threadgroup_bytes(gpu::KernelIndex kernel) const override;

 protected:
  void do_dispatch(gpu::KernelIndex kernel, Grid threadgroups, Grid threads, const void* args, size_t args_size,
                   const std::vector<Binding>& bindings, uint32_t threadgroup_bytes) override;
  void do_barrier() override { [enc_ memoryBarrierWithScope:MTLBarrierScopeBuffers]; }

 private:
  MetalDevice& dev_;
  id<MTLComputeCommandEncoder> enc_;
  bool ended_ = false;
};

class MetalCommandBuffer final : public CommandBuffer {
 public:
  MetalCommandBuffer(MetalDevice& dev, id<MTLCommandBuffer> cb, id<MTLComputeCommandEncoder> enc, bool tensor_ops)
      : dev_(dev), cb_(cb), encoder_(dev, enc) {
    encoder_.tensor_ops = tensor_ops;
  }
  Encoder& encoder() override { return encoder_; }
  void commit() override;
  void wait() override;

 private:
  MetalDevice& dev_;
  id<MTLCommandBuffer> cb_;
  MetalEncoder encoder_;
  bool committed_ = false;
};

class MetalDevice final : public Device, private KernelLibraries {
 public:
  MetalDevice() {
    @autoreleasepool {
      device_ = MTLCreateSystemDefaultDevice();
      if (!device_) throw std::runtime_error("[metal] no Metal device (MTLCreateSystemDefaultDevice returned nil)");
      check_capabilities();
      queue_ = [device_ newCommandQueue];
      if (!queue_) throw std::runtime_error("[metal] cannot create a command queue on " + gpu_name());
      if (@available(macOS 15.0, *)) {
        MTLResidencySetDescriptor* desc = [MTLResidencySetDescriptor new];
        desc.label = @"lily weights";
        NSError* err = nil;
        id<MTLResidencySet> set = [device_ newResidencySetWithDescriptor:desc error:&err];
        if (set) [queue_ addResidencySet:set];
        else KernelLibraries::warn("[metal] warning: no residency set for the weights: " + describe(err));
        residency_ = set;
      }
      pipelines_.resize(size_t(KernelId::count));
      pipeline_errors_.resize(size_t(KernelId::count));
      init_libraries(wants_tensor_ops());
      compile_all();
    }
  }

  std::string name() const override { return "metal"; }

  std::shared_ptr<Buffer> alloc(uint64_t bytes, Role role, const std::string& label) override {
    @autoreleasepool {
      id<MTLBuffer> b = [device_ newBufferWithLength:NSUInteger(bytes ? bytes : 16) options:MTLResourceStorageModeShared];
      if (!b) throw std::runtime_error("[metal] cannot allocate " + std::to_string(bytes) + " bytes for '" + label + "'");
      b.label = ns(label);
      return tracked(std::make_shared<MetalBuffer>(b.contents, std::vector<MetalBuffer::View>{{0, b}}), bytes, role, label);
    }
  }

  std::shared_ptr<Buffer> wrap(const void* data, uint64_t bytes, Role role, const std::string& label) override {
    @autoreleasepool {
      const uint64_t page = vm_page_size, max_len = uint64_t(device_.maxBufferLength) / page * page;
      std::vector<MetalBuffer::View> views;
      if (reinterpret_cast<uintptr_t>(data) % page == 0) {
        // A mapping covers whole pages, so rounding the length up stays inside it.
        const uint64_t len = (bytes + page - 1) / page * page, stride = std::max(page, max_len / 2 / page * page);
        for (uint64_t begin = 0;; begin += stride) {
          const uint64_t n = std::min(max_len, len - begin);
          id<MTLBuffer> b = [device_ newBufferWithBytesNoCopy:static_cast<uint8_t*>(const_cast<void*>(data)) + begin
                                                       length:NSUInteger(n) options:MTLResourceStorageModeShared
                                                  deallocator:nil];
          if (!b) throw std::runtime_error("[metal] cannot map bytes [" + std::to_string(begin) + ", " +
                                           std::to_string(begin + n) + ") of '" + label + "' as a Metal buffer");
          b.label = ns(label);
          views.push_back({begin, b});
          if (begin + n >= len) break;
        }
      } else {
        if (bytes > max_len)
          throw std::runtime_error("[metal] '" + label + "' (" + gb(bytes) + ") is not page-aligned and exceeds maxBufferLength (" +
                                   gb(max_len) + "): it can be neither mapped nor copied into one buffer");
        id<MTLBuffer> b = [device_ newBufferWithBytes:data length:NSUInteger(bytes) options:MTLResourceStorageModeShared];
        if (!b) throw std::runtime_error("[metal] cannot copy " + std::to_string(bytes) + " bytes of '" + label + "'");
        b.label = ns(label);
        views.push_back({0, b});
      }
      auto buffer = std::make_shared<MetalBuffer>(const_cast<void*>(data), std::move(views));
      if (@available(macOS 15.0, *)) {
        if (residency_ && role == Role::weights) {
          id<MTLResidencySet> set = residency_;
          for (const MetalBuffer::View& v : buffer->views()) [set addAllocation:(id<MTLAllocation>)v.buffer];
          [set commit];
          [set requestResidency];
          buffer->residency = set;
        }
      }
      return labelled(buffer, bytes, role, label);
    }
  }

  std::unique_ptr<CommandBuffer> command_buffer() override {
    @autoreleasepool {
      id<MTLCommandBuffer> cb = [queue_ commandBuffer];
      if (!cb) throw std::runtime_error("[metal] cannot create a command buffer");
      id<MTLComputeCommandEncoder> enc = [cb computeCommandEncoderWithDispatchType:MTLDispatchTypeConcurrent];
      if (!enc) throw std::runtime_error("[metal] cannot create a compute command encoder");
      return std::make_unique<MetalCommandBuffer>(*this, cb, enc, tensor_ops());
    }
  }
  bool has_bf16() const override { return true; }  // check_capabilities refused devices without it
  bool has_tensor_ops() const override { return tensor_ops(); }

  DeviceFacts facts() const override {
    @autoreleasepool {
      DeviceFacts f;
      f.name = name();
      f.gpu = gpu_name();
      f.gpu_family = gpu_family();
      f.msl_version = msl_version();
      const NSOperatingSystemVersion v = NSProcessInfo.processInfo.operatingSystemVersion;
      f.os = "macOS " + std::to_string(v.majorVersion) + "." + std::to_string(v.minorVersion) + "." + std::to_string(v.patchVersion);
      if (@available(macOS 14.0, *)) f.gpu += " (" + std::string(device_.architecture.name.UTF8String) + ")";
      f.bf16 = true;
      f.tensor_ops = tensor_ops();
      f.working_set = device_.recommendedMaxWorkingSetSize;
      f.max_buffer = device_.maxBufferLength;
      f.wired_limit = wired_limit_mb() * 1000000ull;
      return f;
    }
  }

  std::vector<LibraryStatus> build_libraries() override {
    @autoreleasepool {
      return build_all();
    }
  }

  void plan_memory(uint64_t weight_bytes, uint64_t kv_bytes, uint64_t context) override {
    const uint64_t ws = device_.recommendedMaxWorkingSetSize;
    const uint64_t ram = NSProcessInfo.processInfo.physicalMemory;
    // Leave macOS about a quarter of the memory (at least 8 GB) when raising the GPU's limit.
    const uint64_t suggest_mb = (ram - std::max<uint64_t>(ram / 4, 8000000000ull)) / 1000000;
    const std::string remedy = " Remedy: raise the GPU's limit with `sudo sysctl iogpu.wired_limit_mb=" + std::to_string(suggest_mb) +
                               "` (this Mac has " + gb(ram) + "; the setting lasts until reboot), or use a smaller checkpoint.";
    if (weight_bytes > ws) {
      KernelLibraries::warn("[metal] warning: the weights (" + gb(weight_bytes) + ") exceed this GPU's working-set limit (" +
                            gb(ws) + ", recommendedMaxWorkingSetSize): macOS will page weights in and out on every step, "
                            "so decoding will be many times slower, or a command buffer will fail for lack of memory." + remedy);
    } else if (weight_bytes + kv_bytes > ws && context) {
      const uint64_t fits = (ws - weight_bytes) / std::max<uint64_t>(1, kv_bytes / context);
      KernelLibraries::warn("[metal] warning: the weights (" + gb(weight_bytes) + ") fit this GPU's working-set limit (" + gb(ws) +
                            ") but the KV cache at the full context of " + std::to_string(context) + " tokens (" + gb(kv_bytes) +
                            ") does not: beyond about " + std::to_string(fits) + " tokens of context the GPU pages and slows down." +
                            remedy);
    }
  }

  using Device::count;  // for MetalCommandBuffer

  id<MTLComputePipelineState> pipeline(KernelId k) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (id<MTLComputePipelineState> p = pipelines_[size_t(k)]) return p;
    }
    require(k);  // builds it, or throws naming the kernel, its family and the library that failed
    std::lock_guard<std::mutex> lock(mu_);
    return pipelines_[size_t(k)];
  }

 private:
  std::string gpu_name() const { return device_.name.UTF8String; }

  void check_capabilities() const {
    if (![NSProcessInfo.processInfo isOperatingSystemAtLeastVersion:NSOperatingSystemVersion{14, 0, 0}]) {
      const NSOperatingSystemVersion v = NSProcessInfo.processInfo.operatingSystemVersion;
      throw std::runtime_error("[metal] needs macOS 14 or later (Metal Shading Language 3.1, for bfloat); this is macOS " +
                               std::to_string(v.majorVersion) + "." + std::to_string(v.minorVersion));
    }
    if (![device_ supportsFamily:kFamilyApple7])
      throw std::runtime_error("[metal] needs an Apple-silicon GPU (Metal GPU family Apple7: M1 or later) for bfloat and "
                               "simdgroup matrices; " + gpu_name() + " lacks it");
  }

  std::string gpu_family() const {
    std::string f;
    for (int apple = 12; apple >= 7 && f.empty(); --apple)
      if ([device_ supportsFamily:MTLGPUFamily(1000 + apple)]) f = "Apple" + std::to_string(apple);
    if ([device_ supportsFamily:kFamilyMetal4]) f += ", Metal4";
    else if ([device_ supportsFamily:MTLGPUFamilyMetal3]) f += ", Metal3";
    return f;
  }

  static uint64_t wired_limit_mb() {
    uint64_t mb = 0;
    size_t len = sizeof mb;
    if (sysctlbyname("iogpu.wired_limit_mb", &mb, &len, nullptr, 0) != 0) return 0;
    return len == 4 ? uint64_t(uint32_t(mb)) : mb;
  }

  // Neural Accelerators (the M5 generation): see the top of the file. The pipelines decide (compile_all).
  bool wants_tensor_ops() const {
    if (@available(macOS 26.2, *)) {
      if (![device_ supportsFamily:kFamilyMetal4]) return false;
      bool arch_ok = false;
      const std::string arch = device_.architecture.name.UTF8String;  // e.g. "applegpu_g17s"
      const size_t g = arch.rfind("_g");
      if (g != std::string::npos && g + 2 < arch.size()) {
        const int gen = std::atoi(arch.c_str() + g + 2);
        arch_ok = gen >= 17 && (arch.back() != 'p' || gen >= 18);
      }
      if (const char* env = std::getenv("LILY_METAL_TENSOR"); env && *env) arch_ok = std::string(env) != "0";
      return arch_ok;
    }
    return false;
  }

  // KernelLibraries' hooks: one library per embedded metal/*.metal file.
  std::vector<std::string> library_names() const override { return metal_source_files(); }

  std::string compile_library(const std::string& file, bool msl4) override {
    @autoreleasepool {
      MTLCompileOptions* opts = [MTLCompileOptions new];
      if (@available(macOS 15.0, *)) opts.mathMode = MTLMathModeSafe;
      else opts.fastMathEnabled = NO;
      opts.languageVersion = msl4 ? kLanguage4_0 : MTLLanguageVersion3_1;
      NSError* err = nil;
      id<MTLLibrary> lib = [device_ newLibraryWithSource:ns(metal_translation_unit(file)) options:opts error:&err];
      std::lock_guard<std::mutex> lock(mu_);
      for (auto it = function_library_.begin(); it != function_library_.end();)
        it = it->second == file ? function_library_.erase(it) : std::next(it);
      if (!lib) return describe(err);
      libraries_[file] = lib;
      for (NSString* n in lib.functionNames) function_library_[n.UTF8String] = file;
      return "";
    }
  }

  std::string library_of(KernelId k) const override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = function_library_.find(kernel_name(k));
    return it == function_library_.end() ? "" : it->second;
  }

  std::string build_pipeline(KernelId k) override {
    @autoreleasepool {
      const std::string file = library_of(k);
      std::lock_guard<std::mutex> lock(mu_);
      if (pipelines_[size_t(k)]) return "";
      if (!pipeline_errors_[size_t(k)].empty()) return pipeline_errors_[size_t(k)];
      id<MTLFunction> f = [libraries_.at(file) newFunctionWithName:ns(kernel_name(k))];
      NSError* err = nil;
      id<MTLComputePipelineState> p = f ? [device_ newComputePipelineStateWithFunction:f error:&err] : nil;
      if (!p) return pipeline_errors_[size_t(k)] = f ? describe(err) : "metal/" + file + " lost the function";
      pipelines_[size_t(k)] = p;
      return "";
    }
  }

  id<MTLDevice> device_ = nil;
  id<MTLCommandQueue> queue_ = nil;
  id residency_ = nil;  // id<MTLResidencySet> on macOS 15+ (typed where @available allows)
  std::unordered_map<std::string, id<MTLLibrary>> libraries_;       // by file
  std::unordered_map<std::string, std::string> function_library_;   // host name -> file
  std::vector<id<MTLComputePipelineState>> pipelines_;
  std::vector<std::string> pipeline_errors_;
  mutable std::mutex mu_;
};

void MetalEncoder::do_dispatch(gpu::KernelIndex kernel, Grid threadgroups, Grid threads, const void* args,
                               size_t args_size, const std::vector<Binding>& bindings, uint32_t threadgroup_bytes) {
  [enc_ setComputePipelineState:dev_.pipeline(KernelId(kernel))];
  [enc_ setBytes:args length:NSUInteger(args_size) atIndex:0];
  for (const Binding& b : bindings) {
    const auto [buffer, offset] = static_cast<const MetalBuffer*>(b.buffer)->bind(b.offset, b.bytes);
    [enc_ setBuffer:buffer offset:NSUInteger(offset) atIndex:NSUInteger(b.slot)];
  }
  if (threadgroup_bytes) [enc_ setThreadgroupMemoryLength:NSUInteger((threadgroup_bytes + 15u) & ~15u) atIndex:0];
  [enc_ dispatchThreadgroups:MTLSizeMake(threadgroups.x, threadgroups.y, threadgroups.z)
       threadsPerThreadgroup:MTLSizeMake(threads.x, threads.y, threads.z)];
}

uint32_t MetalEncoder::max_threads(gpu::KernelIndex kernel) const {
  return uint32_t(dev_.pipeline(KernelId(kernel)).maxTotalThreadsPerThreadgroup);
}

uint32_t MetalEncoder::static_threadgroup_bytes(gpu::KernelIndex kernel) const {
  return uint32_t(dev_.pipeline(KernelId(kernel)).staticThreadgroupMemoryLength);
}

void MetalCommandBuffer::commit() {
  if (committed_) throw std::logic_error("[metal] command buffer committed twice");
  committed_ = true;
  @autoreleasepool {
    encoder_.end();
    [cb_ commit];
  }
  dev_.count(encoder_.recorded());
}

void MetalCommandBuffer::wait() {
  if (!committed_) throw std::logic_error("[metal] wait on a command buffer that was not committed");
  @autoreleasepool {
    [cb_ waitUntilCompleted];
    Counters c;
    c.cpu_waits = 1;
    dev_.count(c);
    if (cb_.status == MTLCommandBufferStatusError) throw std::runtime_error("[metal] command buffer failed: " + describe(cb_.error));
  }
}

}  // namespace

std::unique_ptr<Device> make_metal_device() { return std::make_unique<MetalDevice>(); }

}  // namespace lily::metal
