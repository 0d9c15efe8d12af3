// The Metal backend: a GpuBackend (backends/gpu/gpu_backend.h) whose ops record Metal kernels on a
// metal::Device (device.h: MetalDevice on a Mac, EmuDevice anywhere). As MLX puts each primitive's GPU
// evaluation beside its kernels, every op is defined in its family's file, next to the encoders (encoders.h)
// it records: a decode token goes from the schedule (csrc/schedule/schedule.cpp) and GpuBackend
// (gpu_backend.cpp) straight into common/dense/proj/moe/gdn/attn/sample.cpp, and from there to
// Encoder::dispatch (backends/gpu/device.cpp). metal_backend.cpp builds the device-side model (each weight
// matrix over its mapped file, the small fp32 vectors uploaded once) and the families' scratch.
// Device formats: gpu_backend.h and encoders.h.
#pragma once
#include <memory>
#include <unordered_map>
#include <vector>

#include "../gpu/gpu_backend.h"
#include "device.h"
#include "encoders.h"

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

class MetalBackend final : public gpu::GpuBackend {
 public:
  MetalBackend(const Model& m, std::unique_ptr<Device> device, int max_rows, const MetalOptions& options)
      : MetalBackend(m, device.release(), max_rows, options) {}

  const char* kernel_label(gpu::KernelIndex k) const override { return kernel_name(KernelId(k)); }

  // ---- the ops (schedule/backend.h), each in its family's file
  // moe.cpp: a step must not end with the fused route's top-k pending (only moe_decode completes it)
  void begin(Phase phase, const Fusions& fusions) override;
  void commit() override;
  // common.cpp
  void rmsnorm(Act in, Act out, const Vec& w, int T) override;
  // dense.cpp
  void project(Act in, Act out, const Linear& W, int T, bool accumulate) override;
  void lm_head(int first, int rows) override;
  // proj.cpp
  void norm_project(Act in, const Vec& w, std::initializer_list<Projection> ps) override;
  void norm_lm_head(int row) override;
  // moe.cpp
  void moe_norm_route(int layer, const Vec& w) override;
  void moe_route(int layer, int T) override;
  void moe_prefill(int layer, int T) override;
  void moe_decode(int layer) override;
  // gdn.cpp
  void gdn_scan(int layer, int T) override;
  void gdn_step(int layer) override;
  // attn.cpp
  void attn_prepare(int layer, int T, int64_t pos) override;
  void attn_prefill(int layer, int T, int64_t pos) override;
  void attn_prepare_decode(int layer, int64_t pos) override;
  void attn_decode(int layer, int64_t pos) override;

 private:
  // The base owns the device from its first member on; dev_ is its Metal face (metal_backend.cpp).
  MetalBackend(const Model& m, Device* device, int max_rows, const MetalOptions& options);

  // ---- the GpuBackend hooks: encode_embed and encode_copy_rows in common.cpp, encode_select in sample.cpp
  void encode_embed(View ids, int T) override;
  void encode_copy_rows(View src, View dst, int rows, uint64_t row_bytes, uint64_t src_stride,
                        uint64_t dst_stride) override;
  void encode_select(View logits, View token, const SamplingParams* sample, uint64_t draws, View seen,
                     View counts) override;

  Encoder& enc() { return static_cast<Encoder&>(recording()); }  // dev_'s command buffers record Metal encoders

  // ---- the device-side model: built once by the constructor (metal_backend.cpp), looked up by the ops
  DeviceMatrix matrix(const Linear& L);
  DeviceVec vec(const Vec& v);
  const DeviceMatrix& matrix_of(const Linear& L) const;  // dense.cpp
  const DeviceVec& vec_of(const Vec& v) const;           // common.cpp

  // ---- the dequant ablation (Fusions::dequant off, decode only; dense.cpp)
  uint64_t dequant_bytes(const DeviceMatrix& W) const;
  void decode_matrices(const DeviceMatrix* const* W, int n, DeviceMatrix* out);
  DeviceMatrix lm_head_matrix();

  bool proj_fits() const;  // proj.cpp
  void attend_one_row(int layer, int64_t pos, AttnPrepareInputs prep);  // attn.cpp

  Device& dev_;
  std::vector<std::shared_ptr<gpu::Buffer>> files_;  // each mapped weight file, wrapped once
  std::vector<std::shared_ptr<Buffer>> vec_buffers_;
  std::unordered_map<const Linear*, DeviceMatrix> matrices_;  // every Linear of the model
  std::unordered_map<const Vec*, DeviceVec> vecs_;            // every norm weight the ops take by Vec
  DeviceMatrix embed_, lm_head_;
  DeviceVec norm_;
  std::vector<GdnDevice> gdn_;
  std::vector<AttnDevice> attn_;
  std::vector<MoeDevice> moe_;
  std::shared_ptr<MoeScratch> moe_scratch_;
  std::shared_ptr<GdnScratch> gdn_scratch_;
  std::shared_ptr<AttnScratch> attn_scratch_;
  std::shared_ptr<Buffer> route_ids_, route_w_, route_ids_host_;
  std::shared_ptr<Buffer> dequant_;  // Fusions::dequant off: the bf16 copies of one dispatch's matrices
  MetalOptions opt_;
  bool topk_pending_ = false;  // moe_norm_route left the top-k to moe_decode's gate/up GEMV
};

// `max_rows`: rows one prefill chunk may have (activation buffers are sized for it).
std::unique_ptr<gpu::GpuBackend> make_metal_backend(const Model& model, std::unique_ptr<Device> device, int max_rows,
                                                    const MetalOptions& options = {});

}  // namespace lily::metal
