// The Metal backend: the schedule's ops (schedule/backend.h) recorded as Metal kernels through the family
// encoders (encoders.h) on a Device (device.h: MetalDevice on a Mac, EmuDevice anywhere). Previous hop:
// csrc/schedule/schedule.cpp calls the Backend ops; next hop: encode_* in common/dense/moe/gdn/attn.cpp.
// One command buffer per prefill chunk or decode step; read_logits is the only CPU wait.
#pragma once
#include <memory>

#include "../../schedule/backend.h"
#include "device.h"

namespace lily::metal {

enum class Phase : uint8_t { prefill, decode };

class MetalBackend : public lily::Backend {
 public:
  // What the device spent on the last prefill chunk / decode step (cumulative = every one since creation).
  virtual Counters counters(Phase phase, bool cumulative) const = 0;
  virtual Device& device() = 0;
};

// `max_rows`: rows one prefill chunk may have (activation buffers are sized for it).
std::unique_ptr<MetalBackend> make_metal_backend(const Model& model, std::unique_ptr<Device> device, int max_rows);

}  // namespace lily::metal
