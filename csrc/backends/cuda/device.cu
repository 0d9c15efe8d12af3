// CudaDevice (device.h): buffers, command buffers and the CPU's copies on one CUDA stream.
#include "device.h"

#include <algorithm>
#include <iterator>
#include <stdexcept>

namespace lily::cuda {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("[cuda] ") + what + ": " + cudaGetErrorString(e));
}
#define CK(call) check((call), #call)

BlockCache::~BlockCache() {
  for (auto& [base, slab] : slabs_) cudaFree(base);
}

void BlockCache::release_free_slabs() {
  for (auto it = slabs_.begin(); it != slabs_.end();) {
    Slab& slab = *it->second;
    if (slab.held) {
      ++it;
      continue;
    }
    for (uint64_t i = 0; i < slab.blocks; ++i) slab_of_.erase(static_cast<uint8_t*>(slab.base) + i * slab.stride);
    cudaFree(slab.base);
    it = slabs_.erase(it);
  }
  // the blocks left in free_ are those of slabs still held
  for (auto it = free_.begin(); it != free_.end();) it = slab_of_.count(it->second) ? std::next(it) : free_.erase(it);
  cached_ = 0;
  for (auto& [bytes, p] : free_) cached_ += bytes;
}

void* BlockCache::allocate(uint64_t bytes, uint64_t blocks) {
  const uint64_t stride = (bytes + 255) & ~uint64_t(255);  // every block as aligned as cudaMalloc's own
  void* base = nullptr;
  if (cudaMalloc(&base, stride * blocks) != cudaSuccess) {
    cudaGetLastError();  // the failed allocation's error is not sticky
    return nullptr;
  }
  auto slab = std::make_unique<Slab>(Slab{base, stride, blocks, 1});
  for (uint64_t i = 0; i < blocks; ++i) {
    void* p = static_cast<uint8_t*>(base) + i * stride;
    slab_of_[p] = slab.get();
    if (i) free_.emplace(bytes, p), cached_ += bytes;
  }
  slabs_.emplace(base, std::move(slab));
  return base;
}

void* BlockCache::take(uint64_t bytes, bool batch, const std::string& label) {
  if (!bytes) return nullptr;
  std::lock_guard<std::mutex> lock(mu_);
  if (auto it = free_.find(bytes); it != free_.end()) {
    void* p = it->second;
    free_.erase(it);
    cached_ -= bytes;
    ++slab_of_.at(p)->held;
    return p;
  }
  const uint64_t blocks = batch ? std::max<uint64_t>(1, std::min(kBatchBlocks, kSlabBytes / bytes)) : 1;
  void* p = allocate(bytes, blocks);
  if (!p) {  // retry with the cache's free slabs released, then with one block
    release_free_slabs();
    p = allocate(bytes, blocks);
    if (!p && blocks > 1) p = allocate(bytes, 1);
  }
  if (!p)
    throw std::runtime_error("[cuda] cannot allocate " + std::to_string(bytes) + " bytes of device memory for '" +
                             label + "'");
  return p;
}

void BlockCache::give(void* p, uint64_t bytes) {
  if (!p) return;
  std::lock_guard<std::mutex> lock(mu_);
  free_.emplace(bytes, p);
  cached_ += bytes;
  --slab_of_.at(p)->held;
}

uint64_t BlockCache::cached_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return cached_;
}

// The stream's work since the previous commit: commit() marks its end with an event, wait() waits for it.
class CudaCommandBuffer final : public gpu::CommandBuffer {
 public:
  explicit CudaCommandBuffer(CudaDevice& dev) : dev_(dev) {
    CK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
  }
  ~CudaCommandBuffer() override { cudaEventDestroy(done_); }  // (released once it completes, if pending)
  gpu::Encoder& encoder() override {
    throw std::logic_error("[cuda] no gpu::Encoder: the CUDA backend's ops launch their kernels on the stream");
  }
  void commit() override {
    CK(cudaEventRecord(done_, dev_.stream()));
    dev_.count_command_buffer();
  }
  void wait() override {
    CK(cudaEventSynchronize(done_));
    dev_.count_wait();
  }

 private:
  CudaDevice& dev_;
  cudaEvent_t done_ = nullptr;
};

CudaDevice::CudaDevice() {
  CK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&read_stream_, cudaStreamNonBlocking));
  CK(cudaEventCreateWithFlags(&host_ops_, cudaEventDisableTiming));
}

CudaDevice::~CudaDevice() {
  cudaStreamSynchronize(stream_);
  cudaEventDestroy(host_ops_);
  cudaStreamDestroy(read_stream_);
  cudaStreamDestroy(stream_);
}

std::shared_ptr<gpu::Buffer> CudaDevice::alloc(uint64_t bytes, gpu::Role role, const std::string& label) {
  const bool batch = role == gpu::Role::kv || role == gpu::Role::state;  // what a clone allocates
  return tracked(std::make_shared<CudaBuffer>(blocks_->take(bytes, batch, label), bytes, blocks_), bytes, role, label);
}

std::shared_ptr<gpu::Buffer> CudaDevice::wrap(const void*, uint64_t, gpu::Role, const std::string& label) {
  throw std::logic_error("[cuda] wrap('" + label + "'): device memory maps no host memory; weights are uploaded");
}

std::unique_ptr<gpu::CommandBuffer> CudaDevice::new_command_buffer() { return std::make_unique<CudaCommandBuffer>(*this); }

// Host-to-device copies from pageable memory are staged before cudaMemcpyAsync returns, so `src` may go.
void CudaDevice::write(gpu::View dst, const void* src, uint64_t bytes) {
  if (!bytes) return;
  CK(cudaMemcpyAsync(device_ptr<uint8_t>(dst), src, bytes, cudaMemcpyHostToDevice, stream_));
  written();
}

void CudaDevice::read(gpu::View src, void* dst, uint64_t bytes) {
  if (!bytes) return;
  CK(cudaEventSynchronize(host_ops_));
  CK(cudaMemcpyAsync(dst, device_ptr<uint8_t>(src), bytes, cudaMemcpyDeviceToHost, read_stream_));
  CK(cudaStreamSynchronize(read_stream_));
}

void CudaDevice::copy(gpu::View dst, gpu::View src, uint64_t bytes) {
  if (!bytes) return;
  CK(cudaMemcpyAsync(device_ptr<uint8_t>(dst), device_ptr<uint8_t>(src), bytes, cudaMemcpyDeviceToDevice, stream_));
  written();
}

void CudaDevice::zero(gpu::View dst, uint64_t bytes) {
  if (!bytes) return;
  CK(cudaMemsetAsync(device_ptr<uint8_t>(dst), 0, bytes, stream_));
  written();
}

void CudaDevice::written() { CK(cudaEventRecord(host_ops_, stream_)); }

void CudaDevice::count_command_buffer() {
  gpu::Counters c;
  c.command_buffers = 1;
  c.dispatches = c.stages = launches_;
  launches_ = 0;
  count(c);
}

void CudaDevice::count_wait() {
  gpu::Counters c;
  c.cpu_waits = 1;
  count(c);
}

}  // namespace lily::cuda
