// Weights of one checkpoint, memory-mapped and never copied: the safetensors files are mapped read-only
// once, and every tensor is a view into a mapping. src/lily/checkpoint.py is the one place that knows
// checkpoint layouts (HF or MLX names, fused experts, +1 norms); it hands C++ a list of WeightSpec with
// canonical names, and Model below turns them into the per-layer structs the schedule and backends use
// (llama2.c's TransformerWeights, with pointers into the mapping).
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "config.h"

namespace lily {

enum class DType : uint8_t { f32, bf16, f16, u32 };
size_t dtype_size(DType t);
const char* dtype_name(DType t);

// One tensor inside one mapped file.
struct TensorRef {
  int file = -1;               // index into the file list; -1 = absent
  uint64_t offset = 0;         // byte offset from the start of the file
  uint64_t nbytes = 0;
  DType dtype = DType::f32;
  std::vector<int64_t> shape;
};

// A checkpoint tensor under its canonical name, with how to read it (see checkpoint.py).
struct WeightSpec {
  std::string name;            // canonical: "layers.3.self_attn.q_proj", "embed_tokens", ...
  TensorRef w, scales, biases; // scales/biases present only for quantised weights
  int bits = 0;                // 0 = dense (f32/bf16/f16); 4 or 8 = MLX affine groups
  int group = 0;               // quantisation group size (64)
  int64_t experts = 0;         // > 0 for stacked expert matrices [E, rows, cols]
  int64_t rows = 0, cols = 0;  // logical matrix of one expert: y[rows] = W x[cols]; vectors: rows = n, cols = 1
  int64_t stored_rows = 0;     // rows per expert as stored (2I for HF's fused gate_up_proj)
  int64_t row_offset = 0;      // first logical row inside the stored rows (I for the `up` half of gate_up)
  bool add_one = false;        // zero-centred RMSNorm weight stored as w (HF); effective scale 1 + w
};

class MappedFile {
 public:
  explicit MappedFile(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  const uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  const uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
};

// y = W x for W [rows, cols] (one expert's slice when experts > 0).
struct Linear {
  std::string name;
  int file = -1;                       // mapping that holds w (and, for MLX files, its scales/biases)
  const uint8_t* w = nullptr;          // first logical row of expert 0
  const uint8_t* scales = nullptr;     // quantised only
  const uint8_t* biases = nullptr;
  DType wdtype = DType::bf16, sdtype = DType::bf16;
  int bits = 0, group = 0;
  int64_t rows = 0, cols = 0, experts = 0;
  uint64_t w_row_bytes = 0, s_row_bytes = 0;        // stride between rows
  uint64_t w_expert_bytes = 0, s_expert_bytes = 0;  // stride between experts
  // Byte offsets of w/scales/biases inside their file, for backends that bind the mapping as a buffer.
  uint64_t w_offset = 0, s_offset = 0, b_offset = 0;
  int s_file = -1, b_file = -1;

  bool quantized() const { return bits != 0; }
  const uint8_t* wrow(int64_t expert, int64_t r) const { return w + expert * w_expert_bytes + r * w_row_bytes; }
  const uint8_t* srow(int64_t expert, int64_t r) const { return scales + expert * s_expert_bytes + r * s_row_bytes; }
  const uint8_t* brow(int64_t expert, int64_t r) const { return biases + expert * s_expert_bytes + r * s_row_bytes; }
  // Bytes of one expert's (or the dense) matrix as stored: what a kernel must read to use it once.
  uint64_t bytes_per_matrix() const;
};

// Small 1-D parameters (norm weights, A_log, dt_bias, the conv filter) converted once to fp32 at load:
// they are a few KB per layer, and both backends want them in fp32.
struct Vec {
  std::string name;
  std::vector<float> v;
  int64_t size() const { return (int64_t)v.size(); }
  const float* data() const { return v.data(); }
};

struct AttentionWeights {
  Linear q, k, v, o;        // q: [2·n_q·d, H] query rows then gate rows per head; o: [H, n_q·d]
  Vec q_norm, k_norm;       // [d], effective (1 + w) already applied
};

struct DeltaNetWeights {
  Linear qkv, z, b, a, out; // qkv [C, H]; z [V_dim, H]; b, a [n_v, H]; out [H, V_dim]
  Vec conv;                 // [C, k_c] depthwise filter, tap j multiplies u_{t-(k_c-1)+j}
  Vec A_log, dt_bias;       // [n_v]
  Vec norm;                 // [d_v] gated-norm weight (plain, not 1 + w)
};

struct MoeWeights {
  Linear router;            // [E, H]
  Linear gate, up, down;    // experts: gate/up [E, I, H], down [E, H, I]
  Linear shared_gate_proj, shared_up, shared_down;  // [I_s, H], [I_s, H], [H, I_s]
  Linear shared_gate;       // [1, H] sigmoid gate of the shared expert
};

struct LayerWeights {
  Vec input_norm, post_norm;  // [H], effective (1 + w)
  AttentionWeights attn;      // full-attention layers only
  DeltaNetWeights gdn;        // linear-attention layers only
  MoeWeights moe;
};

// The whole model: config + mapped files + per-layer weight views.
class Model {
 public:
  Model(ModelConfig config, const std::vector<std::string>& files, const std::vector<WeightSpec>& specs);
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;
  const ModelConfig& config() const { return config_; }
  const std::vector<std::unique_ptr<MappedFile>>& files() const { return files_; }

  ModelConfig config_;
  std::vector<std::unique_ptr<MappedFile>> files_;
  Linear embed, lm_head;    // [V, H] each
  Vec norm;                 // [H] final norm, effective
  std::vector<LayerWeights> layers;

 private:
  std::unordered_map<std::string, const WeightSpec*> by_name_;
  const WeightSpec& spec(const std::string& name) const;
  Linear linear(const std::string& name, int64_t rows, int64_t cols, int64_t experts = 0) const;
  Vec vec(const std::string& name, int64_t n) const;
};

float bf16_to_f32(uint16_t h);
uint16_t f32_to_bf16(float f);  // round to nearest even
float f16_to_f32(uint16_t h);

}  // namespace lily
