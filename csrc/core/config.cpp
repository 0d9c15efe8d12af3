#include "config.h"

#include <stdexcept>

namespace lily {

static void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("[config] " + what);
}

void ModelConfig::validate() const {
  require(vocab > 0 && hidden > 0 && layers > 0, "vocab_size, hidden_size and num_hidden_layers must be positive");
  require(n_q > 0 && n_kv > 0 && n_q % n_kv == 0,
          "num_attention_heads (" + std::to_string(n_q) + ") must be a positive multiple of num_key_value_heads (" +
              std::to_string(n_kv) + ")");
  require(head_dim > 0 && head_dim % 2 == 0, "head_dim must be even and positive");
  require(rotary_dim >= 0 && rotary_dim <= head_dim && rotary_dim % 2 == 0,
          "rotary dims (head_dim * partial_rotary_factor = " + std::to_string(rotary_dim) + ") must be even and <= head_dim");
  require(lin_nk > 0 && lin_nv > 0 && lin_nv % lin_nk == 0,
          "linear_num_value_heads must be a positive multiple of linear_num_key_heads");
  require(lin_dk > 0 && lin_dv > 0, "linear key/value head dims must be positive");
  require(conv_kernel >= 1, "linear_conv_kernel_dim must be >= 1");
  require(experts > 0 && top_k > 0 && top_k <= experts, "num_experts_per_tok must be in [1, num_experts]");
  require(moe_inter > 0 && shared_inter > 0, "moe/shared expert intermediate sizes must be positive");
  require((int)full_attention.size() == layers, "layer_types must have num_hidden_layers entries");
}

}  // namespace lily
