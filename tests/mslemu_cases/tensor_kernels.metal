// Metal 4 tensor ops (MetalPerformancePrimitives matmul2d) as the emulator's tensor shim runs them:
// tests/test_mslemu.py checks them against numpy. Built at MSL 4.0 (the cases library's METAL_VERSION).
#include <metal_stdlib>
#include <metal_tensor>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>

using namespace metal;
using namespace mpp::tensor_ops;

// C [M, N] f32 = A [M, K] x B^T (B stored [N, K]), straight from device tensors; 16 x 32 tiles per
// threadgroup of 4 simdgroups, dynamic k, edge tiles clipped by the tensors' extents.
template <typename T>
kernel void mm2d_device_nt(device float* c [[buffer(0)]], device T* a [[buffer(1)]], device T* b [[buffer(2)]],
                           constant int3& mnk [[buffer(3)]], uint2 tg [[threadgroup_position_in_grid]]) {
  const int M = mnk.x, N = mnk.y, K = mnk.z;
  auto tA = tensor<device T, dextents<int32_t, 2>, tensor_inline>(a, dextents<int32_t, 2>(K, M));
  auto tB = tensor<device T, dextents<int32_t, 2>, tensor_inline>(b, dextents<int32_t, 2>(K, N));
  auto tC = tensor<device float, dextents<int32_t, 2>, tensor_inline>(c, dextents<int32_t, 2>(N, M));
  constexpr auto desc = matmul2d_descriptor(16, 32, dynamic_length_v<int>, false, true, false);
  matmul2d<desc, execution_simdgroups<4>> mm;
  auto mA = tA.slice(0, int(tg.y) * 16);
  auto mB = tB.slice(0, int(tg.x) * 32);
  auto mC = tC.slice(int(tg.x) * 32, int(tg.y) * 16);
  mm.run(mA, mB, mC);
}
template [[host_name("mm2d_device_nt_bf16")]] [[kernel]] decltype(mm2d_device_nt<bfloat>) mm2d_device_nt<bfloat>;
template [[host_name("mm2d_device_nt_f16")]] [[kernel]] decltype(mm2d_device_nt<half>) mm2d_device_nt<half>;

// D [M, N] = bias [M, N] + A^T x B for A stored [K, M] (transpose_left) and B [K, N], accumulated in an fp32
// cooperative tensor over static 8-deep k steps of threadgroup copies; one 32 x 16 tile per threadgroup of one
// simdgroup (execution_simdgroup); the bias comes in through cooperative_tensor::load, the result leaves
// through store (bf16).
kernel void mm2d_coop_acc(device bfloat* d [[buffer(0)]], device const bfloat* a [[buffer(1)]],
                          device const bfloat* b [[buffer(2)]], device const float* bias [[buffer(3)]],
                          constant int3& mnk [[buffer(4)]], uint2 tg [[threadgroup_position_in_grid]],
                          uint lane [[thread_index_in_simdgroup]]) {
  const int M = mnk.x, N = mnk.y, K = mnk.z;
  threadgroup bfloat as[8 * 32];  // [k][m]
  threadgroup bfloat bs[8 * 16];  // [k][n]
  const int m0 = int(tg.y) * 32, n0 = int(tg.x) * 16;
  auto tA = tensor<threadgroup bfloat, dextents<int32_t, 2>, tensor_inline>(as, dextents<int32_t, 2>(32, 8));
  auto tB = tensor<threadgroup bfloat, dextents<int32_t, 2>, tensor_inline>(bs, dextents<int32_t, 2>(16, 8));
  constexpr auto desc = matmul2d_descriptor(32, 16, 8, true, false, false, matmul2d_descriptor::mode::multiply_accumulate);
  matmul2d<desc, execution_simdgroup> mm;
  auto acc = mm.get_destination_cooperative_tensor<decltype(tA), decltype(tB), float>();
  auto tBias = tensor<device const float, dextents<int32_t, 2>, tensor_inline>(bias, dextents<int32_t, 2>(N, M));
  acc.load(tBias.slice(n0, m0));
  for (int k0 = 0; k0 < K; k0 += 8) {
    for (int i = int(lane); i < 8 * 32; i += 32) {
      const int k = k0 + i / 32, m = m0 + i % 32;
      as[i] = k < K && m < M ? a[long(k) * M + m] : bfloat(0.0f);
    }
    for (int i = int(lane); i < 8 * 16; i += 32) {
      const int k = k0 + i / 16, n = n0 + i % 16;
      bs[i] = k < K && n < N ? b[long(k) * N + n] : bfloat(0.0f);
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);
    auto sA = tA.slice<32, 8>(0, 0);
    mm.run(sA, tB, acc);
    simdgroup_barrier(mem_flags::mem_threadgroup);
  }
  auto tD = tensor<device bfloat, dextents<int32_t, 2>, tensor_inline>(d, dextents<int32_t, 2>(N, M));
  auto mD = tD.slice(n0, m0);
  acc.store(mD);
}

// The cooperative layout as a kernel sees it: per thread, its capacity, then (valid, n, m) per element.
kernel void mm2d_layout(device int* out [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
  constexpr auto desc = matmul2d_descriptor(24, 20, 8);
  matmul2d<desc, execution_simdgroups<2>> mm;
  auto acc = mm.get_destination_cooperative_tensor<tensor<device half, dextents<int32_t, 2>, tensor_inline>,
                                                   tensor<device half, dextents<int32_t, 2>, tensor_inline>, float>();
  device int* o = out + tid * (1 + 3 * 16);
  o[0] = acc.get_capacity();
  for (uint16_t i = 0; i < acc.get_capacity(); ++i) {
    const bool valid = acc.is_valid_element(i);
    o[1 + 3 * i] = valid;
    if (valid) {
      const auto idx = acc.get_multidimensional_index(i);
      o[2 + 3 * i] = idx[0];
      o[3 + 3 * i] = idx[1];
    }
  }
}

// An execution_simdgroups<4> op in a threadgroup of another size: reported.
kernel void mm2d_wrong_scope(device float* c [[buffer(0)]], device half* a [[buffer(1)]]) {
  auto tA = tensor<device half, dextents<int32_t, 2>, tensor_inline>(a, dextents<int32_t, 2>(8, 8));
  auto tC = tensor<device float, dextents<int32_t, 2>, tensor_inline>(c, dextents<int32_t, 2>(8, 8));
  matmul2d<matmul2d_descriptor(8, 8, 8), execution_simdgroups<4>> mm;
  mm.run(tA, tA, tC);
}
