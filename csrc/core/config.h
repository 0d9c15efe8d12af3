// Model hyperparameters of one qwen3_5_moe checkpoint, as parsed by src/lily/checkpoint.py.
// Everything downstream (schedule, backends, kernels' argument structs) sizes itself from this struct;
// nothing else in C++ reads config.json.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace lily {

struct ModelConfig {
  int vocab = 0;            // V (padded vocabulary, lm_head rows)
  int hidden = 0;           // H
  int layers = 0;           // L
  // gated attention
  int n_q = 0, n_kv = 0, head_dim = 0;  // 16, 2, 256 in the real model
  int rotary_dim = 0;                   // int(head_dim * partial_rotary_factor)
  float rope_theta = 0.f;
  // Gated DeltaNet
  int lin_nk = 0, lin_nv = 0, lin_dk = 0, lin_dv = 0;  // 16, 32, 128, 128
  int conv_kernel = 0;                                 // 4
  // MoE
  int experts = 0, top_k = 0, moe_inter = 0, shared_inter = 0;
  float rms_eps = 1e-6f;
  int max_position = 0;                 // max_position_embeddings
  std::vector<uint8_t> full_attention;  // [L], 1 where layer i is gated attention

  int key_dim() const { return lin_nk * lin_dk; }     // K_dim
  int value_dim() const { return lin_nv * lin_dv; }   // V_dim
  int conv_dim() const { return 2 * key_dim() + value_dim(); }  // C
  int q_proj_rows() const { return 2 * n_q * head_dim; }        // query + output gate
  int kv_dim() const { return n_kv * head_dim; }
  bool is_attention(int layer) const { return full_attention.at(layer) != 0; }

  // Throws std::invalid_argument naming the field when the geometry cannot be this model family.
  void validate() const;
};

}  // namespace lily
