#include "weights.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>

namespace lily {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32: return 4;
    case DType::bf16: return 2;
    case DType::f16: return 2;
    case DType::u32: return 4;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "F32";
    case DType::bf16: return "BF16";
    case DType::f16: return "F16";
    case DType::u32: return "U32";
  }
  return "?";
}

float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: renormalise
      exp = 127 - 15 + 1;
      while (!(man & 0x400)) { man <<= 1; --exp; }
      u = sign | (exp << 23) | ((man & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (man << 13);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

MappedFile::MappedFile(const std::string& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) throw std::runtime_error("[weights] cannot open " + path + ": " + std::strerror(errno));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    throw std::runtime_error("[weights] cannot stat " + path + ": " + std::strerror(errno));
  }
  size_ = uint64_t(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      ::close(fd);
      throw std::runtime_error("[weights] cannot mmap " + path + ": " + std::strerror(errno));
    }
    data_ = static_cast<const uint8_t*>(p);
  }
  ::close(fd);  // the mapping keeps the file alive
}

MappedFile::~MappedFile() {
  if (data_) ::munmap(const_cast<uint8_t*>(data_), size_);
}

uint64_t Linear::bytes_per_matrix() const {
  uint64_t b = uint64_t(rows) * w_row_bytes;
  if (quantized()) b += 2 * uint64_t(rows) * uint64_t(cols / group) * dtype_size(sdtype);
  return b;
}

static float load_scalar(const uint8_t* p, DType t, int64_t i) {
  switch (t) {
    case DType::f32: { float f; std::memcpy(&f, p + 4 * i, 4); return f; }
    case DType::bf16: { uint16_t h; std::memcpy(&h, p + 2 * i, 2); return bf16_to_f32(h); }
    case DType::f16: { uint16_t h; std::memcpy(&h, p + 2 * i, 2); return f16_to_f32(h); }
    case DType::u32: break;
  }
  throw std::invalid_argument("[weights] integer tensor where a float vector was expected");
}

Model::Model(ModelConfig config, const std::vector<std::string>& files, const std::vector<WeightSpec>& specs)
    : config_(std::move(config)) {
  config_.validate();
  for (const auto& f : files) files_.push_back(std::make_unique<MappedFile>(f));
  for (const auto& s : specs) by_name_[s.name] = &s;

  // Bounds of every referenced tensor against its mapping: checkpoint.py checks headers, this guards the
  // pointers we are about to hand to kernels.
  for (const auto& s : specs) {
    for (const TensorRef* t : {&s.w, &s.scales, &s.biases}) {
      if (t->file < 0) continue;
      if (t->file >= (int)files_.size())
        throw std::invalid_argument("[weights] " + s.name + ": file index out of range");
      const auto& mf = *files_[t->file];
      if (t->offset + t->nbytes > mf.size())
        throw std::invalid_argument("[weights] " + mf.path() + ": tensor " + s.name + " ends at byte " +
                                    std::to_string(t->offset + t->nbytes) + " past the end of the file (" +
                                    std::to_string(mf.size()) + " bytes)");
    }
  }

  const ModelConfig& c = config_;
  const int64_t H = c.hidden;
  embed = linear("embed_tokens", c.vocab, H);
  lm_head = linear("lm_head", c.vocab, H);
  norm = vec("norm", H);
  layers.resize(c.layers);
  for (int i = 0; i < c.layers; ++i) {
    const std::string p = "layers." + std::to_string(i) + ".";
    LayerWeights& L = layers[i];
    L.input_norm = vec(p + "input_layernorm", H);
    L.post_norm = vec(p + "post_attention_layernorm", H);
    if (c.is_attention(i)) {
      L.attn.q = linear(p + "self_attn.q_proj", c.q_proj_rows(), H);
      L.attn.k = linear(p + "self_attn.k_proj", c.kv_dim(), H);
      L.attn.v = linear(p + "self_attn.v_proj", c.kv_dim(), H);
      L.attn.o = linear(p + "self_attn.o_proj", H, int64_t(c.n_q) * c.head_dim);
      L.attn.q_norm = vec(p + "self_attn.q_norm", c.head_dim);
      L.attn.k_norm = vec(p + "self_attn.k_norm", c.head_dim);
    } else {
      L.gdn.qkv = linear(p + "linear_attn.in_proj_qkv", c.conv_dim(), H);
      L.gdn.z = linear(p + "linear_attn.in_proj_z", c.value_dim(), H);
      L.gdn.b = linear(p + "linear_attn.in_proj_b", c.lin_nv, H);
      L.gdn.a = linear(p + "linear_attn.in_proj_a", c.lin_nv, H);
      L.gdn.out = linear(p + "linear_attn.out_proj", H, c.value_dim());
      L.gdn.conv = vec(p + "linear_attn.conv1d", int64_t(c.conv_dim()) * c.conv_kernel);
      L.gdn.A_log = vec(p + "linear_attn.A_log", c.lin_nv);
      L.gdn.dt_bias = vec(p + "linear_attn.dt_bias", c.lin_nv);
      L.gdn.norm = vec(p + "linear_attn.norm", c.lin_dv);
    }
    MoeWeights& M = L.moe;
    M.router = linear(p + "mlp.gate", c.experts, H);
    M.gate = linear(p + "mlp.experts.gate_proj", c.moe_inter, H, c.experts);
    M.up = linear(p + "mlp.experts.up_proj", c.moe_inter, H, c.experts);
    M.down = linear(p + "mlp.experts.down_proj", H, c.moe_inter, c.experts);
    M.shared_gate_proj = linear(p + "mlp.shared_expert.gate_proj", c.shared_inter, H);
    M.shared_up = linear(p + "mlp.shared_expert.up_proj", c.shared_inter, H);
    M.shared_down = linear(p + "mlp.shared_expert.down_proj", H, c.shared_inter);
    M.shared_gate = linear(p + "mlp.shared_expert_gate", 1, H);
  }
}

const WeightSpec& Model::spec(const std::string& name) const {
  auto it = by_name_.find(name);
  if (it == by_name_.end()) throw std::invalid_argument("[weights] missing tensor " + name);
  return *it->second;
}

Linear Model::linear(const std::string& name, int64_t rows, int64_t cols, int64_t experts) const {
  const WeightSpec& s = spec(name);
  auto mismatch = [&](const std::string& what) {
    return std::invalid_argument("[weights] " + name + ": " + what + " (expected " + std::to_string(experts) +
                                 " experts of [" + std::to_string(rows) + ", " + std::to_string(cols) + "], got " +
                                 std::to_string(s.experts) + " of [" + std::to_string(s.rows) + ", " +
                                 std::to_string(s.cols) + "])");
  };
  if (s.rows != rows || s.cols != cols || s.experts != experts) throw mismatch("shape");
  if (s.w.file < 0) throw std::invalid_argument("[weights] " + name + ": no data");
  Linear L;
  L.name = name;
  L.file = s.w.file;
  L.rows = rows;
  L.cols = cols;
  L.experts = experts;
  L.bits = s.bits;
  L.group = s.group;
  L.wdtype = s.w.dtype;
  const int64_t stored = s.stored_rows ? s.stored_rows : rows;
  const uint8_t* wbase = files_[s.w.file]->data() + s.w.offset;
  if (s.bits == 0) {
    if (s.w.dtype == DType::u32) throw mismatch("unquantised integer weight");
    L.w_row_bytes = uint64_t(cols) * dtype_size(s.w.dtype);
  } else {
    if (s.bits != 4 && s.bits != 8) throw std::invalid_argument("[weights] " + name + ": unsupported bits " + std::to_string(s.bits));
    if (s.group <= 0 || cols % s.group != 0 || cols * s.bits % 32 != 0) throw mismatch("group size does not divide columns");
    if (s.scales.file < 0 || s.biases.file < 0) throw std::invalid_argument("[weights] " + name + ": quantised weight without scales/biases");
    L.sdtype = s.scales.dtype;
    L.w_row_bytes = uint64_t(cols) * s.bits / 8;
    L.s_row_bytes = uint64_t(cols / s.group) * dtype_size(s.scales.dtype);
    L.s_expert_bytes = uint64_t(stored) * L.s_row_bytes;
    L.s_file = s.scales.file;
    L.b_file = s.biases.file;
    L.s_offset = s.scales.offset + uint64_t(s.row_offset) * L.s_row_bytes;
    L.b_offset = s.biases.offset + uint64_t(s.row_offset) * L.s_row_bytes;
    L.scales = files_[s.scales.file]->data() + L.s_offset;
    L.biases = files_[s.biases.file]->data() + L.b_offset;
  }
  L.w_expert_bytes = uint64_t(stored) * L.w_row_bytes;
  L.w_offset = s.w.offset + uint64_t(s.row_offset) * L.w_row_bytes;
  L.w = wbase + uint64_t(s.row_offset) * L.w_row_bytes;
  const uint64_t need = uint64_t(experts ? experts : 1) * L.w_expert_bytes;
  if (need > s.w.nbytes) throw mismatch("tensor smaller than its shape");
  return L;
}

Vec Model::vec(const std::string& name, int64_t n) const {
  const WeightSpec& s = spec(name);
  const int64_t count = s.w.nbytes / int64_t(dtype_size(s.w.dtype));
  if (count != n)
    throw std::invalid_argument("[weights] " + name + ": expected " + std::to_string(n) + " values, got " +
                                std::to_string(count));
  Vec v;
  v.name = name;
  v.v.resize(n);
  const uint8_t* p = files_[s.w.file]->data() + s.w.offset;
  for (int64_t i = 0; i < n; ++i) v.v[i] = load_scalar(p, s.w.dtype, i) + (s.add_one ? 1.f : 0.f);
  return v;
}

}  // namespace lily
