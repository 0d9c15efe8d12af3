// The CUDA flavour of the GPU Device interface (backends/gpu/device.h), under CudaBackend as MetalDevice is
// under MetalBackend: device memory by role through the shared ledger, one stream every command buffer records
// on (a command buffer is the stream's work between two commits, completing on an event), and the CPU's bytes
// moved with stream-ordered copies, since this memory has no CPU view. CUDA kernels are launched by the
// backend's ops in stream order, not recorded through gpu::Encoder (whose derived barriers a stream does not
// need): encoder() refuses, and the backend counts its launches as dispatches (launched).
#pragma once
#include <cuda_runtime.h>

#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "../gpu/device.h"

namespace lily::cuda {

// Throws std::runtime_error naming the call and CUDA's message when e is not cudaSuccess.
void check(cudaError_t e, const char* what);

// Device memory a buffer frees goes back here, by exact size, for the next alloc of that size, and is released
// only when an allocation fails or the last buffer and device are gone. cudaFree waits for the whole device:
// dropping a session snapshot (~140 buffers) would stall the decode step in flight, and a clone's cudaMallocs
// cost milliseconds a turn (H100, synthetic:full at 4K: a fork 4.4 → 1.1 ms, a one-token turn, which copies
// the state twice, 17.5 → 9.6 ms, a 64-token generation timed whole as `lily bench` does 451 → 483 tok/s).
// Reuse needs no wait: every use of device memory is ordered on the device's one stream (kernels, graphs,
// copies, zeroing), so a block's new owner's work runs after its old owner's, and read() copies synchronously.
// Buffers may be freed on any thread (a Python session dropped by the GC).
//
// The cache is cold whenever every block of a size is held, as when an agent's turns keep their snapshots alive:
// then each clone would cudaMalloc its ~140 buffers again. So a miss for a state's or KV cache's buffer (`batch`)
// allocates a slab of up to kBatchBlocks blocks of that size (at most kSlabBytes) with one cudaMalloc and caches
// the rest. A slab is freed only whole, when none of its blocks is held.
class BlockCache {
 public:
  static constexpr uint64_t kSlabBytes = 64ull << 20;
  static constexpr uint64_t kBatchBlocks = 32;
  ~BlockCache();
  void* take(uint64_t bytes, bool batch, const std::string& label);  // throws, naming `label`, when the device is full
  void give(void* p, uint64_t bytes);
  uint64_t cached_bytes() const;

 private:
  struct Slab {
    void* base;
    uint64_t stride, blocks, held;  // held: its blocks some buffer owns now
  };
  void* allocate(uint64_t bytes, uint64_t blocks);  // a new slab under mu_; null when the device is full
  void release_free_slabs();  // cudaFree of every slab none of whose blocks is held (before allocating again)
  mutable std::mutex mu_;
  std::unordered_multimap<uint64_t, void*> free_;  // by block size
  std::unordered_map<void*, Slab*> slab_of_;       // every block's slab
  std::unordered_map<void*, std::unique_ptr<Slab>> slabs_;  // by base
  uint64_t cached_ = 0;
};

class CudaBuffer final : public gpu::Buffer {
 public:
  CudaBuffer(void* device_ptr, uint64_t bytes, std::shared_ptr<BlockCache> cache)
      : ptr(device_ptr), bytes_(bytes), cache_(std::move(cache)) {}
  ~CudaBuffer() override { cache_->give(ptr, bytes_); }
  void* contents() override { return nullptr; }  // device memory: no CPU view
  void* const ptr;

 private:
  const uint64_t bytes_;
  const std::shared_ptr<BlockCache> cache_;
};

// A view's device address as T*.
template <class T>
T* device_ptr(gpu::View v) {
  return reinterpret_cast<T*>(static_cast<uint8_t*>(static_cast<CudaBuffer*>(v.buffer)->ptr) + v.offset);
}

class CudaDevice final : public gpu::Device {
 public:
  CudaDevice();
  ~CudaDevice() override;
  std::string name() const override { return "cuda"; }
  std::shared_ptr<gpu::Buffer> alloc(uint64_t bytes, gpu::Role role, const std::string& label) override;
  // The CUDA backend copies the tensors it uses into device memory (CudaBackend::upload_weights): no mapping.
  std::shared_ptr<gpu::Buffer> wrap(const void* data, uint64_t bytes, gpu::Role role, const std::string& label) override;
  std::unique_ptr<gpu::CommandBuffer> new_command_buffer() override;
  void write(gpu::View dst, const void* src, uint64_t bytes) override;
  void read(gpu::View src, void* dst, uint64_t bytes) override;
  void copy(gpu::View dst, gpu::View src, uint64_t bytes) override;
  void zero(gpu::View dst, uint64_t bytes) override;
  uint64_t cached_bytes() const override { return blocks_->cached_bytes(); }

  cudaStream_t stream() const { return stream_; }
  // Kernels the backend launched into the command buffer being recorded (each a dependency stage: the stream
  // orders them), counted when it commits, as Metal counts an encoder's dispatches: GpuBackend::commit may first
  // wait for an older command buffer and account that wait to the older one's phase.
  void launched(uint64_t n) { launches_ += n; }

 private:
  friend class CudaCommandBuffer;
  void count_command_buffer();  // and the launches recorded for it
  void count_wait();
  void written();  // after a stream-ordered write, copy or zero: read() waits for them

  cudaStream_t stream_ = nullptr;
  // read() copies on a stream of its own, so a read of a finished step's token does not queue behind the step
  // in flight after it; host_ops_ marks the last write, copy or zero on stream_, which it waits for first.
  cudaStream_t read_stream_ = nullptr;
  cudaEvent_t host_ops_ = nullptr;
  uint64_t launches_ = 0;  // launched() since the last commit
  std::shared_ptr<BlockCache> blocks_ = std::make_shared<BlockCache>();
};

}  // namespace lily::cuda
