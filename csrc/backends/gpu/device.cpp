// The shared half of the Device interface (device.h): the Encoder's derived barriers, Counters, roles, the
// memory ledger. Previous hop: a backend's encoders (backends/metal: common.cpp, dense.cpp, moe.cpp, gdn.cpp,
// attn.cpp) call Encoder::dispatch with the bindings they declare; next hop: the Device's do_dispatch /
// do_barrier (backends/metal: device_emu.cpp, device_metal.mm).
//
// A barrier is a hazard check, as in ggml-metal-ops.cpp: the current stage remembers the byte ranges its
// dispatches read and wrote since the last barrier. A new dispatch that reads a range the stage wrote
// (read-after-write), writes a range the stage read or wrote (write-after-read/-write) ends the stage.
// Reads of the same range never do: two readers may run concurrently.
#include "device.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

namespace lily::gpu {

const char* role_name(Role r) {
  switch (r) {
    case Role::weights: return "weights";
    case Role::kv: return "kv";
    case Role::state: return "state";
    case Role::activations: return "activations";
    case Role::io: return "io";
    case Role::count: break;
  }
  return "?";
}

Buffer::~Buffer() {
  if (ledger) ledger->release(role, size);
}

void MemoryLedger::add(Role r, uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  m_.live[size_t(r)] += bytes;
  m_.live_total += bytes;
  m_.peak[size_t(r)] = std::max(m_.peak[size_t(r)], m_.live[size_t(r)]);
  m_.peak_total = std::max(m_.peak_total, m_.live_total);
}

void MemoryLedger::release(Role r, uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  m_.live[size_t(r)] -= bytes;
  m_.live_total -= bytes;
}

Memory MemoryLedger::memory() const {
  std::lock_guard<std::mutex> lock(mu_);
  return m_;
}

void MemoryLedger::reset_peak() {
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t r = 0; r < size_t(Role::count); ++r) m_.peak[r] = m_.live[r];
  m_.peak_total = m_.live_total;
}

namespace {
uint8_t* cpu_view(View v) {
  auto* base = static_cast<uint8_t*>(v.buffer->contents());
  if (!base) throw std::logic_error("[device] buffer '" + v.buffer->label + "' has no CPU view");
  return base + v.offset;
}
}  // namespace

void Device::write(View dst, const void* src, uint64_t bytes) {
  if (bytes) std::memcpy(cpu_view(dst), src, bytes);
}
void Device::read(View src, void* dst, uint64_t bytes) {
  if (bytes) std::memcpy(dst, cpu_view(src), bytes);
}
void Device::copy(View dst, View src, uint64_t bytes) {
  if (bytes) std::memcpy(cpu_view(dst), cpu_view(src), bytes);
}
void Device::zero(View dst, uint64_t bytes) {
  if (bytes) std::memset(cpu_view(dst), 0, bytes);
}

Counters Device::counters() const {
  std::lock_guard<std::mutex> lock(mu_);
  return counters_;
}

void Device::reset_counters() {
  std::lock_guard<std::mutex> lock(mu_);
  counters_ = Counters{};
}

void Device::count(const Counters& c) {
  std::lock_guard<std::mutex> lock(mu_);
  counters_.add(c);
}

std::shared_ptr<Buffer> Device::labelled(std::shared_ptr<Buffer> b, uint64_t bytes, Role role, const std::string& label) {
  b->size = bytes;
  b->role = role;
  b->label = label;
  return b;
}

std::shared_ptr<Buffer> Device::tracked(std::shared_ptr<Buffer> b, uint64_t bytes, Role role, const std::string& label) {
  labelled(b, bytes, role, label);
  ledger_->add(role, bytes);
  b->ledger = ledger_;
  return b;
}

void Counters::add(const Counters& o) {
  dispatches += o.dispatches;
  stages += o.stages;
  cpu_waits += o.cpu_waits;
  cpu_waits_in_step += o.cpu_waits_in_step;
  cpu_waits_drained += o.cpu_waits_drained;
  command_buffers += o.command_buffers;
  for (size_t i = 0; i < size_t(Role::count); ++i) {
    bytes_read[i] += o.bytes_read[i];
    bytes_written[i] += o.bytes_written[i];
  }
  for (size_t k = 0; k < kMaxKernels; ++k) kernel_dispatches[k] += o.kernel_dispatches[k];
}

Counters Counters::since(const Counters& e) const {
  Counters d;
  d.dispatches = dispatches - e.dispatches;
  d.stages = stages - e.stages;
  d.cpu_waits = cpu_waits - e.cpu_waits;
  d.cpu_waits_in_step = cpu_waits_in_step - e.cpu_waits_in_step;
  d.cpu_waits_drained = cpu_waits_drained - e.cpu_waits_drained;
  d.command_buffers = command_buffers - e.command_buffers;
  for (size_t r = 0; r < size_t(Role::count); ++r) {
    d.bytes_read[r] = bytes_read[r] - e.bytes_read[r];
    d.bytes_written[r] = bytes_written[r] - e.bytes_written[r];
  }
  for (size_t k = 0; k < kMaxKernels; ++k) d.kernel_dispatches[k] = kernel_dispatches[k] - e.kernel_dispatches[k];
  return d;
}

Counters Encoder::recorded() const {
  Counters c;
  c.command_buffers = 1;
  c.dispatches = dispatches_;
  c.stages = dispatches_ ? barriers_ + 1 : 0;
  std::copy(std::begin(per_kernel_), std::end(per_kernel_), std::begin(c.kernel_dispatches));
  return c;
}

namespace {
bool overlaps(const Buffer* b, uint64_t begin, uint64_t end, const Buffer* b2, uint64_t begin2, uint64_t end2) {
  return b == b2 && begin < end2 && begin2 < end;
}
}  // namespace

void Encoder::dispatch(KernelIndex kernel, Grid threadgroups, Grid threads, const void* args, size_t args_size,
                       std::initializer_list<Binding> bindings, uint32_t threadgroup_bytes) {
  std::vector<Binding> list(bindings);
  bool hazard = false;
  for (const Binding& b : list) {
    if (!b.buffer)
      throw std::invalid_argument(std::string("[encoder] ") + kernel_label(kernel) + ": buffer slot " +
                                  std::to_string(b.slot) + " is null");
    if (b.slot <= 0)
      throw std::invalid_argument(std::string("[encoder] ") + kernel_label(kernel) + ": slot " +
                                  std::to_string(b.slot) + " (slot 0 holds the args struct)");
    const uint64_t begin = b.offset;
    const uint64_t end = b.bytes ? b.offset + b.bytes : b.buffer->size;
    if (begin > b.buffer->size || end > b.buffer->size)
      throw std::out_of_range(std::string("[encoder] ") + kernel_label(kernel) + ": slot " + std::to_string(b.slot) +
                              " range [" + std::to_string(begin) + ", " + std::to_string(end) + ") exceeds buffer '" +
                              b.buffer->label + "' of " + std::to_string(b.buffer->size) + " bytes");
    const bool writes = b.access != Access::read;
    for (const Range& r : stage_writes_) hazard = hazard || overlaps(r.buffer, r.begin, r.end, b.buffer, begin, end);
    if (writes)
      for (const Range& r : stage_reads_) hazard = hazard || overlaps(r.buffer, r.begin, r.end, b.buffer, begin, end);
  }
  const uint64_t n = uint64_t(threads.x) * threads.y * threads.z, limit = max_threads(kernel);
  if (n > limit)
    throw std::invalid_argument(std::string("[encoder] ") + kernel_label(kernel) + ": " + std::to_string(n) +
                                " threads per threadgroup, the device allows " + std::to_string(limit) +
                                " for this kernel");
  const uint64_t tg_static = static_threadgroup_bytes(kernel), tg_dynamic = (uint64_t(threadgroup_bytes) + 15) & ~15ull;
  if (tg_static + tg_dynamic > max_threadgroup_memory())
    throw std::invalid_argument(std::string("[encoder] ") + kernel_label(kernel) + ": " + std::to_string(tg_static) +
                                " bytes of static threadgroup memory + " + std::to_string(tg_dynamic) +
                                " set by the host exceed the " + std::to_string(max_threadgroup_memory()) +
                                "-byte limit per threadgroup");
  if (hazard) barrier();
  for (const Binding& b : list) {
    const Range r{b.buffer, b.offset, b.bytes ? b.offset + b.bytes : b.buffer->size};
    (b.access == Access::read ? stage_reads_ : stage_writes_).push_back(r);
    if (b.access == Access::read_write) stage_reads_.push_back(r);
  }
  ++dispatches_;
  if (kernel >= kMaxKernels) throw std::out_of_range(std::string("[encoder] kernel index of ") + kernel_label(kernel) +
                                                     " beyond the counters' kMaxKernels");
  ++per_kernel_[kernel];
  do_dispatch(kernel, threadgroups, threads, args, args_size, list, threadgroup_bytes);
}

uint32_t Encoder::max_threads(KernelIndex) const { return 1024; }

uint32_t Encoder::static_threadgroup_bytes(KernelIndex) const { return 0; }

void Encoder::barrier() {
  // A barrier with nothing recorded before it in the stage orders nothing: it is dropped, so the stage
  // count (barriers + 1) stays the number of real dependency stages.
  if (stage_reads_.empty() && stage_writes_.empty()) return;
  stage_reads_.clear();
  stage_writes_.clear();
  ++barriers_;
  do_barrier();
}

}  // namespace lily::gpu
