// The one place host and shader meet: one <Family>Args struct per kernel family, buffer-slot enums,
// tile sizes. Included by metal/*.metal and by the host encoders in csrc/backends/metal/.
// Type rule (ggml's): element counts are int32, byte strides and offsets uint64.
// Every kernel takes `constant <X>Args& args [[buffer(0)]]`; its other buffers use the slots of its enum.
#pragma once

#ifdef __METAL_VERSION__
#include <metal_stdlib>
typedef int lily_i32;
typedef uint lily_u32;
typedef ulong lily_u64;
#define LILY_CONSTANT constant constexpr
#else
#include <cstdint>
typedef int32_t lily_i32;
typedef uint32_t lily_u32;
typedef uint64_t lily_u64;
#define LILY_CONSTANT inline constexpr
#endif

// Weight formats of dense and expert matrices (MLX affine groups of 64 with bf16 scales/biases, or bf16).
enum LilyWeightFormat : lily_i32 { LILY_W_Q4 = 0, LILY_W_Q8 = 1, LILY_W_BF16 = 2 };

LILY_CONSTANT lily_i32 LILY_SIMD_WIDTH = 32;
LILY_CONSTANT lily_i32 LILY_QGROUP = 64;  // quantisation group size of every quantised Qwen3.6 checkpoint

// ---- family: common (embed, rmsnorm, sample) ----
// ---- end common ----

// ---- family: qgemv / qgemm (dense projections) ----
// ---- end dense ----

// ---- family: moe ----
// ---- end moe ----

// ---- family: gdn ----
// ---- end gdn ----

// ---- family: attn ----
// ---- end attn ----
