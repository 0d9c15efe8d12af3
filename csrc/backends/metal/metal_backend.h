// The Metal backend: a GpuBackend (backends/gpu/gpu_backend.h) whose ops are Metal kernels recorded through
// the family encoders (encoders.h) on a metal::Device (device.h: MetalDevice on a Mac, EmuDevice anywhere).
#pragma once
#include <memory>

#include "../gpu/gpu_backend.h"
#include "device.h"

namespace lily::metal {

// The Metal backend's own choices (the schedule's fusions are lily::Fusions, backend.h).
// From Python: lily.Engine(ckpt, backend="metal-emu", metal_options={"gqa_pack": False, ...}).
struct MetalOptions {
  // GQA packing: LILY_ATTN_PACK_HEADS query heads of one KV head per threadgroup. Off: one head each.
  bool gqa_pack = true;
  // Decode attention path: 0 automatic (split-KV at >= LILY_ATTN_SPLIT_MIN_CONTEXT for d 256, GQA 8),
  // 1 always the general path, 2 always the fixed-block split path + merge.
  int attn_path = 0;
  // Routing stays on the GPU. Off (the CPU-wait ablation): decode commits after the top-k, waits, reads the
  // expert ids back and encodes the expert GEMVs in a second command buffer (the route is then not fused).
  bool gpu_routing = true;
  // Prefill grouped-GEMM tile rows: 0 the rule of moe_tile_rows (32 from 32 rows per expert), or 16 / 32.
  int moe_tile_rows = 0;
  // Decode with two command buffers in flight: Generation commits step n + 1 before it waits for step n's
  // token (rolling that step back when the token ends the generation). Off: one step at a time, the GPU
  // idle while the CPU reads each token and encodes the next step.
  bool pipeline = true;
};

// `max_rows`: rows one prefill chunk may have (activation buffers are sized for it).
std::unique_ptr<gpu::GpuBackend> make_metal_backend(const Model& model, std::unique_ptr<Device> device, int max_rows,
                                                    const MetalOptions& options = {});

}  // namespace lily::metal
