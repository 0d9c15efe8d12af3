// The MoE family's scratch (declared opaque in encoders.h, defined here so the family's test entry points,
// csrc/bindings/kernels_moe.cpp, can read the routing intermediates). Allocated once for max_rows by
// make_moe_scratch (moe.cpp); every buffer is device memory that no CPU code touches during a layer.
#pragma once
#include <memory>

#include "encoders.h"

namespace lily::metal {

struct MoeScratch {
  int max_rows = 0, experts = 0, top_k = 0, hidden = 0, inter = 0, shared_inter = 0;
  std::shared_ptr<Buffer> none;          // 16 bytes never written: bound to slots a dispatch does not read
  std::shared_ptr<Buffer> logits;        // f32 [max_rows, E] router logits
  std::shared_ptr<Buffer> shared_logit;  // f32 [max_rows] shared expert gate logits (before the sigmoid)
  std::shared_ptr<Buffer> hist;          // uint [E] histogram, zero between uses
  std::shared_ptr<Buffer> offsets;       // int32 [E + 1] first slot of each expert's group
  std::shared_ptr<Buffer> cursor;        // uint [E] scatter cursors
  std::shared_ptr<Buffer> blocks;        // int4 [1 + LILY_MOE_MAX_BLOCKS(n, E, 16)] block map
  std::shared_ptr<Buffer> slot_token;    // int32 [n] token of each slot
  std::shared_ptr<Buffer> slot_weight;   // f32 [n] routing weight of each slot
  std::shared_ptr<Buffer> slot_of;       // int32 [n] slot of each assignment t*k + j
  std::shared_ptr<Buffer> h;             // bf16 [n, I] routed SwiGLU outputs (decode: [k + 1, max(I, I_s)])
  std::shared_ptr<Buffer> gu;            // bf16 [k + 1, 2, max(I, I_s)] decode gate / up rows (Fusions::expert_swiglu off)
  std::shared_ptr<Buffer> hs;            // bf16 [max_rows, I_s] shared expert SwiGLU outputs
  std::shared_ptr<Buffer> y;             // f32 [n, H] weighted routed outputs by slot (decode with
                                         // Fusions::expert_combine off: [k + 1, H] unweighted, shared last)
  std::shared_ptr<Buffer> ys;            // f32 [max_rows, H] gated shared expert outputs
};

// The grouped-GEMM tile height for n = T*k assignments over E experts (the rule in moe.cpp).
int moe_tile_rows(int n, int experts);

}  // namespace lily::metal
