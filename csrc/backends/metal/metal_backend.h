// The Metal backend: the schedule's ops (schedule/backend.h) recorded as Metal kernels through the family
// encoders (encoders.h) on a Device (device.h: MetalDevice on a Mac, EmuDevice anywhere). Previous hop:
// csrc/schedule/schedule.cpp calls the Backend ops; next hop: encode_* in common/dense/moe/gdn/attn.cpp.
// One command buffer per prefill chunk or decode step; no CPU wait inside one (counters: cpu_waits_in_step).
#pragma once
#include <memory>

#include "../../schedule/backend.h"
#include "device.h"

namespace lily::metal {

enum class Phase : uint8_t { prefill, decode };

// Switches of the optimisations the write-up measured, for matched ablations (docs/performance.md shows what
// each changes in the counters; tests/test_metal_goals.py that each gives the same outputs). Defaults: all on.
// From Python: lily.Engine(ckpt, backend="metal-emu", metal_options={"fuse_route": False, ...}).
struct MetalOptions {
  // Decode: each input RMSNorm fused into the projections that consume it, the projections sharing an input
  // (GDN qkv/z/b/a, attention q/k/v) in one dispatch, the final norm fused into lm_head (proj_norm).
  // Off: rmsnorm + one qgemv per matrix.
  bool fuse_norm_project = true;
  // Decode: post-norm + router + shared-expert gate logits in one dispatch, top-k inside the experts' gate/up
  // GEMV. Off: rmsnorm, router logits, top-k, shared-gate logit as separate dispatches.
  bool fuse_route = true;
  // Decode: q/k RMSNorm + RoPE + KV-row write inside the attention kernel. Off: attn_prepare first.
  bool fuse_attn_prepare = true;
  // Decode: the experts' gate/up GEMV applies SwiGLU before storing h. Off: gate and up rows go to scratch and
  // moe_gemv_swiglu makes h in a separate pass.
  bool fuse_expert_swiglu = true;
  // Decode: the experts' down GEMV applies the routing weights and the shared expert's sigmoid gate and adds
  // into x. Off: each expert's (and the shared expert's) product goes to scratch and moe_combine_weighted
  // applies the weights and adds.
  bool fuse_expert_combine = true;
  // Decode: the GDN step (conv + SiLU, q/k l2-norm, gates, delta rule, gated norm) as the one gdn_step kernel.
  // Off: the prefill kernels at T = 1 (gdn_conv, gdn_scan, gdn_gated_norm), intermediates through memory.
  bool fuse_gdn_step = true;
  // Decode: the dense projections (and lm_head) read 4/8-bit weights and dequantise in registers. Off: each
  // quantised matrix is first written as a bf16 copy into scratch (qgemv_dequant_*) that the bf16 GEMV then
  // reads (with fuse_norm_project on, proj_norm reads the copies). Experts and router are unchanged.
  bool fuse_dequant = true;
  // GQA packing: LILY_ATTN_PACK_HEADS query heads of one KV head per threadgroup. Off: one head each.
  bool gqa_pack = true;
  // Decode attention path: 0 automatic (split-KV at >= LILY_ATTN_SPLIT_MIN_CONTEXT for d 256, GQA 8),
  // 1 always the general path, 2 always the fixed-block split path + merge.
  int attn_path = 0;
  // Routing stays on the GPU. Off (the CPU-wait ablation): decode commits after the top-k, waits, reads the
  // expert ids back and encodes the expert GEMVs in a second command buffer.
  bool gpu_routing = true;
  // Prefill grouped-GEMM tile rows: 0 the rule of moe_tile_rows (32 from 32 rows per expert), or 16 / 32.
  int moe_tile_rows = 0;
  // Decode with two command buffers in flight: Generation commits step n + 1 before it waits for step n's
  // token (rolling that step back when the token ends the generation). Off: one step at a time, the GPU
  // idle while the CPU reads each token and encodes the next step.
  bool pipeline = true;
};

class MetalBackend : public lily::Backend {
 public:
  // What the device spent on the last prefill chunk / decode step (cumulative = every one since creation).
  virtual Counters counters(Phase phase, bool cumulative) const = 0;
  virtual Device& device() = 0;
};

// `max_rows`: rows one prefill chunk may have (activation buffers are sized for it).
std::unique_ptr<MetalBackend> make_metal_backend(const Model& model, std::unique_ptr<Device> device, int max_rows,
                                                const MetalOptions& options = {});

}  // namespace lily::metal
